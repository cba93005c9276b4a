"""Diffusion resampling (ops): the ensemble score against autograd of the mixture density, the
resampled cloud of a weighted sample of a known Gaussian against its mean and covariance (5-sigma
Monte Carlo bars over independent filters), the bias shrinking in the number of steps, gradcheck
of the map with its noise held fixed, batching, dtypes, degenerate weights and bad settings."""

import math

import pytest
import torch

from pyro_smc.ops.diffusion import INTEGRATORS, REFERENCES, diffusion_resample, ensemble_denoiser, ensemble_score, fit_reference
from tests.cases import DTYPE_IDS, DTYPES
from tests.tolerances import MC_SIGMAS

MU = torch.tensor([1.0, -0.5])
SIGMA = torch.tensor([[1.0, 0.6], [0.6, 0.8]])
PROPOSAL_SD = math.sqrt(2.0)


def _weighted_gaussian(batch, n, dtype=torch.float64, seed=0):
    """``(x (B, N, 2), log_w (B, N))``: draws from ``N(0, 2 I)`` weighted towards ``N(MU, SIGMA)``."""
    g = torch.Generator().manual_seed(seed)
    x = PROPOSAL_SD * torch.randn(batch, n, 2, generator=g, dtype=dtype)
    target = torch.distributions.MultivariateNormal(MU.to(dtype), SIGMA.to(dtype))
    log_w = target.log_prob(x) - torch.distributions.Normal(0.0, PROPOSAL_SD).log_prob(x).sum(-1)
    return x, log_w.log_softmax(-1)


def _moments(x, log_w=None):
    w = torch.full(x.shape[:-1], 1.0 / x.shape[-2], dtype=x.dtype) if log_w is None else log_w.exp()
    m = (w.unsqueeze(-1) * x).sum(-2)
    c = x - m.unsqueeze(-2)
    return m, (w.unsqueeze(-1) * c).transpose(-1, -2) @ c


# --- the ensemble score ------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.05, 0.7, 3.0])
def test_ensemble_score_is_the_gradient_of_the_mixture_log_density(t):
    g = torch.Generator().manual_seed(1)
    zi = torch.randn(3, 7, 2, generator=g)
    log_w = torch.randn(3, 7, generator=g).log_softmax(-1)
    z = torch.randn(3, 5, 2, generator=g, requires_grad=True)
    b = 1.3
    a, var = math.exp(-(b**2) * t / 2), 1 - math.exp(-(b**2) * t)
    comp = torch.distributions.Normal(a * zi.unsqueeze(-3), math.sqrt(var))  # (3, 1, 7, 2)
    log_p = (comp.log_prob(z.unsqueeze(-2)).sum(-1) + log_w.unsqueeze(-2)).logsumexp(-1)
    (expected,) = torch.autograd.grad(log_p.sum(), z)
    assert torch.allclose(ensemble_score(z.detach(), zi, log_w, t, b), expected, rtol=1e-10, atol=1e-10)


def test_denoiser_is_the_posterior_mean_and_tends_to_the_weights():
    g = torch.Generator().manual_seed(2)
    zi, log_w = torch.randn(9, 3, generator=g), torch.randn(9, generator=g).log_softmax(-1)
    z = torch.randn(4, 3, generator=g)
    z0, log_alpha = ensemble_denoiser(z, zi, log_w, 0.4)
    assert torch.allclose(log_alpha.exp().sum(-1), torch.ones(4))
    assert torch.allclose(z0, log_alpha.exp() @ zi)
    # Far in the forward process a point says nothing about where it started: alpha -> w.
    _, log_alpha = ensemble_denoiser(z, zi, log_w, 60.0)
    assert torch.allclose(log_alpha, log_w.expand(4, 9), atol=1e-9)


def test_fitted_reference_has_the_weighted_moments():
    x, log_w = _weighted_gaussian(3, 50)
    m, chol = fit_reference(x, log_w)
    mean, cov = _moments(x, log_w)
    assert torch.allclose(m, mean)
    assert torch.allclose(chol @ chol.transpose(-1, -2), cov, rtol=1e-6)
    m, chol = fit_reference(x, log_w, "standard")
    assert (m == 0).all() and torch.equal(chol, torch.eye(2).expand(3, 2, 2))


# --- the law of the resampled cloud ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("integrator", INTEGRATORS)
def test_resampled_cloud_has_the_target_mean_and_covariance(integrator, seed):
    """Mean: within 5 sigma of the target's over B independent filters (sigma from the spread of
    the filters, which includes the weighted sample's own error). Covariance: the integrators'
    bias is O(b^2 T / K) of the reference's (the final step blurs, Euler, or shrinks, the others,
    by about that much, the exponential and flow steps also lose b^2 T / K per unit log K on the
    way); allowed 3 b^2 T / K (1 + log K) on top of 5 sigma."""
    B, N, K, bT = 100, 100, 16, 1.0
    x, log_w = _weighted_gaussian(B, N, seed=seed)
    torch.manual_seed(seed)
    out = diffusion_resample(x, log_w, num_steps=K, time=bT, integrator=integrator).particles
    mean, cov = _moments(out)
    err = mean - MU
    assert (err.mean(0).abs() < MC_SIGMAS * err.std(0) / math.sqrt(B)).all()
    rel = (cov - SIGMA) / SIGMA.diagonal().mean()
    allowed = MC_SIGMAS * rel.std(0) / math.sqrt(B) + 3 * bT / K * (1 + math.log(K))
    assert (rel.mean(0).abs() < allowed).all(), rel.mean(0)


def test_covariance_bias_shrinks_with_the_number_of_steps():
    """The exponential integrator's covariance deficit (the last, Tweedie, step averages the
    particles within sigma_{t_1} of each new one) falls as K grows: K = 4, 16, 64 on the same
    weighted samples, each step a drop of more than 5 sigma, and at K = 64 below 3 b^2 T / K
    (1 + log K) of the reference's variance."""
    B, N, bT = 100, 100, 1.0
    x, log_w = _weighted_gaussian(B, N, seed=3)
    _, target = _moments(x, log_w)
    deficits = []
    for K in (4, 16, 64):
        torch.manual_seed(K)
        out = diffusion_resample(x, log_w, num_steps=K, time=bT, integrator="sde").particles
        rel = (target - _moments(out)[1]).diagonal(dim1=-2, dim2=-1).sum(-1) / target.diagonal(dim1=-2, dim2=-1).sum(-1)
        deficits.append((rel.mean(), rel.std() / math.sqrt(B)))
    for (big, s_big), (small, s_small) in zip(deficits, deficits[1:]):
        assert big - small > MC_SIGMAS * math.hypot(s_big, s_small)
    assert deficits[-1][0] < 3 * bT / 64 * (1 + math.log(64))


def test_mass_of_each_mode_is_kept():
    """A weighted sample of a two-mode target (30% / 70% at -3 / +3, sd 0.5) keeps each mode's
    mass within 5 sigma (the binomial sd of N equally weighted particles, over B filters). Euler's
    last step blurs by a Gaussian of variance about b^2 T / K times the weighted variance (to
    first order in b^2 T / K; K = 16, b^2 T = 1 here), so the mass between the modes is below that of the
    target so blurred."""
    B, N = 50, 200
    g = torch.Generator().manual_seed(4)
    x = 4 * torch.randn(B, N, 1, generator=g)
    mix = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(torch.tensor([0.3, 0.7])), torch.distributions.Normal(torch.tensor([-3.0, 3.0]), 0.5)
    )
    log_w = (mix.log_prob(x[..., 0]) - torch.distributions.Normal(0.0, 4.0).log_prob(x[..., 0])).log_softmax(-1)
    torch.manual_seed(4)
    out = diffusion_resample(x, log_w, num_steps=16, time=1.0).particles[..., 0]
    left = (out < 0).double().mean(-1)
    weighted_left = (log_w.exp() * (x[..., 0] < 0)).sum(-1)
    sd = (weighted_left * (1 - weighted_left) / N).sqrt()
    assert ((left - weighted_left).mean().abs() < MC_SIGMAS * sd.mean() / math.sqrt(B)).item()
    blur = 1.0 / 16 * _moments(x, log_w)[1][..., 0, 0]  # (B,): b^2 T / K of the weighted variance
    sd_blurred = (0.25 + blur).sqrt()
    normal = torch.distributions.Normal(0.0, 1.0)
    middle = sum(p * (normal.cdf((1.5 - c) / sd_blurred) - normal.cdf((-1.5 - c) / sd_blurred)) for p, c in ((0.3, -3.0), (0.7, 3.0)))
    assert (out.abs() < 1.5).double().mean() < middle.mean()


# --- gradients, batching, dtypes ---------------------------------------------------------------------
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("integrator", INTEGRATORS)
def test_gradcheck_with_the_noise_held_fixed(integrator, reference):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 2, generator=g, requires_grad=True)
    log_w = torch.randn(2, 5, generator=g).log_softmax(-1).requires_grad_()
    K = 3
    noise = torch.randn((K + 1,) + x.shape, generator=g)

    def fn(x, log_w):
        return diffusion_resample(x, log_w, noise, num_steps=K, time=0.8, integrator=integrator, reference=reference)

    assert torch.autograd.gradcheck(fn, (x, log_w))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_batched_call_equals_one_call_per_filter_in_each_dtype(dtype):
    x, log_w = _weighted_gaussian(3, 40, dtype=dtype, seed=6)
    noise = torch.randn((9,) + x.shape, dtype=dtype)
    out = diffusion_resample(x, log_w, noise, num_steps=8)
    assert out.particles.dtype == dtype and out.particles.shape == x.shape and out.log_alpha.shape == (3, 40, 40)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for b in range(3):
        one = diffusion_resample(x[b], log_w[b], noise[:, b], num_steps=8)
        assert torch.allclose(out.particles[b], one.particles, **tol)
    assert torch.isfinite(out.particles).all()


@pytest.mark.parametrize("integrator", ["sde", "ode"])
def test_exponential_and_flow_outputs_are_convex_combinations(integrator):
    x, log_w = _weighted_gaussian(2, 30, seed=7)
    out = diffusion_resample(x, log_w, num_steps=5, integrator=integrator)
    assert torch.allclose(out.particles, out.log_alpha.exp() @ x)


@pytest.mark.parametrize("integrator", INTEGRATORS)
def test_equal_and_degenerate_weights(integrator):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 6, 3, generator=g)
    # All the weight on one particle: every new particle is that particle.
    log_w = torch.full((2, 6), -math.inf)
    log_w[0, 2] = log_w[1, 5] = 0.0
    out = diffusion_resample(x, log_w, integrator=integrator).particles
    assert torch.allclose(out[0], x[0, 2].expand(6, 3)) and torch.allclose(out[1], x[1, 5].expand(6, 3))
    # Zero-weight particles take no part: their positions change nothing.
    log_w = torch.tensor([[0.0, 0.0, -math.inf, 0.0, -math.inf, 0.0]]).log_softmax(-1)
    noise = torch.randn((9, 1, 6, 3), generator=g)  # the default K = 8, plus the start
    moved = x[:1].clone()
    moved[0, 2] += 100.0
    moved[0, 4] -= 50.0
    a, b = (diffusion_resample(y, log_w, noise, integrator=integrator) for y in (x[:1], moved))
    assert torch.allclose(a.particles, b.particles) and (a.log_alpha[..., [2, 4]] == -math.inf).all()
    # Equal weights: finite, the shape kept.
    out = diffusion_resample(x, torch.zeros(2, 6), integrator=integrator).particles
    assert torch.isfinite(out).all() and out.shape == x.shape


# --- bad settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_steps=0), "num_steps"),
        (dict(num_steps=-2), "num_steps"),
        (dict(num_steps=2.5), "num_steps"),
        (dict(num_steps=True), "num_steps"),
        (dict(dispersion=0.0), "dispersion"),
        (dict(dispersion=-1.0), "dispersion"),
        (dict(dispersion=float("nan")), "dispersion"),
        (dict(time=0.0), "time"),
        (dict(time=float("inf")), "time"),
        (dict(integrator="rk4"), "integrator"),
        (dict(reference="uniform"), "reference"),
        (dict(noise=torch.zeros(3, 4, 1)), "noise"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        diffusion_resample(torch.zeros(4, 1), torch.zeros(4), **kwargs)
