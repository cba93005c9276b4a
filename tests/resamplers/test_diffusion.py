"""DiffusionResampler: shapes and dtypes, labels from one ancestor of positive weight, the
recomputing backward pass against the plain map, the filter inside SMC against Kalman (filtering
means within 5 sigma, the error and the log-evidence gap shrinking with N), gradients through
SMC, and bad settings."""

import math

import pyro
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.diffusion import diffusion_resample
from pyro_smc.resamplers import GradientEstimator
from pyro_smc.resamplers.diffusion import DiffusionResampler
from tests.cases import DTYPE_IDS, DTYPES
from tests.tolerances import MC_SIGMAS


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch", [(), (3,)])
def test_shapes_dtypes_and_uniform_new_weights(batch, dtype):
    g = torch.Generator().manual_seed(0)
    state = {"x": torch.randn(batch + (20, 2), generator=g, dtype=dtype), "v": torch.randn(batch + (20,), generator=g, dtype=dtype)}
    log_w = torch.randn(batch + (20,), generator=g, dtype=dtype).log_softmax(-1)
    out = DiffusionResampler(num_steps=4).resample(state, log_w)
    assert {k: (v.shape, v.dtype) for k, v in out.particles.items()} == {k: (v.shape, v.dtype) for k, v in state.items()}
    assert torch.equal(out.log_weights, torch.full_like(log_w, -math.log(20)))
    assert out.ancestors is None and out.diagnostics is None
    assert DiffusionResampler.estimator is GradientEstimator.PATHWISE and not DiffusionResampler.draws_ancestors


def test_labels_come_from_one_ancestor_of_positive_weight():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 1, generator=g)
    label = torch.arange(30).expand(2, 30).clone()
    log_w = torch.randn(2, 30, generator=g)
    log_w[:, ::2] = -math.inf  # even particles: zero weight
    log_w = log_w.log_softmax(-1)
    out = DiffusionResampler(integrator="sde").resample({"x": x, "k": label}, log_w)
    assert out.particles["k"].dtype == torch.int64
    assert (out.particles["k"] % 2 == 1).all()


def test_state_without_floats_is_multinomially_resampled():
    log_w = torch.tensor([-math.inf, 0.0, -math.inf]).log_softmax(-1)
    out = DiffusionResampler().resample({"k": torch.tensor([5, 6, 7])}, log_w)
    assert out.particles["k"].tolist() == [6, 6, 6] and out.ancestors.tolist() == [1, 1, 1]


@pytest.mark.parametrize("integrator", ["euler", "sde"])
def test_recomputing_backward_equals_the_plain_map(integrator):
    """The resampler keeps only its inputs and noise and recomputes the map in the backward pass;
    its gradients equal those of the map with the same noise."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 2, generator=g, requires_grad=True)
    log_w = torch.randn(2, 12, generator=g).log_softmax(-1).requires_grad_()
    r = DiffusionResampler(num_steps=5, integrator=integrator)
    torch.manual_seed(3)
    new = r.resample({"x": x}, log_w).particles["x"]
    torch.manual_seed(3)
    noise = torch.randn((6,) + x.shape)
    plain = diffusion_resample(x, log_w, noise, num_steps=5, integrator=integrator).particles
    assert torch.equal(new, plain)
    probe = torch.randn(plain.shape, generator=g)
    ours = torch.autograd.grad((new * probe).sum(), (x, log_w))
    theirs = torch.autograd.grad((plain * probe).sum(), (x, log_w))
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(ours, theirs))


# --- inside SMC -------------------------------------------------------------------------------------
def _lgssm():
    A = torch.tensor([[0.9, 0.2], [-0.1, 0.8]])
    Q = torch.tensor([[0.5, 0.1], [0.1, 0.3]])
    C = torch.tensor([[1.0, 0.0], [0.5, 1.0]])
    return LinearGaussianSSM(A, Q, C, 1.0 * torch.eye(2), torch.zeros(2), torch.eye(2))


def _run(ssm, ys, n, b, seed):
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        return SMC(ssm, num_particles=n, num_filters=b, ess_threshold=1.0, resampler=DiffusionResampler()).run(ys)


def test_smc_matches_kalman_as_n_grows():
    """Resampling at every step. Filtering means averaged over B filters agree with Kalman within
    5 sigma at every step and coordinate at N = 200 (at N = 25 the filters' errors are too
    heavy-tailed for a normal bar, with systematic resampling too); their mean squared error falls
    by more than half (1/N predicts 1/8); the log-evidence gap per step, which is O(1/N) for a
    particle filter, is within 5 sigma + 0.02 of 0 at N = 200 and shrinks with N."""
    ssm = _lgssm()
    pyro.set_rng_seed(0)
    _, ys = ssm.simulate(15)
    kalman = ssm.kalman_filter(ys).means
    exact = ssm.log_evidence(ys)
    T, B = ys.shape[0], 20
    mse, gaps = [], []
    for n in (25, 200):
        smc = _run(ssm, ys, n, B, seed=n)
        assert bool(smc.resampled[:-1].all())
        means = smc.filtering_means["x"]  # (T, B, 2)
        est, se = means.mean(1), means.std(1) / math.sqrt(B)
        assert n < 200 or ((est - kalman).abs() < MC_SIGMAS * se + 1e-3).all()
        mse.append((means - kalman.unsqueeze(1)).square().mean())
        gap = (smc.log_evidence - exact) / T
        gaps.append((gap.mean(), gap.std() / math.sqrt(B)))
    assert mse[1] < 0.5 * mse[0]
    (small, s_small), (big, s_big) = gaps
    assert abs(big) < MC_SIGMAS * s_big + 0.02
    assert abs(big) < abs(small) or abs(big - small) < MC_SIGMAS * math.hypot(s_small, s_big)


def test_smc_log_evidence_is_differentiable():
    ssm = _lgssm()
    _, ys = ssm.simulate(8)
    a = ssm.A.clone().requires_grad_()
    ssm.A = a
    smc = SMC(ssm, num_particles=30, num_filters=3, ess_threshold=1.0, resampler=DiffusionResampler(num_steps=4)).run(ys)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), a)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_gradient_through_every_step_resampling_stays_bounded_only_for_a_wide_step():
    """The map's Jacobian grows like 1 / h, h = b^2 T / K, and a filter that resamples at every
    step multiplies them. On a 2-d linear-Gaussian model (A = 0.75 I, observation noise 0.1 I,
    median ESS about 9 of N = 100 before each resampling), 30 steps, 20 filters: the median over
    filters of one filter's gradient error |grad log Z_hat - score| / |score| is below 5 at the
    default h = 1/2 (measured 1.4 to 2.4 over 16 seeds: the filter's own noise), and above 8 at
    h = 1/16 (16 steps, b^2 T = 1; measured 17 to 184: geometric growth). The median, not the
    mean over filters: at h = 1/16 one filter's gradient can be 1e5 scores, and at N = 50 the
    default's mean had one-filter outliers of 25 scores too, so a mean-based test was flaky."""
    eye = torch.eye(2)

    def model(a):
        return LinearGaussianSSM(a, eye, eye, 0.1 * eye, torch.zeros(2), eye)

    pyro.set_rng_seed(0)
    _, ys = model(0.5 * eye).simulate(30)
    a = (0.75 * eye).clone().requires_grad_()
    (score,) = torch.autograd.grad(model(a).log_evidence(ys), a)
    B, errors = 20, []
    for kwargs in (dict(), dict(num_steps=16, time=1.0)):
        pyro.set_rng_seed(100)
        # One copy of A per filter, (B, 2, 2) against particles (B, N, 2): a single backward pass
        # then gives each filter's own gradient.
        a = (0.75 * eye).repeat(B, 1, 1).requires_grad_()
        ssm = model(0.75 * eye)
        ssm.A = a
        smc = SMC(ssm, num_particles=100, num_filters=B, ess_threshold=1.0, resampler=DiffusionResampler(**kwargs))
        (grad,) = torch.autograd.grad(smc.run(ys).log_evidence.sum(), a)
        errors.append(((grad - score).flatten(1).norm(dim=1) / score.norm()).median())
    assert errors[0] < 5 and errors[1] > 8, errors


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_steps=0), "num_steps"),
        (dict(num_steps=1.5), "num_steps"),
        (dict(dispersion=0.0), "dispersion"),
        (dict(dispersion=-2.0), "dispersion"),
        (dict(time=-1.0), "time"),
        (dict(time=float("nan")), "time"),
        (dict(integrator="heun"), "integrator"),
        (dict(reference="empirical"), "reference"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DiffusionResampler(**kwargs)


def test_bad_weights_and_shapes_raise_and_repr_shows_the_settings():
    with pytest.raises(ValueError, match="particles"):
        DiffusionResampler()({"x": torch.zeros(3, 1)}, torch.zeros(4))
    with pytest.raises(ValueError, match="log_weights"):
        DiffusionResampler()({"x": torch.zeros(2, 1)}, torch.tensor([math.nan, 0.0]))
    assert repr(DiffusionResampler(num_steps=4)) == "DiffusionResampler(num_steps=4, dispersion=1.0, time=4.0, integrator='euler', reference='fitted')"
