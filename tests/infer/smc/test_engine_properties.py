"""Properties of ``SMC`` and ``SMCELBO`` over drawn models and inputs (hypothesis).

Every property holds the engine to one invariant: a clear ``ValueError`` naming the argument or
the time step, or a finite answer that agrees with the oracle where there is one. The models are
drawn: linear-Gaussian ones of 1-3 dimensions (the Kalman filter is the oracle of the evidence),
with or without a guide, with the observation in a model plate or as one event, with missing rows
and entries; hidden Markov models with a label coded as an integer, a float (``Bernoulli``) or a
one-hot float (exact enumeration is the oracle); float32 and float64; T from 1 to 6; every
resampler. Inputs out of the domain (counts, thresholds, epsilons, shapes, dtypes, inf, T = 0,
lengths) must be refused by name. ``PYRO_SMC_PROPERTY_EXAMPLES`` sets the examples per property
(see ``tests/property_cases.py``).

The evidence checks use ``Z_hat / Z``, whose expectation is exactly 1 for the unbiased
resamplers (index, soft; every resampler on a state of labels only), over ``B`` independent
filters: ``|mean - 1| < MC_SIGMAS sd / sqrt(B)``.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc import SMC, SMCELBO
from pyro_smc.infer.smc.checks import ParticleDegeneracyWarning
from pyro_smc.ops.kalman import kalman_filter
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.resamplers import (
    KernelResampler,
    MultinomialResampler,
    OTResampler,
    SoftResampler,
    StratifiedResampler,
    SystematicResampler,
)
from tests.property_cases import ENGINE, FLOAT_DTYPES, SEEDS, assert_clear_error, assert_finite, gen
from tests.tolerances import MC_SIGMAS

UNBIASED = {
    "systematic": SystematicResampler,
    "stratified": StratifiedResampler,
    "multinomial": MultinomialResampler,
    "soft": lambda: SoftResampler(0.5),
}
RESAMPLERS = {**UNBIASED, "ot": lambda: OTResampler(0.5), "kernel": KernelResampler}


class LinearGaussian:
    """``x_0 ~ N(0, P0)``, ``x_t = A x_{t-1} + N(0, diag q)``, ``y_t = C x_t + N(0, r^2 I)``; the
    observation as one event (``to_event(1)``) or inside a model plate (``max_plate_nesting=1``)."""

    def __init__(self, A, q, C, r, p0, plate):
        self.A, self.q, self.C, self.r, self.p0, self.plate = A, q, C, r, p0, plate

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = state["x"] @ self.A.T if self.t else torch.zeros_like(self.p0)
        scale = self.q.sqrt() if self.t else self.p0.sqrt()
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, scale).to_event(1))
        mean = state["x"] @ self.C.T
        if self.plate:
            # With max_plate_nesting=1 a per-particle tensor has batch shape (*particles, 1): x is
            # (..., N, 1, d), and its mean loses that 1 to the observation plate.
            with pyro.plate("obs", self.C.shape[0], dim=-1):
                pyro.sample(f"y_{self.t}", dist.Normal(mean.squeeze(-2), self.r), obs=y)
        else:
            pyro.sample(f"y_{self.t}", dist.Normal(mean, self.r).to_event(1), obs=y)
        self.t += 1

    def log_evidence(self, ys):
        """Exact, in float64 (NaN entries missing)."""
        d, e = self.A.shape[0], self.C.shape[0]
        f = {k: v.double() for k, v in dict(A=self.A, q=self.q, C=self.C, p0=self.p0).items()}
        R = self.r**2 * torch.eye(e, dtype=torch.float64)
        return kalman_filter(ys.double(), f["A"], torch.diag(f["q"]), f["C"], R, torch.zeros(d, dtype=torch.float64), torch.diag(f["p0"])).log_evidence


class InflatedPriorGuide:
    """Proposes from the model's transition with the scale inflated: any proposal with heavier
    tails than the target keeps ``E[Z_hat] = Z``."""

    def __init__(self, model, inflate):
        self.model, self.inflate = model, inflate

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        m = self.model
        loc = state["x"] @ m.A.T if self.t else torch.zeros_like(m.p0)
        scale = (m.q.sqrt() if self.t else m.p0.sqrt()) * self.inflate
        pyro.sample(f"x_{self.t}", dist.Normal(loc, scale).to_event(1))
        self.t += 1


@st.composite
def linear_gaussian_cases(draw, small=False):
    dtype = draw(FLOAT_DTYPES)
    d, e = draw(st.integers(1, 2 if small else 3)), draw(st.integers(1, 2 if small else 3))
    g = gen(draw(SEEDS))
    A = (0.9 * torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0] * torch.rand(d, generator=g, dtype=torch.float64)).to(dtype)
    q = (0.2 + torch.rand(d, generator=g, dtype=torch.float64)).to(dtype)
    C = torch.randn(e, d, generator=g, dtype=torch.float64).to(dtype)
    r = draw(st.sampled_from([0.5, 1.0] if small else [1e-2, 0.3, 1.0, 10.0]))
    p0 = (0.5 + torch.rand(d, generator=g, dtype=torch.float64)).to(dtype)
    model = LinearGaussian(A, q, C, r, p0, plate=draw(st.booleans()))
    T = draw(st.integers(1, 5 if small else 6))
    x, ys = torch.randn(d, generator=g, dtype=torch.float64) * p0.double().sqrt(), []
    for t in range(T):
        if t:
            x = A.double() @ x + q.double().sqrt() * torch.randn(d, generator=g, dtype=torch.float64)
        ys.append(C.double() @ x + r * torch.randn(e, generator=g, dtype=torch.float64))
    ys = torch.stack(ys).to(dtype)
    missing = draw(st.sampled_from(["none", "row", "entry"]))
    if missing == "row":
        ys[draw(st.integers(0, T - 1))] = math.nan
    elif missing == "entry" and e > 1:
        ys[draw(st.integers(0, T - 1)), draw(st.integers(0, e - 1))] = math.nan
    return model, ys


def _run_quietly(fn):
    """``fn()`` with the engine's advisory warnings silenced (the properties judge its numbers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ParticleDegeneracyWarning)
        warnings.simplefilter("ignore", SinkhornConvergenceWarning)
        return fn()


@ENGINE
@given(
    case=linear_gaussian_cases(),
    resampler=st.sampled_from(sorted(RESAMPLERS)),
    num_particles=st.sampled_from([1, 5, 64]),
    num_filters=st.sampled_from([1, 3]),
    guide=st.booleans(),
    store_history=st.booleans(),
)
def test_property_any_linear_gaussian_run_is_finite_with_the_documented_shapes(case, resampler, num_particles, num_filters, guide, store_history):
    model, ys = case
    T, d = ys.shape[0], model.A.shape[0]
    pyro.set_rng_seed(0)
    smc = SMC(
        model,
        InflatedPriorGuide(model, 1.3) if guide else None,
        num_particles=num_particles,
        max_plate_nesting=int(model.plate),
        num_filters=num_filters,
        resampler=RESAMPLERS[resampler](),
        store_history=store_history,
    )
    try:
        _run_quietly(lambda: smc.run(ys))
    except ValueError as error:
        # Only one documented refusal: a partly missing observation inside a model plate with a
        # guide is fine, but SMC needs the site that takes it to factorise (it does here), so
        # nothing may be refused for these models.
        raise AssertionError(f"a valid model was refused: {error}") from error
    assert smc.log_evidence.shape == (num_filters,) and smc.log_evidence.dtype == ys.dtype
    assert_finite(smc.log_evidence, "log_evidence")
    assert smc.filtering_means["x"].shape == (T, num_filters) + (1,) * model.plate + (d,)
    assert_finite(smc.filtering_means, "filtering_means")
    assert_finite(smc.log_evidence_increments, "log_evidence_increments")
    assert torch.allclose(smc.log_evidence_increments.sum(0), smc.log_evidence, rtol=1e-4, atol=1e-3 * T)
    assert bool(((smc.ess_history >= 1) & (smc.ess_history <= num_particles)).all())
    if store_history and not model.plate:
        draws = smc.smooth(2, method="ffbs")
        assert draws["x"].shape == (2, T, num_filters, d)
        assert_finite(draws, "smooth")


@ENGINE
@given(
    case=linear_gaussian_cases(small=True),
    resampler=st.sampled_from(sorted(UNBIASED)),
    guide=st.booleans(),
)
def test_property_unbiased_resamplers_match_the_kalman_evidence(case, resampler, guide):
    """``E[Z_hat] = Z``. The ratio ``Z_hat / Z`` is right-skewed, the more so the fewer effective
    particles: when its sample relative variance exceeds 1/2, the sample sd is no longer a
    reliable error bar (a run of 64 then typically misses the rare large values that carry the
    mean), and only the one-sided consequence ``E[log Z_hat] <= log Z`` (Jensen) is checked."""
    model, ys = case
    B = 64
    pyro.set_rng_seed(1)
    proposal = InflatedPriorGuide(model, 1.3) if guide else None
    smc = _run_quietly(
        lambda: SMC(model, proposal, num_particles=128, num_filters=B, max_plate_nesting=int(model.plate), resampler=UNBIASED[resampler]()).run(ys)
    )
    log_z, exact = smc.log_evidence.double(), model.log_evidence(ys)
    rounding = 10 * torch.finfo(ys.dtype).eps * ys.shape[0] * (1 + float(exact.abs()))
    assert float(log_z.mean() - exact) < MC_SIGMAS * float(log_z.std()) / math.sqrt(B) + rounding
    ratio = (log_z - exact).exp()
    if float(ratio.var() / ratio.mean() ** 2) < 0.5:
        tolerance = MC_SIGMAS * float(ratio.std()) / math.sqrt(B) + rounding
        assert abs(float(ratio.mean()) - 1) < tolerance, (float(ratio.mean()), tolerance)


class HMM:
    """A ``K``-state Markov chain observed as ``y_t ~ N(mu[z_t], 1)``; the label drawn as an
    integer (``Categorical``), a float (``Bernoulli``, K = 2) or a one-hot float vector."""

    def __init__(self, trans, mu, coding):
        self.trans, self.mu, self.coding = trans, mu, coding

    def init(self, state):
        self.t = 0

    def _index(self, z):
        return z.argmax(-1) if self.coding == "onehot" else z.long()

    def step(self, state, y=None):
        K = self.mu.shape[0]
        probs = torch.full((K,), 1.0 / K, dtype=self.mu.dtype) if self.t == 0 else self.trans[self._index(state["z"])]
        fn = {"int": dist.Categorical, "onehot": dist.OneHotCategorical}.get(self.coding)
        fn = dist.Bernoulli(probs[..., 1]) if fn is None else fn(probs)
        state["z"] = pyro.sample(f"z_{self.t}", fn)
        pyro.sample(f"y_{self.t}", dist.Normal(self.mu[self._index(state["z"])], 1.0), obs=y)
        self.t += 1

    def log_evidence(self, ys):
        K = self.mu.shape[0]
        lik = dist.Normal(self.mu.double(), 1.0).log_prob(ys.double().unsqueeze(-1))  # (T, K)
        log_alpha = lik[0] - math.log(K)
        for t in range(1, len(ys)):
            log_alpha = torch.logsumexp(log_alpha.unsqueeze(-1) + self.trans.double().log(), 0) + lik[t]
        return torch.logsumexp(log_alpha, 0)


@ENGINE
@given(
    dtype=FLOAT_DTYPES,
    coding=st.sampled_from(["int", "float", "onehot"]),
    K=st.integers(2, 3),
    T=st.integers(1, 6),
    resampler=st.sampled_from(sorted(RESAMPLERS)),
    seed=SEEDS,
)
def test_property_labels_stay_labels_and_match_the_forward_algorithm(dtype, coding, K, T, resampler, seed):
    """A state of labels only: every resampler copies them (OT has nothing to transport and
    resamples multinomially), so ``E[Z_hat] = Z`` for all of them."""
    if coding == "float":
        K = 2
    g = gen(seed)
    trans = (torch.rand(K, K, generator=g, dtype=torch.float64) + 0.2).to(dtype)
    trans = trans / trans.sum(-1, keepdim=True)
    mu = (2 * torch.randn(K, generator=g, dtype=torch.float64)).to(dtype)
    ys = (torch.randn(T, generator=g, dtype=torch.float64) * 2).to(dtype)
    model, B = HMM(trans, mu, coding), 64
    pyro.set_rng_seed(2)
    smc = _run_quietly(lambda: SMC(model, num_particles=32, num_filters=B, resampler=RESAMPLERS[resampler](), ess_threshold=1.0).run(ys))
    z = smc.state["z"]
    assert bool(((z == 0) | (z == 1)).all() if coding != "int" else ((z >= 0) & (z < K)).all())
    assert z.dtype == (torch.long if coding == "int" else dtype)
    ratio = (smc.log_evidence.double() - model.log_evidence(ys)).exp()
    tolerance = MC_SIGMAS * float(ratio.std()) / math.sqrt(B) + 10 * torch.finfo(dtype).eps * T
    assert abs(float(ratio.mean()) - 1) < tolerance, (float(ratio.mean()), tolerance)
    means = smc.filtering_means["z"]
    assert_finite(means, "filtering_means")
    assert bool(((means >= -1e-6) & (means <= (1 if coding != "int" else K - 1) + 1e-5)).all())


BAD_CONSTRUCTOR = [
    ({"num_particles": 0}, "num_particles"),
    ({"num_particles": -3}, "num_particles"),
    ({"num_particles": 2.5}, "num_particles"),
    ({"num_particles": True}, "num_particles"),
    ({"num_filters": 0}, "num_filters"),
    ({"num_filters": 1.5}, "num_filters"),
    ({"ess_threshold": 0.0}, "ess_threshold"),
    ({"ess_threshold": 1.5}, "ess_threshold"),
    ({"ess_threshold": math.nan}, "ess_threshold"),
    ({"max_plate_nesting": -1}, "max_plate_nesting"),
    ({"resampler": OTResampler}, "resampler"),
    ({"resampler": 3}, "resampler"),
]
BAD_RESAMPLER = [
    (lambda: OTResampler(0.0), "epsilon"),
    (lambda: OTResampler(-1.0), "epsilon"),
    (lambda: OTResampler(math.inf), "epsilon"),
    (lambda: OTResampler(math.nan), "epsilon"),
    (lambda: OTResampler(0.5, max_iter=0), "max_iter"),
    (lambda: OTResampler(0.5, gradient="exact"), "gradient"),
    (lambda: SoftResampler(1.5), "alpha"),
    (lambda: KernelResampler(bandwidth=-1.0), "bandwidth"),
    (lambda: SystematicResampler(gradient="pathwise"), "gradient"),
]


@ENGINE
@given(case=linear_gaussian_cases(), bad=st.sampled_from(range(len(BAD_CONSTRUCTOR) + len(BAD_RESAMPLER))))
def test_property_invalid_settings_are_refused_by_name(case, bad):
    model, _ = case
    if bad < len(BAD_CONSTRUCTOR):
        kwargs, name = BAD_CONSTRUCTOR[bad]
        kwargs = {"num_particles": 10, **kwargs}
        for build in (lambda: SMC(model, **kwargs), lambda: SMCELBO(**kwargs)):
            if "max_plate_nesting" in kwargs and build is not None:
                pass
            with pytest.raises((ValueError, TypeError)) as info:
                build()
            assert_clear_error(info.value, name)
    else:
        make, name = BAD_RESAMPLER[bad - len(BAD_CONSTRUCTOR)]
        with pytest.raises(ValueError) as info:
            make()
        assert_clear_error(info.value, name)


BAD_OBSERVATIONS = ["inf", "no_steps", "half", "other_dtype", "wrong_size", "scalar_rows", "lengths", "batched_size", "not_a_tensor"]


@ENGINE
@given(case=linear_gaussian_cases(), bad=st.sampled_from(BAD_OBSERVATIONS), step=st.integers(0, 5), num_filters=st.sampled_from([1, 2]))
def test_property_invalid_observations_are_refused_naming_the_argument_or_step(case, bad, step, num_filters):
    model, ys = case
    T, e = ys.shape
    step = min(step, T - 1)
    kwargs, names = {}, ["observation"]
    if bad == "inf":
        ys = ys.clone()
        ys[step, 0] = math.inf
        names = [f"time step {step}"]
    elif bad == "no_steps":
        ys = ys[:0]
    elif bad == "half":
        ys = ys.half()
    elif bad == "other_dtype":
        ys = ys.to(torch.float64 if ys.dtype == torch.float32 else torch.float32)
        names = ["time step 0"]  # checked at the first step, observed or missing
    elif bad == "wrong_size":
        ys = torch.cat([ys, ys[:, :1]], -1)
        names = ["time step 0", "shape"]
    elif bad == "scalar_rows":
        if e == 1:
            # A (T,) series for a one-dim site: a scalar row and a (1,) row say the same.
            return
        ys = ys[:, 0]
        names = ["time step 0", "shape"]
    elif bad == "lengths":
        ys = ys.unsqueeze(0).expand(num_filters, T, e)
        kwargs = {"batched": True, "lengths": torch.full((num_filters,), T + 1)}
        names = ["lengths"]
    elif bad == "batched_size":
        ys = ys.unsqueeze(0).expand(num_filters + 1, T, e)
        kwargs = {"batched": True}
        names = ["num_filters"]
    elif bad == "not_a_tensor":
        ys = ys.tolist()
    smc = SMC(model, num_particles=8, num_filters=num_filters, max_plate_nesting=int(model.plate))
    with pytest.raises((ValueError, TypeError)) as info:
        _run_quietly(lambda: smc.run(ys, **kwargs))
    assert_clear_error(info.value, *names)


@ENGINE
@given(case=linear_gaussian_cases(small=True), num_filters=st.sampled_from([1, 4]))
def test_property_smcelbo_loss_is_minus_the_mean_evidence(case, num_filters):
    model, ys = case
    elbo = SMCELBO(num_particles=16, num_filters=num_filters, max_plate_nesting=int(model.plate))
    pyro.set_rng_seed(3)
    loss = _run_quietly(lambda: elbo.differentiable_loss(model, None, ys))
    assert loss.shape == () and math.isfinite(float(loss))
    assert torch.allclose(loss, -elbo.smc.log_evidence.mean())


GRADIENT_MODES = {
    "detach": SystematicResampler,
    "stop_gradient": lambda: SystematicResampler(gradient="stop_gradient"),
    "marginal_stop_gradient": lambda: SystematicResampler(gradient="marginal_stop_gradient"),
    "ot_implicit": lambda: OTResampler(0.5),
    "ot_unroll": lambda: OTResampler(0.5, gradient="unroll"),
    "soft": lambda: SoftResampler(0.5),
    "kernel": KernelResampler,
}


@ENGINE
@given(case=linear_gaussian_cases(small=True), mode=st.sampled_from(sorted(GRADIENT_MODES)), num_filters=st.sampled_from([1, 3]))
def test_property_every_gradient_estimator_gives_a_finite_gradient(case, mode, num_filters):
    """The transition matrix as a leaf: ``d log Z_hat / d A`` is finite for every resampler and
    estimator (the marginal estimator refuses model plates by name)."""
    model, ys = case
    model.A = model.A.clone().requires_grad_()
    pyro.set_rng_seed(4)
    smc = SMC(model, num_particles=16, num_filters=num_filters, max_plate_nesting=int(model.plate), resampler=GRADIENT_MODES[mode]())
    try:
        _run_quietly(lambda: smc.run(ys))
    except ValueError as error:
        assert mode == "marginal_stop_gradient" and model.plate, error
        assert_clear_error(error, "max_plate_nesting")
        return
    if not bool(torch.isnan(ys[1:]).all(-1).logical_not().any()):
        return  # A acts from the second step on: nothing observed after the first step sees it
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), [model.A], allow_unused=True)
    assert grad is not None, mode
    assert_finite(grad, f"d log Z / d A ({mode})")
