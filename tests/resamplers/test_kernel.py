"""KernelResampler: kernel (mixture) resampling of Younis and Sudderth (2023).

Values and shapes (the new log-weights are -log N bit for bit), the law of the new particles
(mean and covariance of the kernel mixture, 5-sigma Monte Carlo bars over independent filters),
unbiasedness of the importance-weighted gradient of E_m[f] against closed forms, its exactness
against a reference mixture density (gradcheck with the draws held fixed), the regularised
filter inside SMC against Kalman oracles, and bad inputs. See
``docs/math/smc.md#kernel-mixture-resampling``.
"""

import math

import pyro
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.resample import kernel_mixture_log_density
from pyro_smc.resamplers import KernelResampler
from tests.cases import DTYPE_IDS, DTYPES
from tests.tolerances import MC_SIGMAS

SCHEMES = ["systematic", "multinomial"]


def _cloud(batch, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch + (n, d), generator=g, dtype=dtype)
    log_w = torch.randn(batch + (n,), generator=g, dtype=dtype).log_softmax(-1)
    return x, log_w


def _reference_log_m(points, centres, log_w, h):
    """log sum_j w_j prod_k N(points_ik; centres_jk, h_k^2) by torch.distributions, pair by pair."""
    normal = torch.distributions.Normal(centres.unsqueeze(-3), h)  # (..., 1, N, D)
    return (normal.log_prob(points.unsqueeze(-2)).sum(-1) + log_w.unsqueeze(-2)).logsumexp(-1)


def _silverman(x, log_w):
    """Silverman's rule per coordinate with weighted variance and n_eff = 1 / sum w^2, written out."""
    w = log_w.exp()
    mean = (w.unsqueeze(-1) * x).sum(-2, keepdim=True)
    sd = (w.unsqueeze(-1) * (x - mean) ** 2).sum(-2).sqrt()
    d = x.shape[-1]
    n_eff = 1 / (w**2).sum(-1, keepdim=True)
    return sd * (4 / ((d + 2) * n_eff)) ** (1 / (d + 4))


# --- values, shapes, dtypes ------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bandwidth", [0.3, "silverman"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch,event", [((), ()), ((3,), ()), ((3,), (2,)), ((2, 3), (2, 2))])
def test_new_log_weights_are_minus_log_n_and_shapes_are_kept(batch, event, dtype, bandwidth, scheme):
    n = 7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch + (n,) + event, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randn(batch + (n,), generator=g, dtype=dtype)
    label = torch.randint(0, 3, batch + (n, 2), generator=g)
    flag = torch.rand(batch + (n,), generator=g) < 0.5
    log_w = torch.randn(batch + (n,), generator=g, dtype=dtype).log_softmax(-1).requires_grad_()
    particles = {"x": x, "y": y, "label": label, "flag": flag}
    new, new_log_w = KernelResampler(bandwidth, scheme=scheme)(particles, log_w)
    assert list(new) == list(particles)
    for key, value in particles.items():
        assert new[key].shape == value.shape and new[key].dtype == value.dtype
        assert not new[key].requires_grad
    assert new_log_w.shape == log_w.shape and new_log_w.dtype == dtype
    assert torch.equal(new_log_w, torch.full_like(log_w, -math.log(n)))
    assert new_log_w.requires_grad
    grads = torch.autograd.grad(new_log_w.sum(), (x, log_w))
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_labels_and_floats_of_a_new_particle_come_from_one_ancestor():
    """With a tiny bandwidth the new particle sits at its ancestor, whose labels it carries."""
    n, h = 50, 1e-4
    x, log_w = _cloud((4,), n, 3, torch.float64)
    ids = torch.arange(n).expand(4, n)
    new, _ = KernelResampler(h)({"x": x, "id": ids}, log_w)
    ancestor_x = x.gather(1, new["id"].unsqueeze(-1).expand(4, n, 3))
    assert ((new["x"] - ancestor_x).abs() < 7 * h).all()
    # Only particles of positive weight are ancestors, and the jitter is not zero.
    assert not torch.equal(new["x"], ancestor_x)


def test_float32_state_with_float64_weights_keeps_its_dtype():
    x, log_w = _cloud((2,), 10, 1, torch.float64)
    new, new_log_w = KernelResampler(0.1)({"x": x.float()}, log_w)
    assert new["x"].dtype == torch.float32 and new_log_w.dtype == torch.float64


def test_integer_state_only_gets_the_mass_of_the_drawn_labels():
    """No floating-point state: the mixture is sum_j w_j delta(z - z_j); its score at the drawn label is
    w_j / sum_{k: z_k = z} w_k on the particles with that label."""
    log_w = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_()
    z = torch.tensor([0, 1, 0, 1])
    new, new_log_w = KernelResampler(0.5, scheme="multinomial")({"z": z}, log_w)
    assert torch.equal(new_log_w, torch.full((4,), -math.log(4)))
    (grad,) = torch.autograd.grad(new_log_w.sum(), log_w)
    w = log_w.detach().exp()
    expected = sum(torch.where(z == label, w, torch.zeros_like(w)) / w[z == label].sum() for label in new["z"])
    assert torch.allclose(grad, expected)


# --- the law of the new particles -------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_new_particles_have_the_mixture_mean_and_covariance(scheme, seed):
    """Per filter, the new particles' mean and second central moment (about the exact mixture mean)
    are unbiased for the mixture's: mean sum_j w_j x_j, covariance the weighted covariance +
    diag(h^2). Independent filters give the error bars (valid for systematic ancestors too)."""
    n, reps = 10, 4000
    x, log_w = _cloud((), n, 2, torch.float64, seed=seed)
    h = torch.tensor([0.3, 0.7])
    w = log_w.exp()
    mu = w @ x
    cov = (w.unsqueeze(-1) * (x - mu)).T @ (x - mu) + torch.diag(h**2)
    pyro.set_rng_seed(seed)
    new, _ = KernelResampler(h, scheme=scheme)({"x": x.expand(reps, n, 2)}, log_w.expand(reps, n))
    z = new["x"] - mu  # (reps, N, 2)
    per_filter = torch.cat([z.mean(1), (z.unsqueeze(-1) * z.unsqueeze(-2)).mean(1).reshape(reps, 4)], -1)
    est, se = per_filter.mean(0), per_filter.std(0) / math.sqrt(reps)
    truth = torch.cat([torch.zeros(2), cov.reshape(4)])
    assert ((est - truth).abs() < MC_SIGMAS * se).all(), (est, truth, se)
    # The test can fail: the weighted covariance without the kernel is rejected.
    assert ((est[2:] - (cov - torch.diag(h**2)).reshape(4)).abs()[[0, 3]] > MC_SIGMAS * se[[2, 5]]).all()


# --- unbiased gradients ----------------------------------------------------------------------------
def _exact_moments(logits, x, h, keep):
    w = logits.log_softmax(-1).exp() * keep
    return torch.stack([(w * x).sum(), (w * (x**2 + h**2)).sum()])


@pytest.mark.parametrize("with_labels", [False, True], ids=["floats", "labels"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bandwidth", ["fixed", "silverman"])
def test_gradient_of_the_resampled_estimate_is_unbiased(bandwidth, scheme, with_labels):
    """For f(x) = x and x^2, the autograd gradient of sum_i exp(lw~_i) f(x~_i) with respect to the
    old logits, particles and h, averaged over independent resamplings, is the exact derivative of
    E_m[f] (closed forms), within 5 sigma. With integer labels z (point-mass kernels) f is multiplied
    by [z == 0], which the density of the joint mixture must account for."""
    torch.manual_seed(3)
    n, groups, per_group = 5, 40, 400
    logits = torch.tensor([0.3, -1.0, 0.5, 0.0, -0.4], requires_grad=True)
    x = torch.tensor([-1.2, 0.4, 0.1, 1.5, 0.9], requires_grad=True)
    if bandwidth == "fixed":
        h = torch.tensor(0.6, requires_grad=True)
        resampler, params = KernelResampler(h, scheme=scheme), (logits, x, h)
        h_exact = h
    else:
        resampler, params = KernelResampler("silverman", scheme=scheme), (logits, x)
        h_exact = _silverman(x.unsqueeze(-1), logits.log_softmax(-1)).squeeze(-1)
    z = torch.tensor([0, 1, 0, 2, 1])
    keep = (z == 0).double() if with_labels else torch.ones(n)
    exact = _exact_moments(logits, x, h_exact, keep)
    truth = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(exact[k], params, retain_graph=True)]) for k in range(2)]
    estimates = []
    for _ in range(groups):
        log_w = logits.log_softmax(-1).expand(per_group, n)
        particles = {"x": x.expand(per_group, n)}
        if with_labels:
            particles["z"] = z.expand(per_group, n)
        new, new_log_w = resampler(particles, log_w)
        weights = new_log_w.exp() * (new["z"] == 0 if with_labels else 1)
        est = torch.stack([(weights * new["x"]).sum(-1).mean(), (weights * new["x"] ** 2).sum(-1).mean()])
        estimates.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(est[k], params, retain_graph=True)]) for k in range(2)]))
    estimates = torch.stack(estimates)  # (groups, 2, num_params)
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(groups)
    truth = torch.stack(truth)
    assert ((mean - truth).abs() < MC_SIGMAS * se + 1e-12).all(), (mean, truth, se)
    # Not trivially so: the error bars are small against the gradients.
    assert (se < 0.1 * truth.abs().max()).all()


# --- exact gradients at the drawn points -------------------------------------------------------------
def test_kernel_mixture_log_density_gradcheck():
    """float64 gradcheck of log m at fixed points in (logits, centres, per-coordinate h), with and
    without a mask of allowed pairs, and its value against torch.distributions."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 6, 3, generator=g) * 3
    points = centres[:, :4] + torch.randn(2, 4, 3, generator=g)
    logits = torch.randn(2, 6, generator=g)
    h = torch.tensor([0.5, 1.0, 2.0])
    allowed = torch.rand(2, 4, 6, generator=g) < 0.6
    allowed[..., 0] = True
    log_m = kernel_mixture_log_density(points, centres, logits.log_softmax(-1), h)
    assert torch.allclose(log_m, _reference_log_m(points, centres, logits.log_softmax(-1), h), rtol=1e-12, atol=1e-12)
    for mask in (None, allowed):
        inputs = tuple(t.clone().requires_grad_() for t in (points, logits, centres, h))
        assert torch.autograd.gradcheck(lambda p, lg, c, b, mask=mask: kernel_mixture_log_density(p, c, lg.log_softmax(-1), b, mask), inputs)


@pytest.mark.parametrize("bandwidth", ["fixed", "silverman"])
def test_resampler_gradcheck_with_the_draws_held_fixed(bandwidth):
    """The new log-weights' gradient in (logits, particles, h) is that of log m at the drawn points:
    gradcheck of the resampler run under a fixed seed, with the points it drew substituted back
    as constants into a reference mixture density (torch.distributions)."""
    n = 6
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, n, generator=g, requires_grad=True)
    x = torch.randn(3, n, 2, generator=g, requires_grad=True)
    h = torch.tensor([0.4, 0.8], requires_grad=True)

    def run(logits, x, h):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            resampler = KernelResampler(h if bandwidth == "fixed" else "silverman")
            return resampler({"x": x}, logits.log_softmax(-1))

    new, new_log_w = run(logits, x, h)
    drawn = new["x"]

    def reference(logits, x, h):
        log_w = logits.log_softmax(-1)
        band = h if bandwidth == "fixed" else _silverman(x, log_w)[..., None, None, :]
        return _reference_log_m(drawn, x, log_w, band)

    inputs = (logits, x, h) if bandwidth == "fixed" else (logits, x)
    assert torch.autograd.gradcheck(lambda *a: reference(*a, *(() if bandwidth == "fixed" else (h,))), inputs)
    ref = reference(logits, x, h)
    for k in range(3):
        for i in range(n):
            got = torch.autograd.grad(new_log_w[k, i], inputs, retain_graph=True)
            want = torch.autograd.grad(ref[k, i], inputs, retain_graph=True)
            for a, b in zip(got, want):
                assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)


def test_silverman_coordinate_without_spread_is_copied():
    """A coordinate where every particle of positive weight agrees gets h = 0: copied exactly, and
    the gradient stays finite."""
    x = torch.stack([torch.randn(20), torch.full((20,), 2.5)], -1).requires_grad_()
    log_w = torch.randn(20).log_softmax(-1).requires_grad_()
    new, new_log_w = KernelResampler("silverman")({"x": x}, log_w)
    assert (new["x"][:, 1] == 2.5).all() and new["x"][:, 0].unique().numel() == 20
    grads = torch.autograd.grad(new_log_w.sum(), (x, log_w))
    assert all(torch.isfinite(grad).all() for grad in grads)


# --- inside SMC -------------------------------------------------------------------------------------
def _ar1(a=0.9, q=0.5, r=0.3):
    one = torch.eye(1)
    return LinearGaussianSSM(a * one, q * one, one, r * one, torch.zeros(1), one)


@pytest.mark.parametrize("h", [0.02, 0.6])
def test_smc_is_the_regularised_filter_of_a_jittered_kalman_model(h):
    """Resampling at every step adds h^2 to the filtering covariance, so the filter targets the
    model with Q' = Q + A^2 h^2. Its filtering means agree with that Kalman filter within 5 sigma;
    with the large h they are far from the unjittered one, with the small h also within 5 sigma of it."""
    ssm = _ar1()
    pyro.set_rng_seed(0)
    _, ys = ssm.simulate(15)
    jittered = _ar1(q=0.5 + 0.81 * h**2)
    pyro.set_rng_seed(4)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=300, num_filters=30, ess_threshold=1.0, resampler=KernelResampler(h)).run(ys)
    assert bool(smc.resampled[:-1].all())
    means = smc.filtering_means["x"]  # (T, B, 1)
    est, se = means.mean(1), means.std(1) / math.sqrt(means.shape[1])
    assert torch.isfinite(smc.log_evidence).all()
    assert ((est - jittered.kalman_filter(ys).means).abs() < MC_SIGMAS * se).all()
    off = (est - ssm.kalman_filter(ys).means).abs() / se
    if h < 0.1:
        assert (off < MC_SIGMAS).all()
    else:
        assert off.max() > 2 * MC_SIGMAS


def test_smc_log_evidence_is_differentiable():
    ssm = _ar1()
    _, ys = ssm.simulate(10)
    a = torch.tensor([[0.8]], requires_grad=True)
    ssm.A = a
    x0 = torch.zeros(1, requires_grad=True)
    ssm.init_mean = x0
    smc = SMC(ssm, num_particles=100, num_filters=4, resampler=KernelResampler(0.1)).run(ys)
    assert torch.isfinite(smc.log_evidence).all()
    grads = torch.autograd.grad(smc.log_evidence.sum(), (a, x0))
    assert all(torch.isfinite(grad).all() and grad.abs().sum() > 0 for grad in grads)


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bandwidth", [0.0, -1.0, float("nan"), float("inf"), "scott", True, None, torch.tensor(0.0), torch.tensor([0.1, float("nan")]), torch.ones(2, 2)]
)
def test_bad_bandwidth_raises(bandwidth):
    with pytest.raises(ValueError, match="bandwidth"):
        KernelResampler(bandwidth)


def test_bad_scheme_and_weights_and_shapes_raise():
    with pytest.raises(ValueError, match="scheme"):
        KernelResampler(0.1, scheme="stratified_typo")
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="all zero"):
        KernelResampler(0.1)({"x": x}, torch.tensor([[0.0, -math.inf, -math.inf, -math.inf, -math.inf], [-math.inf] * 5]))
    with pytest.raises(ValueError, match="NaN"):
        KernelResampler(0.1)({"x": x}, torch.full((2, 5), math.nan))
    with pytest.raises(ValueError, match="leading dims"):
        KernelResampler(0.1)({"x": torch.randn(2, 4)}, torch.zeros(2, 5).log_softmax(-1))
    with pytest.raises(ValueError, match="bandwidth has shape"):
        KernelResampler(torch.ones(3))({"x": torch.randn(2, 5, 2)}, torch.zeros(2, 5).log_softmax(-1))
    # A learnt bandwidth that has become negative is caught at the call.
    h = torch.tensor(0.5, requires_grad=True)
    resampler = KernelResampler(h)
    with torch.no_grad():
        h.fill_(-0.5)
    with pytest.raises(ValueError, match="bandwidth"):
        resampler({"x": x}, torch.zeros(2, 5).log_softmax(-1))


def test_unnormalised_log_weights_give_the_normalised_weights_result():
    """Before: called directly with log-weights ``[0, 5, 1]`` (not summing to one) the kernel
    resampler's new mean came out near -420 where the weighted mean is 1.01. Now the result equals
    that of the normalised weights draw for draw."""
    x = torch.arange(3.0, dtype=torch.float64).expand(500, 3)
    log_w = torch.tensor([0.0, 5.0, 1.0], dtype=torch.float64).expand(500, 3)
    torch.manual_seed(0)
    raw = KernelResampler(bandwidth=0.1).resample({"x": x}, log_w)
    torch.manual_seed(0)
    normalised = KernelResampler(bandwidth=0.1).resample({"x": x}, log_w.log_softmax(-1))
    assert torch.allclose(raw.particles["x"], normalised.particles["x"]) and torch.allclose(raw.log_weights, normalised.log_weights)
    assert abs(float(raw.particles["x"].mean()) - float((log_w[0].softmax(-1) * x[0]).sum())) < 0.05
