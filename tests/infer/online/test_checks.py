"""OnlineVariationalFilter never reports a wrong number silently (issue 26).

The running ELBO is a lower bound on the exact (Kalman) log-evidence up to its Monte Carlo error,
whatever the scale of the state; a step whose kernel leaves the value regression's region warns;
a scalar observation is not broadcast into a vector site; ``parameters()`` lists the model's
parameters; and a non-finite mean, covariance or ELBO is an error naming the step.
"""

import math
import os
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroParam

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.infer.online import OnlineFilterWarning
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops import kalman


class AR1:
    """``x_0 ~ N(0, q^2 I)``, ``x_t = a x_{t-1} + N(0, q^2 I)``, ``y_t = x_t + N(0, r^2 I)``, written as
    a new user writes it (independent Normals, no shape checks of its own)."""

    def __init__(self, d, a=0.9, q=1.0, r=1e-4, dtype=torch.float64):
        self.d, self.a, self.q, self.r, self.dtype = d, a, q, r, dtype

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = self.a * state["x"] if "x" in state else torch.zeros(self.d, dtype=self.dtype)
        x = pyro.sample(f"x_{self.t}", dist.Normal(loc, self.q).to_event(1))
        state["x"] = x
        pyro.sample(f"y_{self.t}", dist.Normal(x, self.r).to_event(1), obs=y)
        self.t += 1

    def kalman(self, ys):
        eye = torch.eye(self.d, dtype=ys.dtype)
        q2, r2 = self.q**2 * eye, self.r**2 * eye
        return kalman.kalman_filter(ys, self.a * eye, q2, eye, r2, torch.zeros(self.d, dtype=ys.dtype), q2)

    def simulate(self, T, seed):
        g = torch.Generator().manual_seed(seed)
        x = self.q * torch.randn(self.d, generator=g, dtype=self.dtype)
        xs = []
        for t in range(T):
            if t:
                x = self.a * x + self.q * torch.randn(self.d, generator=g, dtype=self.dtype)
            xs.append(x)
        xs = torch.stack(xs)
        return xs + self.r * torch.randn(xs.shape, generator=g, dtype=self.dtype)


def _run(model, ys, seed, **kwargs):
    pyro.set_rng_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnlineFilterWarning)
        return OnlineVariationalFilter(model, StreamingFilterGuide(model.d), **kwargs).run(ys)


# Issue 26, case 4: num_iterations=5 at r = 1e-4 reported +3e17 against an exact log p(y) of -25.7.
# The default 100 iterations at every r under PYRO_SMC_FULL=1; by default at the r = 1e-4.
FULL = os.environ.get("PYRO_SMC_FULL") == "1"


@pytest.mark.parametrize("num_iterations", [1, 3, 5, 100])
@pytest.mark.parametrize("r", [1e-4, 1e-2, 1.0])
def test_running_elbo_is_below_the_kalman_evidence(num_iterations, r):
    if num_iterations == 100 and r != 1e-4 and not FULL:
        pytest.skip("the default settings at r = 1e-4 only (PYRO_SMC_FULL=1 runs all)")
    model = AR1(2, r=r)
    ys = model.simulate(8, seed=0)
    exact = float(model.kalman(ys).log_evidence)
    for seed in range(2 if num_iterations == 100 else 3):
        vf = _run(model, ys, seed, num_iterations=num_iterations, num_regression_samples=128)
        elbo, se = float(vf.log_evidence), float(vf.log_evidence_standard_error)
        assert math.isfinite(elbo) and math.isfinite(se), seed
        assert elbo <= exact + 5 * se + 1e-9, (seed, elbo, exact, se)
        # Laplace starts are exact here up to Monte Carlo error, so the bound is also close.
        assert elbo > exact - 2.0, (seed, elbo, exact)
        # The filtering means are Kalman's within a posterior sd (the start is exact up to the
        # Monte Carlo error of the predicted moments, a few hundredths of an sd).
        kf = model.kalman(ys)
        sd = kf.covariances.diagonal(dim1=-2, dim2=-1).sqrt()
        assert ((vf.result.filtering_means - kf.means).abs() < sd).all(), seed


def test_the_filter_does_not_depend_on_the_scale_of_the_state():
    """The cause of case 4: Adam's steps were in absolute units (0.01 is 100 posterior sds at
    r = 1e-4). Rescaling the state and the data by c must rescale the answer exactly: the same
    seed gives means c times as large and an ELBO lower by T d log c."""
    base, c, T = AR1(2, q=1.0, r=0.5), 1e-4, 5
    scaled = AR1(2, q=c * base.q, r=c * base.r)
    ys = base.simulate(T, seed=1)
    out = [_run(m, y, 0, num_iterations=5, num_regression_samples=64) for m, y in ((base, ys), (scaled, c * ys))]
    torch.testing.assert_close(out[1].result.filtering_means, c * out[0].result.filtering_means, rtol=1e-6, atol=0)
    torch.testing.assert_close(out[1].log_evidence, out[0].log_evidence - T * 2 * math.log(c), rtol=1e-9, atol=1e-6)


def test_a_step_whose_kernel_leaves_the_value_regression_warns():
    """lr=10 moves the kernel's mean by ~10 of its sds (and its log sds by ~10) in one iteration:
    U_{t-1} is then evaluated far outside the region it was fitted on."""
    model = AR1(2, r=1e-2)
    ys = model.simulate(4, seed=0)
    pyro.set_rng_seed(0)
    # stop_sigmas=None: the exact start passes the gradient check, and the step must iterate;
    # initial_lr=0.03: step 0 stays sane, so that step 1's iteration is the first at lr=10.
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(2), num_iterations=1, lr=10.0, initial_lr=0.03, stop_sigmas=None)
    with pytest.warns(OnlineFilterWarning, match=r"step 1\b.*num_iterations.*lr"):
        vf.run(ys)


def test_a_step_that_runs_out_of_iterations_from_a_poor_start_warns():
    """From ``initialize="predict"`` (the prediction, not the Laplace fit) a step that runs all
    its iterations without meeting its stopping rule can leave ``q_t`` far off, and the value
    regression fitted on its draws biased where the next kernel evaluates it: a new user's
    Poisson model ended with a running ELBO 12.7 nats (6 standard errors) above ``log p(y)``,
    every kernel inside the extrapolation limit, and no warning. Such steps now warn and are
    listed in ``unreliable_steps``; from the Laplace start the same settings do not warn."""
    model = AR1(2, r=1e-2)
    ys = model.simulate(4, seed=0)
    pyro.set_rng_seed(0)
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(2), num_iterations=3, initialize="predict")
    with pytest.warns(OnlineFilterWarning, match=r"step 0\b.*all num_iterations=3 .*initialize='predict'"):
        vf.run(ys)
    assert vf.unreliable_steps[0] == 0 and len(set(vf.unreliable_steps)) == len(vf.unreliable_steps)
    assert _run(model, ys, 0, num_iterations=3).unreliable_steps == []  # warnings are errors there


# Issue 26, case 5: SMC rejects a scalar observation of a 2-d site; the streaming filter broadcast it.
def test_a_scalar_observation_of_a_vector_site_is_an_error():
    model = AR1(2, r=0.5)
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(2), num_iterations=1, num_regression_samples=16)
    with pytest.raises(ValueError, match=r"site 'y_0' at step 0 has shape \(\), which does not fit the site \(per sample \(2,\)"):
        vf.step(torch.tensor(0.3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"site 'y_0' at step 0 has shape \(\), which does not fit the site \(per sample \(2,\)"):
        vf.run(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"site 'y_0' at step 0 has shape \(2, 1\), which does not fit the site \(per sample \(2,\)"):  # would score (2, 2)
        vf.init().step(torch.zeros(2, 1, dtype=torch.float64))
    vf.init().step(torch.zeros(2, dtype=torch.float64))
    vf.step(torch.full((2,), math.nan, dtype=torch.float64))  # missing: the shape still fits
    with pytest.raises(ValueError, match=r"step 2.*shape \(\)"):
        vf.step(torch.tensor(0.3, dtype=torch.float64))
    assert vf.t == 2
    # A model that declares obs_dim is held to check_observations' (T, obs_dim) by run.
    from pyro_smc.models import LinearGaussianSSM

    eye = torch.eye(2, dtype=torch.float64)
    ssm = LinearGaussianSSM(0.9 * eye, eye, eye, eye, torch.zeros(2, dtype=torch.float64), eye)
    with pytest.raises(ValueError, match=r"observations must have shape \(T, 2\), got \(3,\)"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=1).run(torch.zeros(3, dtype=torch.float64))


class _LearnableTransition(PyroModule):
    """Reads its only parameter in the transition, so step 0 reads none."""

    def __init__(self):
        super().__init__()
        self.a = PyroParam(torch.tensor(0.5, dtype=torch.float64))

    def init(self, state):
        pass

    def step(self, state, y=None):
        loc = self.a * state["x"] if "x" in state else torch.zeros(1, dtype=torch.float64)
        state["x"] = pyro.sample("x", dist.Normal(loc, 1.0).to_event(1))
        pyro.sample("y", dist.Normal(state["x"], 0.5).to_event(1), obs=y)


class _ParamInInit:
    """A plain model that reads its parameter in init."""

    def init(self, state):
        self.b = pyro.param("b", torch.tensor(2.0, dtype=torch.float64), constraint=dist.constraints.positive)

    def step(self, state, y=None):
        loc = state["x"] if "x" in state else torch.zeros(1, dtype=torch.float64)
        state["x"] = pyro.sample("x", dist.Normal(loc, self.b).to_event(1))
        pyro.sample("y", dist.Normal(state["x"], 0.5).to_event(1), obs=y)


# Issue 26: vf.parameters() returned {} after step 0.
def test_parameters_are_the_model_parameters_from_the_start():
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(_LearnableTransition(), StreamingFilterGuide(1).double(), num_iterations=1, num_regression_samples=16)
    assert set(vf.parameters()) == {"a"}  # before any step
    vf.step(torch.zeros(1, dtype=torch.float64))
    params = vf.parameters()
    assert set(params) == {"a"} and float(params["a"]) == 0.5 and not params["a"].requires_grad
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(_ParamInInit(), StreamingFilterGuide(1).double(), num_iterations=1, num_regression_samples=16)
    vf.step(torch.zeros(1, dtype=torch.float64))
    assert set(vf.parameters()) == {"b"} and float(vf.parameters()["b"]) == 2.0  # constrained


class _BreaksAt:
    """AR(1) whose transition returns NaN (or whose log-density is -inf) from step ``t_bad`` on."""

    def __init__(self, t_bad, kind):
        self.t_bad, self.kind = t_bad, kind

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = 0.9 * state["x"] if "x" in state else torch.zeros(1, dtype=torch.float64)
        if self.t >= self.t_bad and self.kind == "nan":
            loc = loc * float("nan")
        x = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0).to_event(1))
        state["x"] = x
        if self.t >= self.t_bad and self.kind == "-inf":
            pyro.factor(f"never_{self.t}", torch.full(x.shape[:-1], -math.inf, dtype=x.dtype))
        pyro.sample(f"y_{self.t}", dist.Normal(x, 0.5).to_event(1), obs=y)
        self.t += 1


# Issue 26, case 3 for this engine: a non-finite mean, covariance or ELBO must raise, naming the step.
@pytest.mark.parametrize("initialize", ["laplace", "previous"])
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("kind", ["nan", "-inf"])
def test_a_non_finite_step_is_an_error_naming_it(kind, validate, initialize):
    vf = OnlineVariationalFilter(_BreaksAt(2, kind), StreamingFilterGuide(1).double(), num_iterations=2, num_regression_samples=16, initialize=initialize)
    ys = torch.zeros(4, 1, dtype=torch.float64)
    with pyro.validation_enabled(validate), pytest.raises(ValueError, match=r"step 2\b") as error:
        vf.run(ys)
    # Pyro's own check of a NaN loc (named by the step), or the filter's.
    assert "not finite" in str(error.value) or (validate and "invalid values" in str(error.value)), error.value
    assert vf.t == 2 and torch.isfinite(vf.log_evidence) and torch.isfinite(vf.result.filtering_means).all()


# Found by the property suite (tests/infer/test_online_properties.py).
@pytest.mark.parametrize("argument", ["lr", "initial_lr", "parameter_lr"])
@pytest.mark.parametrize("value", [math.inf, math.nan, True])
def test_rates_must_be_finite_positive_numbers(argument, value):
    """lr=inf was accepted and failed at step 0 inside a Normal's constraint check."""
    with pytest.raises(ValueError, match=f"{argument} must be a finite number > 0"):
        OnlineVariationalFilter(AR1(2), StreamingFilterGuide(2), **{argument: value})


def test_switches_and_schedules_that_read_as_something_else_are_errors():
    """``learn_parameters="no"`` read as True (``bool("no")``), ``stop_sigmas=-1`` was accepted,
    and a ``parameter_lr`` schedule returning a negative step walked down the likelihood."""
    for kwargs, match in (({"learn_parameters": "no"}, "learn_parameters must be True or False"), ({"stop_sigmas": -1.0}, "stop_sigmas must be a finite number >= 0")):
        with pytest.raises(ValueError, match=match):
            OnlineVariationalFilter(AR1(2), StreamingFilterGuide(2), **kwargs)
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(_LearnableTransition(), StreamingFilterGuide(1).double(), num_iterations=0, learn_parameters=True, parameter_lr=lambda t: -0.01)
    with pytest.raises(ValueError, match=r"at step \d+: parameter_lr\(\d+\) must be a finite number >= 0, got -0.01"):
        vf.run(torch.zeros(4, 1, dtype=torch.float64))


def test_a_state_key_must_hold_the_latent():
    """state_key=3 (no such entry) was accepted: the filter then put x_{t-1} in state[3], which the
    model never reads, and scored the transition from a stale batch of states."""
    with pytest.raises(ValueError, match="state_key must be None or the name"):
        OnlineVariationalFilter(AR1(2), StreamingFilterGuide(2), state_key=3)
    vf = OnlineVariationalFilter(AR1(2, r=0.5), StreamingFilterGuide(2), num_iterations=1, num_regression_samples=16, state_key="z")
    with pytest.raises(ValueError, match=r"state_key='z' does not hold the latent site 'x_0' after model.step at step 0 .*state\['x'\]"):
        vf.step(torch.zeros(2, dtype=torch.float64))


def test_a_guide_of_another_dtype_than_the_model_is_an_error_naming_both():
    """A float64 model with a guide made under torch's default float32 failed inside model.step
    ("expected m1 and m2 to have the same dtype"), naming neither; converted, the guide runs."""
    one = torch.eye(1, dtype=torch.float64)
    ssm = LinearGaussianSSM(0.9 * one, 0.19 * one, one, one, torch.zeros(1, dtype=torch.float64), one)
    ys = torch.zeros(3, 1, dtype=torch.float64)
    guide = StreamingFilterGuide(1).to(torch.float32)
    with pytest.raises(ValueError, match=r"at step 0: the model computes its latent site 'x_0' in torch.float64 but the guide's parameters are torch.float32"):
        OnlineVariationalFilter(ssm, guide, num_iterations=1, num_regression_samples=16).run(ys)
    vf = OnlineVariationalFilter(ssm, guide.to(torch.float64), num_iterations=1, num_regression_samples=16).run(ys)
    assert vf.elbo.dtype == torch.float64 and torch.isfinite(vf.elbo)


@pytest.mark.parametrize("lag", [1.5, True, -1])
def test_smoothing_lag_must_be_an_int_in_the_window(lag):
    """lag=1.5 raised a bare TypeError (slice indices must be integers)."""
    model = AR1(1, r=0.5)
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(1), num_iterations=1, num_regression_samples=16).run(model.simulate(3, seed=0))
    with pytest.raises(ValueError, match="lag must be an int in"):
        vf.smoothing_samples(4, lag)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_optimisation_that_overflows_is_an_error_naming_the_step(dtype):
    """lr=100 (a 1000-fold initial rate) sends the log sds to +-1000: before, the next iteration's
    Normal rejected its scale ("Expected parameter scale ... found invalid values"), naming no step."""
    model = AR1(2, r=1e-2, dtype=dtype)
    # stop_sigmas=None: the exact start passes the gradient check, and the step must iterate.
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(2).to(dtype), num_iterations=2, lr=100.0, num_regression_samples=16, stop_sigmas=None)
    with pyro.validation_enabled(True), pytest.raises(ValueError, match=r"at step 0: .*not finite.*lr is too large"):
        vf.step(model.simulate(1, seed=0)[0])
    assert vf.t == 0


class _Projected:
    """``x_t = 0.9 x_{t-1} + N(0, I)`` in 3-d, two noisy projections ``y_t = C x_t + N(0, r^2 I)``."""

    def __init__(self, C, r):
        self.C, self.r = C, r

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = 0.9 * state["x"] if "x" in state else torch.zeros(3, dtype=self.C.dtype)
        state["x"] = x = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0).to_event(1))
        pyro.sample(f"y_{self.t}", dist.Normal(x @ self.C.T, self.r).to_event(1), obs=y)
        self.t += 1


@pytest.mark.parametrize("num_iterations", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_a_precise_observation_of_a_combination_of_coordinates(covariance, dtype, num_iterations):
    """At r = 1e-4 the posterior is 1e8 times narrower along C's rows than across them. Found by
    the property suite in float32: the Laplace covariance (the inverse of the dense precision)
    came out indefinite and ``set_marginal`` raised a bare LinAlgError. Then found in float64 too:
    the kernel's residual covariance ``S_pp - W S_px^T`` lost the narrow directions to cancellation
    (and its relative jitter widened them 30-fold), and Adam's per-coordinate steps left them, so
    that the kernel's draws missed q_{t-1} by 1e4 sds at every step: ELBO -104 with no iteration,
    +4e9 with one, against an exact -13.7. Now the factors come from QR and the steps are
    whitened: no step is unreliable, the ELBO is a bound, and the last marginal is as close to
    Kalman's as the bound's gap allows."""
    C = torch.tensor([[-0.9, -0.56, 0.69], [0.22, -0.67, 0.68]], dtype=torch.float64)
    r, eye = 1e-4, torch.eye(3, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x, ys = torch.randn(3, generator=g, dtype=torch.float64), []
    for t in range(5):
        x = 0.9 * x + torch.randn(3, generator=g, dtype=torch.float64) if t else x
        ys.append(C @ x + r * torch.randn(2, generator=g, dtype=torch.float64))
    ys = torch.stack(ys)
    kf = kalman.kalman_filter(ys, 0.9 * eye, eye, C, r**2 * torch.eye(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), eye)
    pyro.set_rng_seed(0)
    vf = OnlineVariationalFilter(_Projected(C.to(dtype), r), StreamingFilterGuide(3, covariance=covariance).to(dtype),
                                 num_iterations=num_iterations, num_regression_samples=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnlineFilterWarning)
        vf.run(ys.to(dtype))
    exact, elbo, se = float(kf.log_evidence), float(vf.log_evidence), float(vf.log_evidence_standard_error)
    rounding = 0.0 if dtype == torch.float64 else 1e-4 * abs(exact)
    assert elbo <= exact + 5 * se + rounding, (elbo, exact, se)
    last = vf.filtering_distribution()
    tril = last.scale_tril if covariance == "full" else torch.diag_embed(last.base_dist.scale)
    q = torch.distributions.MultivariateNormal(last.mean.double(), scale_tril=tril.double())
    kl = float(torch.distributions.kl_divergence(q, torch.distributions.MultivariateNormal(kf.means[-1], kf.covariances[-1])))
    assert kl <= exact - elbo + 5 * se + rounding, (kl, exact - elbo)
    if covariance == "full" and dtype == torch.float64:  # a diagonal q cannot hold this posterior
        assert exact - elbo < 1.0, (elbo, exact)


def test_a_start_with_a_zero_standard_deviation_is_an_error_naming_the_step(monkeypatch):
    """Found by the property suite (float32, state sd 100, observation sd 1e-4, a diagonal family):
    the closed-form start set a kernel standard deviation that underflowed to 0, and the first
    iteration's draw failed inside a Normal ("Expected parameter scale ... found invalid values"),
    naming no step. The start is now checked like every iterate."""
    import pyro_smc.infer.online.start as online_init

    real = online_init.regression_kernel

    def underflowing(x, x_prev, kernel=None, **kwargs):
        weight, bias, tril = real(x, x_prev, **kwargs) if kernel is None else kernel
        return weight, bias, tril * torch.tensor([0.0, 1.0], dtype=tril.dtype)[:, None]  # row 0 underflows

    monkeypatch.setattr(online_init, "regression_kernel", underflowing)
    real_joint = online_init._joint_prediction

    def underflowing_joint(*args):  # the start's kernel from the control-variate prediction
        m, cov, kernel = real_joint(*args)
        return m, cov, underflowing(None, None, kernel=kernel)

    monkeypatch.setattr(online_init, "_joint_prediction", underflowing_joint)
    model = AR1(2, r=0.5)
    vf = OnlineVariationalFilter(model, StreamingFilterGuide(2), num_iterations=1, num_regression_samples=16)
    ys = model.simulate(2, seed=0)
    vf.step(ys[0])
    with pyro.validation_enabled(True), pytest.raises(ValueError, match=r"at step 1: the filtering mean or covariance is not finite .*'bwd_scale_raw'"):
        vf.step(ys[1])
    assert vf.t == 1


def test_the_standard_error_does_not_overflow():
    """Found by the property suite: in float32 the variance of ELBO increments of 1e19-1e20
    overflowed, and log_evidence_standard_error was inf beside a finite log_evidence."""
    from pyro_smc.infer.online.checks import standard_error

    values = torch.tensor([-3e20, -1e20, -2e20, -2.5e20], dtype=torch.float32)
    assert torch.isinf(values.var())  # what the filter computed before
    torch.testing.assert_close(standard_error(values), (values.double().std() / 2).float(), rtol=1e-5, atol=0)
