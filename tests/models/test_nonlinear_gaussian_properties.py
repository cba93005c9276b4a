"""Properties of ``NonlinearGaussianSSM`` over drawn maps (hypothesis): time dependence is explicit.

The maps are affine, ``f(x) = A x + b s`` and ``g(x) = C x + c s``, with ``s = F`` (a default
argument value, ``F = 0.5``) for a map without time and ``s = t + 1`` for one that takes the
0-based time index, written in every style a user would: a plain lambda, a lambda or ``def`` with a
default second argument, a keyword-only parameter, a ``functools.partial``, an ``nn.Module``; and
the time-dependent ones marked with ``time_dependent`` (a lambda, a decorated ``def``, a module, a
module whose ``forward`` is decorated, a decorated module class). The invariant: the model calls
each map as written (``transition_fn(x, t)`` equals ``A x + b s``), ``simulate`` is finite, and the
EKF, the EP marginals (both schedules) and the EP evidence equal the exact answer of the affine
chain with offsets ``b s_t`` and ``c s_t`` (``ops.affine_chain``, float64); an unmarked map whose
second positional parameter has no default is refused, naming the argument and the marker.
"""

import functools
import warnings

import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc import EPSmoother
from pyro_smc.infer import extended_kalman_filter
from pyro_smc.infer.gaussian.ep import EPConvergenceWarning
from pyro_smc.models import NonlinearGaussianSSM, time_dependent
from pyro_smc.ops.affine_chain import affine_chain_smoother
from tests.models.test_linear_gaussian_properties import corrupt
from tests.property_cases import ENGINE, FLOAT_DTYPES, SEEDS, assert_clear_error, assert_finite, eps, gen

F64 = torch.float64
FORCING = 0.5
PLAIN_STYLES = ["lambda", "default lambda", "default def", "keyword-only", "partial", "module"]
TIMED_STYLES = ["marked lambda", "decorated def", "marked module", "decorated forward", "decorated class"]


def make_map(style: str, M: torch.Tensor, b: torch.Tensor):
    """``x -> x M^T + b s`` in ``style`` (module docstring); ``s = t + 1`` for the timed styles."""

    def affine(x, s):
        return x @ M.T + b * s

    if style == "lambda":
        return lambda x: affine(x, FORCING)
    if style == "default lambda":
        return lambda x, F=FORCING: affine(x, F)
    if style == "default def":

        def step(x, forcing=FORCING):
            return affine(x, forcing)

        return step
    if style == "keyword-only":

        def step(x, *, forcing=FORCING):
            return affine(x, forcing)

        return step
    if style == "partial":
        return functools.partial(lambda x, M, forcing: affine(x, forcing), M=M, forcing=FORCING)
    if style == "module":

        class Plain(torch.nn.Module):
            def forward(self, x, forcing=FORCING):
                return affine(x, forcing)

        return Plain()
    if style == "marked lambda":
        return time_dependent(lambda x, t: affine(x, t + 1))
    if style == "decorated def":

        @time_dependent
        def timed(x, t):
            return affine(x, t + 1)

        return timed
    if style == "marked module":

        class Timed(torch.nn.Module):
            def forward(self, x, t):
                return affine(x, t + 1)

        return time_dependent(Timed())
    if style == "decorated forward":

        class Timed(torch.nn.Module):
            @time_dependent
            def forward(self, x, t):
                return affine(x, t + 1)

        return Timed()

    @time_dependent
    class TimedClass(torch.nn.Module):
        def forward(self, x, t):
            return affine(x, t + 1)

    return TimedClass()


@st.composite
def affine_problems(draw):
    dtype, d, e, T = draw(FLOAT_DTYPES), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 5]))
    f_style, g_style = draw(st.sampled_from(PLAIN_STYLES + TIMED_STYLES)), draw(st.sampled_from(PLAIN_STYLES + TIMED_STYLES))
    g = gen(draw(SEEDS))
    A = torch.randn(d, d, generator=g, dtype=F64)
    A = 0.9 * A / torch.linalg.eigvals(A).abs().max().clamp_min(1e-3)
    C, b, c = torch.randn(e, d, generator=g, dtype=F64), torch.randn(d, generator=g, dtype=F64), torch.randn(e, generator=g, dtype=F64)
    Q, R = 0.3 * torch.eye(d, dtype=F64), 0.5 * torch.eye(e, dtype=F64)
    m0, P0 = torch.randn(d, generator=g, dtype=F64), torch.eye(d, dtype=F64)
    return dict(dtype=dtype, T=T, styles=(f_style, g_style), A=A, C=C, b=b, c=c, Q=Q, R=R, m0=m0, P0=P0, seed=draw(SEEDS))


def forcing(style: str, T: int) -> torch.Tensor:
    """``s_t`` for ``t = 0 .. T-1``."""
    return torch.arange(1.0, T + 1, dtype=F64) if style in TIMED_STYLES else torch.full((T,), FORCING, dtype=F64)


def build(problem):
    dt = problem["dtype"]
    cast = {k: problem[k].to(dt) for k in ("A", "C", "b", "c", "Q", "R", "m0", "P0")}
    f = make_map(problem["styles"][0], cast["A"], cast["b"])
    g = make_map(problem["styles"][1], cast["C"], cast["c"])
    return NonlinearGaussianSSM(f, cast["Q"], g, cast["R"], cast["m0"], cast["P0"])


def exact(problem, ys):
    """The affine chain's filter, smoother and evidence in float64: ``x_{t+1} = A x_t + b s_t``,
    ``y_t = C x_t + c s_t``."""
    T, d, e = problem["T"], problem["A"].shape[0], problem["C"].shape[0]
    sf, sg = forcing(problem["styles"][0], T), forcing(problem["styles"][1], T)
    A, C = problem["A"], problem["C"]
    ys = ys.double()
    return affine_chain_smoother(
        problem["m0"], problem["P0"], A.expand(T - 1, d, d), problem["b"] * sf[: T - 1, None], problem["Q"].expand(T - 1, d, d),
        C.expand(T, e, d), ys - problem["c"] * sg[:, None], problem["R"].expand(T, e, e), parallel=False,
    )


@ENGINE
@given(affine_problems())
def test_property_every_map_is_called_as_written_and_every_engine_is_exact(problem):
    ssm = build(problem)
    f_style, g_style = problem["styles"]
    x = torch.randn(4, problem["A"].shape[0], dtype=problem["dtype"], generator=gen(problem["seed"]))
    for fn, M, v, style in ((ssm.transition_fn, "A", "b", f_style), (ssm.observation_fn, "C", "c", g_style)):
        for t in (0, 3):
            s = t + 1 if style in TIMED_STYLES else FORCING
            expected = x.double() @ problem[M].T + problem[v] * s
            torch.testing.assert_close(fn(x, t).double(), expected, rtol=1e2 * eps(problem["dtype"]), atol=1e2 * eps(problem["dtype"]) * 10)
    xs, ys = ssm.simulate(problem["T"], generator=gen(problem["seed"]))
    assert_finite((xs, ys), "simulate")
    oracle = exact(problem, ys)
    tol = 1e4 * eps(problem["dtype"])
    ekf = extended_kalman_filter(ssm, ys)
    torch.testing.assert_close(ekf.means.double(), oracle.filtering_means, rtol=tol, atol=tol)
    torch.testing.assert_close(ekf.log_evidence.double(), oracle.log_evidence_increments.sum(), rtol=tol, atol=tol * problem["T"])
    for schedule in ("sequential", "parallel"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EPConvergenceWarning)  # float32 rounding may sit above tol
            ep = EPSmoother(ssm, projection="unscented", schedule=schedule, max_iter=3).smooth(ys)
        torch.testing.assert_close(ep.means.double(), oracle.means, rtol=tol, atol=tol)
        torch.testing.assert_close(ep.covariances.double(), oracle.covariances, rtol=tol, atol=tol)
        torch.testing.assert_close(ep.log_evidence.double(), oracle.log_evidence_increments.sum(), rtol=tol, atol=tol * problem["T"])


UNMARKED_TIMED = {
    "def f(x, t)": lambda M, b: (lambda x, t: x @ M.T + b * t),
    "module forward(x, t)": lambda M, b: type("Unmarked", (torch.nn.Module,), {"forward": lambda self, x, t: x @ M.T + b * t})(),
    "def f(x, t, k=1)": lambda M, b: (lambda x, t, k=1: x @ M.T + b * t * k),
}


@ENGINE
@given(affine_problems(), st.sampled_from(sorted(UNMARKED_TIMED)), st.sampled_from(["transition", "observation"]))
def test_property_an_unmarked_map_with_a_required_second_parameter_is_refused(problem, style, argument):
    ssm = build(problem)
    M, v = ("A", "b") if argument == "transition" else ("C", "c")
    kwargs = dict(transition=ssm.transition, transition_cov=ssm.transition_cov, observation=ssm.observation,
                  observation_cov=ssm.observation_cov, init_mean=ssm.init_mean, init_cov=ssm.init_cov)
    kwargs[argument] = UNMARKED_TIMED[style](problem[M].to(problem["dtype"]), problem[v].to(problem["dtype"]))
    try:
        NonlinearGaussianSSM(**kwargs)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, argument)
        assert "time_dependent" in str(error)
    else:
        raise AssertionError(f"an unmarked {style} {argument} was accepted")
    kwargs[argument] = time_dependent(kwargs[argument])  # the fix the message names
    assert getattr(NonlinearGaussianSSM(**kwargs), f"{argument}_takes_time")


@ENGINE
@given(affine_problems(), st.sampled_from(["transition_cov", "observation_cov", "init_cov", "init_mean"]),
       st.sampled_from(["shape", "dtype", "nan", "negative", "indefinite", "asymmetric"]))
def test_property_a_corrupted_argument_is_refused_by_name(problem, name, kind):
    ssm = build(problem)
    kwargs = dict(transition=ssm.transition, transition_cov=ssm.transition_cov, observation=ssm.observation,
                  observation_cov=ssm.observation_cov, init_mean=ssm.init_mean, init_cov=ssm.init_cov)
    if name == "init_mean" and kind in ("negative", "indefinite", "asymmetric"):
        kind = "nan"
    if kind == "asymmetric" and kwargs[name].shape[-1] == 1:
        kind = "negative"
    kwargs[name] = corrupt(kwargs[name], kind)
    # init_mean sets the model's dtype: another one makes every covariance the odd one out.
    expected = ("transition_cov", "observation_cov", "init_cov") if (name, kind) == ("init_mean", "dtype") else (name,)
    if (name, kind) == ("observation_cov", "shape"):
        expected = ("observation_cov",)
    try:
        NonlinearGaussianSSM(**kwargs)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, *expected)
    else:
        raise AssertionError(f"{name} with {kind} was accepted")
