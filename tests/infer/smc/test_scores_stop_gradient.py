"""Stop-gradient resampling (Scibior and Wood, 2021): the Fisher-identity score estimator.

With ``SystematicResampler(gradient="stop_gradient")`` the forward pass of ``SMC`` is the one
of plain systematic resampling, bit for bit, and autograd of ``log_evidence`` gives
``G = sum_i w_T^i d log p(x^i_{1:T}, y_{1:T})`` along each particle's ancestral path. The
unnormalised estimate is unbiased: ``E[Z_hat G] = dZ/dtheta``, so ``E[(Z_hat / Z) G]`` is the
exact score ``d log Z / d theta``. The tests check that identity over many independent filters,
each with its own copy of the parameter (so one backward pass gives every filter's ``G``),
against the Kalman filter's score (a linear-Gaussian model, bootstrap and guided) and the
forward algorithm's (a two-state switching model whose switching probability acts only
through a discrete draw). Tolerances are ``MC_SIGMAS`` standard errors of the mean over filters.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.infer.smc.checks import NonReparameterizedGradientWarning
from pyro_smc.resamplers import MultinomialResampler, StratifiedResampler, SystematicResampler
from tests.infer.paper_model import DiagLinearGaussian, kalman_log_evidence, simulate
from tests.tolerances import MC_SIGMAS

THETA = (0.5, 0.7)


class PosteriorGuide:
    """``q(x_t | x_{t-1}, y_t) = N((theta x_{t-1} + 10 y_t) / 11, phi^2)``: the locally optimal
    proposal's mean (observation variance 0.1, transition variance 1) with a wrong scale."""

    def __init__(self, theta, phi):
        self.theta, self.phi = theta, phi

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        prior_mean = 0.0 if self.t == 0 else self.theta * state["x"]
        pyro.sample(f"x_{self.t}", dist.Normal((prior_mean + 10 * y) / 11, self.phi).to_event(1))
        self.t += 1


def _weighted_scores(log_z, grads, exact_log_z):
    """Per-filter ``(Z_hat / Z) G``: ``(B, ...)``."""
    ratio = (log_z - exact_log_z).exp()
    return ratio.reshape((-1,) + (1,) * (grads.dim() - 1)) * grads


def _check_mean(samples, exact):
    """``|mean - exact| / (MC_SIGMAS * standard error)``, componentwise; below 1 passes."""
    se = samples.std(0) / math.sqrt(samples.shape[0])
    return ((samples.mean(0) - exact).abs() / (MC_SIGMAS * se)).max().item()


def _linear_gaussian_run(seed, guided, num_filters=1000, num_particles=256, steps=10, resampler=None, ess_threshold=0.5):
    _, ys = simulate(THETA, steps, 3)
    d = len(THETA)
    theta = torch.tensor(THETA).expand(num_filters, 1, d).clone().requires_grad_()
    phi = torch.full((num_filters, 1, 1), 0.45).requires_grad_()
    guide = PosteriorGuide(theta, phi) if guided else None
    resampler = SystematicResampler(gradient="stop_gradient") if resampler is None else resampler
    pyro.set_rng_seed(seed)
    smc = SMC(
        DiagLinearGaussian(theta, learnable=False),
        guide,
        num_particles=num_particles,
        num_filters=num_filters,
        resampler=resampler,
        ess_threshold=ess_threshold,
    )
    smc.run(ys)
    return smc, ys, theta, phi


def linear_gaussian_ratio(seed, guided, **kwargs):
    """``(|mean - score| / tolerance, |mean of phi's| / tolerance, estimator mean, score, standard error)``."""
    smc, ys, theta, phi = _linear_gaussian_run(seed, guided, **kwargs)
    inputs = [theta, phi] if guided else [theta]
    grads = torch.autograd.grad(smc.log_evidence.sum(), inputs, allow_unused=True)
    theta0 = torch.tensor(THETA).requires_grad_()
    exact_log_z = kalman_log_evidence(theta0, ys)
    (score,) = torch.autograd.grad(exact_log_z, theta0)
    samples = _weighted_scores(smc.log_evidence.detach(), grads[0].reshape(-1, len(THETA)), exact_log_z.detach())
    se = samples.std(0) / math.sqrt(samples.shape[0])
    phi_ratio = 0.0
    if guided:
        # Z does not depend on the proposal: its score is 0 (in fact G_phi is 0 per filter).
        phi_samples = _weighted_scores(smc.log_evidence.detach(), grads[1].reshape(-1, 1), exact_log_z.detach())
        phi_ratio = phi_samples.mean(0).abs().max().item()
    return _check_mean(samples, score), phi_ratio, samples.mean(0), score, se


@pytest.mark.parametrize("guided", [False, True], ids=["bootstrap", "guided"])
def test_linear_gaussian_score_is_unbiased(guided):
    """``mean_b (Z_hat_b / Z) G_b`` equals the Kalman score ``d log p(y) / d theta`` within
    ``MC_SIGMAS`` standard errors, with the bootstrap filter and with a proposal that itself
    depends on ``theta``; the proposal's own parameter gets (numerically) zero gradient."""
    ratio, phi_mean, mean, score, se = linear_gaussian_ratio(0, guided)
    assert ratio < 1, (mean.tolist(), score.tolist(), se.tolist())
    assert phi_mean < 1e-8


def test_detached_index_resampling_is_biased_for_the_score_here():
    """The contrast: plain systematic resampling (pathwise gradients, ancestors detached) on the
    same runs misses the Kalman score by many standard errors, so the test above has power."""
    ratio, _, mean, score, se = linear_gaussian_ratio(0, False, resampler=SystematicResampler())
    assert ratio > 1, (mean.tolist(), score.tolist(), se.tolist())


@pytest.mark.parametrize("resampler_cls", [SystematicResampler, StratifiedResampler, MultinomialResampler])
@pytest.mark.parametrize("guided", [False, True], ids=["bootstrap", "guided"])
def test_forward_pass_is_bit_identical(resampler_cls, guided):
    """Under the same seed, stop-gradient resampling changes no forward number: log-evidence,
    its increments, filtering means, ESS, resampling decisions, weights and particles. The ESS
    threshold resamples some filters and not others at some steps."""
    runs = []
    for gradient in ("detach", "stop_gradient"):
        threshold = 0.5 if guided else 0.1
        smc, _, _, _ = _linear_gaussian_run(
            3, guided, num_filters=8, num_particles=32, steps=10, resampler=resampler_cls(gradient=gradient), ess_threshold=threshold
        )
        runs.append(smc)
    plain, stop = runs
    resampled = plain.resampled
    assert (resampled.any(-1) & ~resampled.all(-1)).any()
    assert stop.log_evidence.requires_grad
    for a, b in [
        (plain.log_evidence, stop.log_evidence),
        (plain.log_evidence_increments, stop.log_evidence_increments),
        (plain.filtering_means["x"], stop.filtering_means["x"]),
        (plain.ess_history, stop.ess_history),
        (plain.resampled, stop.resampled),
        (plain.log_weights, stop.log_weights),
        (plain.state["x"], stop.state["x"]),
    ]:
        assert torch.equal(a.detach(), b.detach())


def test_stop_gradient_resampler_values_and_gradient():
    """The resampler alone: the same ancestors as the detached one under the same seed, new
    log-weights exactly ``-log N``, and each new weight's gradient one-hot at its ancestor."""
    g = torch.Generator().manual_seed(0)
    log_w = torch.randn(3, 6, generator=g).log_softmax(-1).requires_grad_()
    x = torch.arange(18.0).reshape(3, 6)
    torch.manual_seed(1)
    plain_x, plain_w = SystematicResampler()({"x": x}, log_w)
    torch.manual_seed(1)
    new_x, new_w = SystematicResampler(gradient="stop_gradient")({"x": x}, log_w)
    assert torch.equal(plain_x["x"], new_x["x"]) and torch.equal(plain_w, new_w.detach())
    index = (new_x["x"] - 6 * torch.arange(3.0).unsqueeze(-1)).long()
    for b in range(3):
        for i in range(6):
            (grad,) = torch.autograd.grad(new_w[b, i], log_w, retain_graph=True)
            expected = torch.zeros_like(log_w)
            expected[b, index[b, i]] = 1
            assert torch.equal(grad, expected)


def test_zero_weight_ancestor_gets_no_nan():
    """An ancestor of zero weight (reachable only when the cumulative weights round below one)
    gets ``-log N`` and no gradient, not NaN."""
    from pyro_smc.ops.resample import stop_gradient_log_weights

    log_w = torch.tensor([0.0, -math.inf]).requires_grad_()
    new = stop_gradient_log_weights(log_w, torch.tensor([0, 1]))
    assert torch.equal(new.detach(), torch.full((2,), -math.log(2)))
    (grad,) = torch.autograd.grad(new.sum(), log_w)
    assert grad.tolist() == [1.0, 0.0]


def test_gradient_mode_is_validated():
    assert SystematicResampler(gradient=None).gradient == "detach"
    assert SystematicResampler().gradient == "detach"
    with pytest.raises(ValueError, match="gradient"):
        SystematicResampler(gradient="implicit")


# =================================================================================================
# Discrete transitions: a 2-state switching model; the switching probability acts only through
# a Bernoulli draw, so pathwise gradients cannot see it.


class Switching:
    """``z_1 ~ Bernoulli(1/2)``, ``z_t`` flips with probability ``p``, ``y_t ~ N(mu[z_t], sd)``.

    ``p`` may have shape ``(B, 1)``: one switching probability per filter.
    """

    mu = (-1.0, 1.0)
    sd = 1.0

    def __init__(self, p):
        self.p = p

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        if self.t == 0:
            probs = torch.tensor(0.5)
        else:
            z = state["z"]
            probs = z * (1 - self.p) + (1 - z) * self.p
        z = pyro.sample(f"z_{self.t}", dist.Bernoulli(probs))
        state["z"] = z
        pyro.sample(f"y_{self.t}", dist.Normal(self.mu[0] + (self.mu[1] - self.mu[0]) * z, self.sd), obs=y)
        self.t += 1

    @classmethod
    def simulate(cls, p, steps, seed):
        g = torch.Generator().manual_seed(seed)
        z, ys = int(torch.rand((), generator=g) < 0.5), []
        for t in range(steps):
            if t and float(torch.rand((), generator=g)) < p:
                z = 1 - z
            ys.append(cls.mu[z] + cls.sd * torch.randn((), generator=g))
        return torch.stack(ys)

    @classmethod
    def forward_log_evidence(cls, p, ys):
        """Exact ``log p(y_{1:T})`` by the forward algorithm, differentiable in ``p``."""
        trans = torch.stack([torch.stack([1 - p, p]), torch.stack([p, 1 - p])])
        mu = torch.tensor(cls.mu, dtype=ys.dtype)
        alpha, log_z = torch.full((2,), 0.5, dtype=ys.dtype), 0.0
        for t, y in enumerate(ys):
            if t:
                alpha = alpha @ trans
            if torch.isnan(y):  # a missing observation: predict only
                continue
            alpha = alpha * dist.Normal(mu, cls.sd).log_prob(y).exp()
            norm = alpha.sum()
            log_z = log_z + norm.log()
            alpha = alpha / norm
        return log_z


def switching_run(seed, resampler, p_value=0.2, num_filters=1000, num_particles=64, steps=25, missing=()):
    ys = Switching.simulate(0.1, steps, 5)
    ys[list(missing)] = math.nan
    p = torch.full((num_filters, 1), p_value).requires_grad_()
    pyro.set_rng_seed(seed)
    smc = SMC(Switching(p), num_particles=num_particles, num_filters=num_filters, resampler=resampler)
    smc.run(ys)
    return smc, ys, p


def switching_ratio(seed, **kwargs):
    """``(|mean - exact| / tolerance, estimator mean, exact score, standard error)``."""
    smc, ys, p = switching_run(seed, SystematicResampler(gradient="stop_gradient"), **kwargs)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), p)
    p0 = p[0, 0].detach().clone().requires_grad_()
    exact_log_z = Switching.forward_log_evidence(p0, ys)
    (score,) = torch.autograd.grad(exact_log_z, p0)
    samples = _weighted_scores(smc.log_evidence.detach(), grad.reshape(-1), exact_log_z.detach())
    se = samples.std(0) / math.sqrt(samples.shape[0])
    return _check_mean(samples, score), samples.mean(0), score, se


@pytest.mark.parametrize("missing", [(), (4, 5, 24)], ids=["observed", "missing"])
def test_switching_probability_score_is_unbiased(missing):
    """The switching probability's score, which only the score-function terms of the Bernoulli
    draws carry, matches the forward algorithm's within ``MC_SIGMAS`` standard errors, also
    with predict-only steps (whose transitions still enter the score; the last one cannot change
    ``Z``); and the non-reparameterised warning does not fire (the score terms are there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonReparameterizedGradientWarning)
        ratio, mean, score, se = switching_ratio(0, missing=missing)
    assert ratio < 1, (mean.item(), score.item(), se.item())
    assert score.abs() > 10 * se  # a non-trivial score, well resolved


def test_predict_only_steps_keep_the_forward_pass():
    """Predict-only steps add their draws' scores without changing a forward number."""
    runs = []
    for gradient in ("detach", "stop_gradient"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonReparameterizedGradientWarning)
            runs.append(switching_run(2, SystematicResampler(gradient=gradient), num_filters=16, steps=12, missing=(3, 4, 11))[0])
    plain, stop = runs
    assert stop.log_evidence.requires_grad
    for key in ("log_evidence", "log_evidence_increments", "ess_history", "resampled", "log_weights"):
        assert torch.equal(getattr(plain, key).detach(), getattr(stop, key).detach()), key
    assert torch.equal(plain.filtering_means["z"], stop.filtering_means["z"].detach())


def test_detached_resampling_gives_no_switching_gradient():
    """The contrast: with plain (detached) systematic resampling the switching probability acts
    only through non-differentiable draws, so ``log_evidence`` does not depend on it at all
    (zero gradient, whatever the exact score), and ``SMC`` warns."""
    with pytest.warns(NonReparameterizedGradientWarning, match="z_"):
        smc, _, p = switching_run(0, SystematicResampler(), num_filters=4, steps=5)
    log_z = smc.log_evidence
    grad = torch.autograd.grad(log_z.sum(), p, allow_unused=True)[0] if log_z.requires_grad else None
    assert grad is None or torch.equal(grad, torch.zeros_like(grad))


def test_guided_score_with_a_masked_filter_is_unbiased():
    """A batch of two sequences, the second with a missing observation mid-way: at that step its
    filters move by the model's transition while the first sequence's move by the guide, so their
    scores there are the transition's. Each sequence's weighted score matches its Kalman score."""
    steps, K, d = 8, 500, len(THETA)
    ys = torch.stack([simulate(THETA, steps, seed)[1] for seed in (3, 4)])
    ys[1, 4] = math.nan
    theta = torch.tensor(THETA).expand(2 * K, 1, d).clone().requires_grad_()
    phi = torch.full((2 * K, 1, 1), 0.45)
    pyro.set_rng_seed(0)
    smc = SMC(
        DiagLinearGaussian(theta, learnable=False),
        PosteriorGuide(theta, phi),
        num_particles=256,
        num_filters=2 * K,
        resampler=SystematicResampler(gradient="stop_gradient"),
    ).run(ys.repeat_interleave(K, 0), batched=True)
    (grads,) = torch.autograd.grad(smc.log_evidence.sum(), [theta])
    for s in range(2):
        theta0 = torch.tensor(THETA).requires_grad_()
        exact_log_z = kalman_log_evidence(theta0, ys[s])
        (score,) = torch.autograd.grad(exact_log_z, theta0)
        rows = slice(s * K, (s + 1) * K)
        samples = _weighted_scores(smc.log_evidence.detach()[rows], grads[rows].reshape(-1, d), exact_log_z.detach())
        assert _check_mean(samples, score) < 1, (s, samples.mean(0).tolist(), score.tolist())
