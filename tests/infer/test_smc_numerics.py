"""SMC numerics: invariance to constant log-weight offsets, warnings for gradients SMC cannot
deliver (non-reparameterised proposal sites) and Sinkhorn convergence warnings that name the
time step."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions.torch_distribution import ExpandedDistribution
from pyro.infer import SVI

from pyro_smc import SMC, SMCELBO
from pyro_smc.infer.smc import NonReparameterizedGradientWarning, SMCFailedError
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.resamplers import SystematicResampler

T, N, B = 20, 100, 3


class AR1:
    """The README's AR(1) model, plus ``pyro.factor`` of ``constant`` at every step: a term that
    is the same for every particle of a filter (scalar, or ``(B, 1)`` for one per filter)."""

    def __init__(self, theta: torch.Tensor, constant: torch.Tensor, kill_negative: bool = False, kill_all_at: int | None = None):
        self.theta, self.constant = theta, constant
        self.kill_negative, self.kill_all_at = kill_negative, kill_all_at

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        zero = torch.zeros((), dtype=self.theta.dtype)
        loc = self.theta * state["x"] if self.t else zero
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.3), obs=y)
        if self.kill_negative:
            # Zero weight for part of the cloud: -inf entries in one site's term.
            pyro.factor(f"kill_{self.t}", torch.where(state["x"] < 0, -torch.inf, zero))
        if self.kill_all_at == self.t:
            pyro.factor(f"kill_{self.t}", torch.full_like(state["x"], -torch.inf))
        pyro.factor(f"c_{self.t}", self.constant)
        self.t += 1


def _data(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x, ys = 0.0, []
    for _ in range(T):
        x = 0.8 * x + torch.randn((), generator=gen, dtype=torch.float64)
        ys.append(x + 0.3 * torch.randn((), generator=gen, dtype=torch.float64))
    return torch.stack(ys).to(dtype)


def _run(dtype, constant, theta=None, **model_kwargs) -> SMC:
    theta = torch.tensor(0.8, dtype=dtype) if theta is None else theta
    pyro.set_rng_seed(0)
    return SMC(AR1(theta, constant, **model_kwargs), num_particles=N, num_filters=B).run(_data(dtype))


def _constant(c: float, per_filter: bool, dtype: torch.dtype) -> torch.Tensor:
    if per_filter:
        # Different constants for different filters, each shared by the filter's particles.
        return (c * torch.tensor([1.0, 0.5, -0.25], dtype=dtype)).unsqueeze(-1)
    return torch.tensor(c, dtype=dtype)


# --- (A) a constant added to every log-weight changes nothing --------------------------------
@pytest.mark.parametrize("per_filter", [False, True], ids=["scalar", "per_filter"])
@pytest.mark.parametrize("c", [1e4, 1e8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_log_weight_offset_changes_only_log_evidence(dtype, c, per_filter):
    """The weights are defined up to a constant per filter: the filtering means, ESS and
    normalised weights of ``C`` equal those of ``C = 0`` (before centring, float32 at ``1e8``
    gave ESS 0.02 and means of about 40 instead of 1.1), and ``log Z`` moves by ``T * C``.

    ``log Z`` is a sum of ``T`` increments rounded at magnitude up to ``|T * C|``, so it may be
    off by ``T`` ulps there; everything else is computed from centred terms of order 1, where a
    few ulps of float32 are far below the tolerances.
    """
    eps = torch.finfo(dtype).eps
    ref = _run(dtype, _constant(0.0, per_filter, dtype))
    constant = _constant(c, per_filter, dtype)
    got = _run(dtype, constant)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert (got.filtering_means["x"] - ref.filtering_means["x"]).abs().max() < tol
    assert torch.allclose(got.ess_history, ref.ess_history, rtol=tol, atol=0)
    assert torch.allclose(got.log_weights.exp(), ref.log_weights.exp(), rtol=0, atol=tol)
    assert torch.equal(got.resampled, ref.resampled)
    assert bool((got.ess_history >= 1).all()) and bool((got.ess_history <= N).all())
    shift = T * constant.reshape(-1).expand(B)
    magnitude = shift.abs() + ref.log_evidence.abs()
    assert bool(((got.log_evidence - ref.log_evidence - shift).abs() <= T * eps * magnitude + 1e-3 * tol).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_offset_with_zero_weight_particles(dtype):
    """Particles of zero weight (-inf in one site's term) next to a large constant: the centring
    takes the maximum over the finite entries, and zero stays zero."""
    ref = _run(dtype, torch.tensor(0.0, dtype=dtype), kill_negative=True)
    got = _run(dtype, torch.tensor(1e8, dtype=dtype), kill_negative=True)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert bool(torch.isinf(ref.weighted_particles[1]).any())  # the -inf path was exercised
    assert torch.equal(torch.isinf(got.weighted_particles[1]), torch.isinf(ref.weighted_particles[1]))
    assert (got.filtering_means["x"] - ref.filtering_means["x"]).abs().max() < tol
    assert torch.allclose(got.ess_history, ref.ess_history, rtol=tol, atol=0)


def test_all_zero_weights_still_fail_with_step_and_site():
    with pytest.raises(SMCFailedError, match=r"time step 3.*'kill_3'"):
        _run(torch.float32, torch.tensor(1e8), kill_all_at=3)


def test_gradient_of_log_evidence_unchanged_by_constant():
    """``d log Z / d theta`` does not see a constant; a constant ``C + phi`` that depends on a
    parameter contributes exactly ``T`` to ``d log Z / d phi`` (each step's weights sum to one),
    not ``2 T`` as it would if the centring shift were added back with its gradient."""
    grads = {}
    for c in (0.0, 1e8):
        theta = torch.tensor(0.8, requires_grad=True)
        phi = torch.tensor(0.0, requires_grad=True)
        smc = _run(torch.float64, c + phi, theta=theta)
        grads[c] = torch.autograd.grad(smc.log_evidence.sum(), [theta, phi])
    assert grads[0.0][0] != 0
    assert torch.allclose(grads[1e8][0], grads[0.0][0], rtol=1e-10, atol=0)
    for c in grads:
        assert torch.allclose(grads[c][1], torch.tensor(float(B * T)), rtol=1e-12, atol=0)


# --- (B) non-reparameterised proposal sites with learnable parameters -------------------------
class Switching:
    """Two-regime Markov switching model with the transition matrix a ``pyro.param`` if
    ``learnable``; ``wrap`` wraps the regime's distribution so that the wrappers of a discrete
    site are exercised."""

    def __init__(self, learnable: bool, wrap=lambda d: d):
        self.learnable, self.wrap = learnable, wrap

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        P = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
        if self.learnable:
            P = pyro.param("P", P, constraint=dist.constraints.simplex)
        probs = P[state["z"]] if self.t else torch.tensor([0.5, 0.5])
        state["z"] = pyro.sample(f"z_{self.t}", self.wrap(dist.Categorical(probs=probs)))
        pyro.sample(f"y_{self.t}", dist.Normal(2.0 * state["z"].to(torch.get_default_dtype()), 1.0), obs=y)
        self.t += 1


class Flips:
    """Two coin flips per step as one ``Independent(Bernoulli)`` site; ``p`` is a
    ``pyro.param`` unless given (a given tensor is used as it is, so a leaf keeps
    ``requires_grad`` inside the distribution even under ``no_grad``)."""

    def __init__(self, p: torch.Tensor | None = None):
        self.p = p

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        p = pyro.param("p", torch.tensor(0.3), constraint=dist.constraints.unit_interval) if self.p is None else self.p
        state["b"] = pyro.sample(f"b_{self.t}", dist.Bernoulli(p.expand(2)).to_event(1))
        pyro.sample(f"y_{self.t}", dist.Normal(state["b"].sum(-1), 1.0), obs=y)
        self.t += 1


class SwitchingGuide:
    """A proposal with a learnable discrete distribution of its own."""

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        q = pyro.param("q", torch.tensor([0.5, 0.5]), constraint=dist.constraints.simplex)
        pyro.sample(f"z_{self.t}", dist.Categorical(probs=q))
        self.t += 1


def _switching_ys() -> torch.Tensor:
    return torch.tensor([0.1, 2.2, 1.8, -0.3, 0.2, 2.5, 1.9, 2.1, 0.0, -0.4])


def _nonreparam_warnings(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, NonReparameterizedGradientWarning)]


@pytest.mark.parametrize(
    "wrap",
    [lambda d: d, lambda d: d.mask(torch.tensor(True)), lambda d: ExpandedDistribution(d, d.batch_shape)],
    ids=["plain", "masked", "expanded"],
)
def test_learnable_discrete_bootstrap_site_warns_once(wrap):
    caught = _nonreparam_warnings(lambda: SMC(Switching(True, wrap), num_particles=50).run(_switching_ys()))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "site 'z_1'" in message and "Categorical" in message and "time step 1" in message
    assert "score-function" in message and "marginalise" in message


def test_learnable_discrete_site_warns_under_svi():
    """The case of the issue: SVI with SMCELBO on a learnable switching matrix."""
    svi = SVI(Switching(True), None, pyro.optim.Adam({"lr": 0.05}), loss=SMCELBO(num_particles=50))
    caught = _nonreparam_warnings(lambda: svi.step(_switching_ys()))
    assert len(caught) == 1 and "site 'z_1'" in str(caught[0].message)


def test_learnable_discrete_guide_site_warns():
    guide = SwitchingGuide()
    caught = _nonreparam_warnings(lambda: SMC(Switching(False), guide, num_particles=50).run(_switching_ys()))
    assert len(caught) == 1 and "site 'z_0'" in str(caught[0].message)


def test_learnable_independent_bernoulli_warns():
    """Parameters found through an ``Independent`` wrapper."""
    caught = _nonreparam_warnings(lambda: SMC(Flips(), num_particles=20).run(torch.zeros(3)))
    assert len(caught) == 1 and "Independent(Bernoulli)" in str(caught[0].message)


@pytest.mark.parametrize("case", ["constant_probs", "no_grad", "reparameterised"])
def test_no_warning_where_gradients_are_complete(case):
    if case == "constant_probs":
        run = lambda: SMC(Switching(False), num_particles=50).run(_switching_ys())  # noqa: E731
    elif case == "no_grad":
        # Bernoulli keeps a leaf parameter as it is, so it requires grad under no_grad too:
        # only grad mode tells that no gradient will be taken (with grad on, this run warns).
        model = Flips(torch.tensor(0.3, requires_grad=True))
        assert len(_nonreparam_warnings(lambda: SMC(model, num_particles=20).run(torch.zeros(3)))) == 1

        def run():
            with torch.no_grad():
                SMC(model, num_particles=20).run(torch.zeros(3))

    else:
        theta = torch.tensor(0.8, requires_grad=True)
        run = lambda: SMC(AR1(theta, torch.tensor(0.0)), num_particles=50).run(_data(torch.float64))  # noqa: E731
    assert _nonreparam_warnings(run) == []


# --- (C) Sinkhorn convergence warnings name the time step -------------------------------------
class _NonConvergingResampler:
    """Systematic resampling that reports a Sinkhorn solve above its threshold, and one
    unrelated warning that must pass through unchanged."""

    emits_convergence_warnings = True

    def __init__(self):
        self.inner = SystematicResampler()

    def __call__(self, particles, log_weights):
        warnings.warn(SinkhornConvergenceWarning("Sinkhorn stopped at max_iter=7 with marginal error 0.1"), stacklevel=2)
        warnings.warn(RuntimeWarning("unrelated"), stacklevel=2)
        return self.inner(particles, log_weights)


def _run_resampling_every_step(resampler) -> SMC:
    # ess_threshold = 1 resamples whenever the weights are not exactly uniform: every step.
    smc = SMC(AR1(torch.tensor(0.8), torch.tensor(0.0)), num_particles=N, resampler=resampler, ess_threshold=1.0)
    smc.run(_data(torch.float64)[:5])
    assert bool(smc.resampled.all())
    return smc


def test_sinkhorn_warning_is_reemitted_with_time_step():
    with pytest.warns((SinkhornConvergenceWarning, RuntimeWarning)) as record:
        _run_resampling_every_step(_NonConvergingResampler())
    messages = [str(w.message) for w in record if issubclass(w.category, SinkhornConvergenceWarning)]
    assert "at time step 3: Sinkhorn stopped at max_iter=7 with marginal error 0.1" in messages
    assert all(m.startswith("at ") for m in messages)
    assert [str(w.message) for w in record if w.category is RuntimeWarning].count("unrelated") == len(messages)


def test_sinkhorn_warning_as_error_names_time_step():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SinkhornConvergenceWarning, match=r"^at (init|time step 0): Sinkhorn stopped"):
            _run_resampling_every_step(_NonConvergingResampler())
