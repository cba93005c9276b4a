"""Robustness of every engine: float32 and float64, extreme log-weights, small OT epsilon, long
sequences (T = 10^4) and bad inputs.

Only what the rest of the suite does not already check is here (e.g. float64 SMC against Kalman,
float64 EP on linear models and the float32 ensemble transform at small epsilon live in
tests/infer and tests/ops; Sinkhorn's own robustness tests are in tests/ops/test_sinkhorn.py). The library bugs these checks found (and that were then fixed) are
pinned by the regression tests at the end of the file.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

from pyro_smc import SMC, EPSmoother, OnlineVariationalFilter
from pyro_smc.guides import AutoKroneckerFlow, StreamingFilterGuide
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM
from pyro_smc.ops import resample
from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.weights import ess, log_mean_exp, normalize
from pyro_smc.resamplers import MultinomialResampler, OTResampler, StratifiedResampler, SystematicResampler
from tests.tolerances import MC_SIGMAS

DTYPES = [torch.float32, torch.float64]
DTYPE_IDS = ["float32", "float64"]
SCHEMES = [resample.systematic, resample.stratified, resample.multinomial]
INDEX_RESAMPLERS = [SystematicResampler, StratifiedResampler, MultinomialResampler]


def _lgssm(dtype, d=2, a=0.5, q=1.0, r=0.5):
    eye = torch.eye(d, dtype=dtype)
    return LinearGaussianSSM(a * eye, q * eye, eye, r * eye, torch.zeros(d, dtype=dtype), eye)


def _float64(ssm):
    """The same model in float64: the exact (Kalman) reference for float32 runs."""
    return LinearGaussianSSM(*(t.double() for t in (ssm.A, ssm.Q, ssm.C, ssm.R, ssm.init_mean, ssm.init_cov)))


def _nonlinear_copy(lin):
    """A LinearGaussianSSM written as a NonlinearGaussianSSM (the input of EPSmoother)."""
    A, C = lin.A, lin.C
    return NonlinearGaussianSSM(lambda x: x @ A.T, lin.Q, lambda x: x @ C.T, lin.R, lin.init_mean, lin.init_cov)


def _ulp(dtype, magnitude):
    """Spacing of floating-point numbers of size ``magnitude``: the rounding any op must accept."""
    return torch.finfo(dtype).eps * magnitude


# =================================================================================================
# float32 and float64 runs of every engine
# =================================================================================================
@pytest.mark.parametrize("resampler", ["systematic", "ot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_smc_log_evidence_matches_kalman_in_both_dtypes(dtype, resampler):
    """By the CLT for particle filters, log Z_hat ~ N(log Z - s^2 / 2, s^2) over independent filters;
    so mean(gap) + var(gap) / 2 must be within 5 standard errors of 0 (plus 0.05 nats for the
    entropic bias of the OT resampler). The reference is the float64 Kalman filter."""
    torch.set_default_dtype(dtype)
    ssm = _lgssm(dtype)
    _, ys = ssm.simulate(25, generator=torch.Generator().manual_seed(0))
    exact = _float64(ssm).log_evidence(ys.double())
    filters = 32
    with torch.no_grad():
        smc = SMC(ssm, num_particles=100, num_filters=filters, resampler=SystematicResampler() if resampler == "systematic" else OTResampler(0.25)).run(ys)
    assert smc.log_evidence.dtype == dtype and smc.log_weights.dtype == dtype
    assert smc.filtering_means["x"].dtype == dtype
    assert torch.isfinite(smc.log_evidence).all()
    gap = smc.log_evidence.double() - exact
    bias_allowance = 0.05 if resampler == "ot" else 0.0
    assert abs(float(gap.mean() + gap.var() / 2)) < MC_SIGMAS * float(gap.std()) / math.sqrt(filters) + bias_allowance, gap


@pytest.mark.parametrize("projection", ["linearization", "unscented"])
def test_ep_smoother_float32_linear_model_equals_rts(projection):
    """float64 is covered in tests/infer/test_ep_smoother.py; here the same identity in float32,
    against the float64 RTS smoother, to float32 accuracy (relative 1e-4 of the posterior scale)."""
    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    d, e = 3, 2
    A = 0.3 * torch.randn(d, d, generator=g) + 0.5 * torch.eye(d)
    C = torch.randn(e, d, generator=g)
    lin = LinearGaussianSSM(A, 0.5 * torch.eye(d), C, 0.2 * torch.eye(e), torch.randn(d, generator=g), torch.eye(d))
    _, ys = lin.simulate(30, generator=g)
    out = EPSmoother(_nonlinear_copy(lin), projection=projection, max_iter=3).smooth(ys)
    assert out.means.dtype == torch.float32 and out.covariances.dtype == torch.float32
    assert torch.isfinite(out.means).all() and torch.isfinite(out.covariances).all()
    rts = _float64(lin).rts_smoother(ys.double())
    scale = float(rts.covariances.diagonal(dim1=-2, dim2=-1).sqrt().max())
    assert (out.means.double() - rts.means).abs().max() < 1e-4 * max(scale, float(rts.means.abs().max()))
    assert (out.covariances.double() - rts.covariances).abs().max() < 1e-4 * scale**2
    assert (out.first_sweep.means.double() - rts.means).abs().max() < 1e-4 * max(scale, float(rts.means.abs().max()))


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kronecker_flow_svi_in_both_dtypes(dtype, kind):
    torch.set_default_dtype(dtype)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 2, dtype=dtype), 1.0).to_event(2))
        s = pyro.sample("s", dist.LogNormal(torch.zeros((), dtype=dtype), 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(x @ w, 0.3 * s).to_event(1), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g, dtype=dtype)
    y = x @ torch.randn(3, 2, generator=g, dtype=dtype) + 0.3 * torch.randn(20, 2, generator=g, dtype=dtype)
    guide = AutoKroneckerFlow(model, kind=kind, hidden_dims=(8,))
    elbos = [Trace_ELBO()] + ([TraceMeanField_ELBO()] if kind != "nonlinear" else [])
    losses = []
    for elbo in elbos:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), elbo)
        losses += [svi.step(x, y) for _ in range(4)]
    assert all(math.isfinite(v) for v in losses), losses
    params = dict(guide.named_parameters())
    assert params and all(p.dtype == dtype for p in params.values()), {k: p.dtype for k, p in params.items()}
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
    draw = guide(x, y)
    assert draw["w"].dtype == dtype and draw["w"].shape == (3, 2) and torch.isfinite(draw["w"]).all()
    assert guide.median(x, y)["w"].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_online_filter_matches_kalman_in_both_dtypes(dtype):
    """The fitted filtering means are within 0.5 posterior sd of Kalman's at every step (measured
    worst case about 0.2 sd for seeds 0-4) and the running ELBO is a lower bound close to log p."""
    torch.set_default_dtype(dtype)
    ssm = _lgssm(dtype, a=0.8, q=0.2, r=0.3)
    _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(1))
    kf = _float64(ssm).kalman_filter(ys.double())
    vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2).to(dtype), num_iterations=5, num_regression_samples=64)
    for t, y in enumerate(ys):
        vf.step(y)
        q = vf.filtering_distribution()
        assert q.mean.dtype == dtype and torch.isfinite(q.mean).all()
        sd = kf.covariances[t].diagonal().sqrt()
        assert ((q.mean.double() - kf.means[t]).abs() < 0.5 * sd).all(), t
    exact = float(kf.log_likelihoods.sum())
    assert torch.isfinite(vf.elbo) and exact - 2.0 < float(vf.elbo) < exact + 0.5


# =================================================================================================
# Extreme log-weights (+-1e4)
# =================================================================================================
@pytest.mark.parametrize("shift", [1e4, -1e4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_weights_are_shift_invariant_at_1e4(dtype, shift):
    g = torch.Generator().manual_seed(0)
    lw = (3 * torch.randn(4, 50, generator=g)).to(dtype)
    shifted = lw + shift
    # The shift itself rounds the inputs to the spacing of numbers near 1e4 (1e-3 in float32).
    tol = 4 * _ulp(dtype, abs(shift))
    base_lw, base_sum = normalize(lw)
    new_lw, new_sum = normalize(shifted)
    assert torch.isfinite(new_lw).all() and torch.isfinite(new_sum).all()
    assert (new_lw - base_lw).abs().max() <= tol
    assert (new_sum - (base_sum + shift)).abs().max() <= tol
    assert new_lw.logsumexp(-1).abs().max() <= tol
    assert (ess(new_lw) - ess(base_lw)).abs().max() <= 50 * tol
    assert (log_mean_exp(shifted) - (log_mean_exp(lw) + shift)).abs().max() <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("big", [True, False], ids=["one_at_+1e4", "others_at_-1e4"])
def test_one_dominant_weight(dtype, big):
    """A weight 1e4 nats above the others: normalised exactly to a point mass, ESS 1."""
    n, k = 20, 7
    lw = torch.zeros(3, n, dtype=dtype)
    if big:
        lw[:, k] = 1e4
    else:
        lw.fill_(-1e4)
        lw[:, k] = 0.0
    nlw, log_sum = normalize(lw)
    assert torch.isfinite(log_sum).all()
    assert torch.equal(nlw[:, k], torch.zeros(3, dtype=dtype))
    assert (nlw[:, torch.arange(n) != k] <= -1e4 + 2 * _ulp(dtype, 1e4)).all()
    assert torch.allclose(ess(nlw), torch.ones(3, dtype=dtype))
    expected = (1e4 if big else 0.0) - math.log(n)
    assert (log_mean_exp(lw) - expected).abs().max() <= 4 * _ulp(dtype, 1e4)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dominant_weight_resamples_to_that_particle(dtype, scheme):
    n, k = 30, 11
    for lw in (
        torch.zeros(5, n, dtype=dtype).index_fill_(-1, torch.tensor([k]), 1e4),
        torch.full((5, n), -1e4, dtype=dtype).index_fill_(-1, torch.tensor([k]), 0.0),
    ):
        idx = scheme(normalize(lw)[0])
        assert idx.dtype == torch.int64 and idx.shape == (5, n)
        assert (idx == k).all()


@pytest.mark.parametrize("resampler", INDEX_RESAMPLERS + [OTResampler], ids=lambda r: r.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_resampler_classes_with_a_dominant_weight(dtype, resampler):
    n, k = 16, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, 2, generator=g, dtype=dtype)
    lw = normalize(torch.full((3, n), -1e4, dtype=dtype).index_fill_(-1, torch.tensor([k]), 0.0))[0]
    new, new_lw = resampler()({"x": x, "label": torch.arange(n).expand(3, n)}, lw)
    assert new["x"].dtype == dtype and torch.isfinite(new["x"]).all()
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    # Every particle becomes particle k (the OT map moves the whole mass onto it as well).
    assert torch.allclose(new["x"], x[:, k : k + 1].expand(3, n, 2), atol=10 * _ulp(dtype, 1.0) * float(x.abs().max()))
    assert (new["label"] == k).all()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.__name__)
def test_index_resampling_of_shifted_weights_is_identical(scheme):
    """Resampling normalise(lw + 1e4) or normalise(lw - 1e4) draws the same ancestors as
    normalise(lw) for the same random numbers (float64: the shift changes only the last bits)."""
    g = torch.Generator().manual_seed(2)
    lw = 2 * torch.randn(6, 40, generator=g)
    results = []
    for shift in (0.0, 1e4, -1e4):
        torch.manual_seed(123)
        results.append(scheme(normalize(lw + shift)[0]))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.5)], ids=["systematic", "ot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_smc_survives_an_outlier_with_log_weights_spread_over_1e4_nats(dtype, resampler):
    """A sharp likelihood (R = 1e-4) and an observation far from every particle: the increments
    are about -1e7 and spread over far more than 1e4 nats, yet every quantity stays finite, the
    weights stay normalised and the log-evidence stays below the exact one plus Monte Carlo slack."""
    torch.set_default_dtype(dtype)
    one = torch.eye(1, dtype=dtype)
    ssm = LinearGaussianSSM(0.5 * one, one, one, 1e-4 * one, torch.zeros(1, dtype=dtype), one)
    ys = torch.tensor([[0.1], [-0.3], [40.0], [39.5]], dtype=dtype)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=200, num_filters=4, resampler=resampler).run(ys)
    assert torch.isfinite(smc.log_evidence).all() and torch.isfinite(smc.log_weights).all()
    assert torch.isfinite(smc.filtering_means["x"]).all()
    assert (smc.log_weights.logsumexp(-1).abs() < 1e-4).all()
    assert ((smc.ess_history >= 1 - 1e-3) & (smc.ess_history <= 200 * (1 + 1e-3))).all()
    # P(log Z_hat > log Z + 10) <= e^-10 (Markov's inequality for the unbiased Z_hat).
    exact = float(_float64(ssm).log_evidence(ys.double()))
    assert (smc.log_evidence.double() < exact + 10).all()


# =================================================================================================
# OT with epsilon down to 0.01
# =================================================================================================
EPSILONS = [0.1, 0.03, 0.01]


def _threshold(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-7


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ot_resampler_small_epsilon_preserves_the_weighted_mean(dtype, epsilon):
    """The barycentric map moves every particle to a convex combination of the particles, and the
    equally weighted mean of the result is the weighted mean of the input (to the marginal error
    of the plan, at most 30 * threshold * max|x|, plus rounding)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, 2, generator=g, dtype=dtype)
    x[0, 0] = 8.0  # an outlier: the normalised cost of most pairs is then tiny
    lw = (2 * torch.randn(4, 64, generator=g, dtype=dtype)).log_softmax(-1)
    threshold = _threshold(dtype)
    new, new_lw = OTResampler(epsilon, threshold=threshold, max_iter=20000)({"x": x}, lw)
    assert new["x"].dtype == dtype and torch.isfinite(new["x"]).all()
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(64)))
    target = (lw.exp().unsqueeze(-1) * x).sum(-2)
    scale = float(x.abs().max())
    assert (new["x"].mean(-2) - target).abs().max() <= (30 * threshold + 200 * torch.finfo(dtype).eps) * scale
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    slack = 10 * _ulp(dtype, scale)
    assert ((new["x"] >= lo - slack) & (new["x"] <= hi + slack)).all()


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ensemble_transform_mean_error_is_bounded_by_the_plans_marginal_errors(dtype, epsilon):
    """Exact identity: with x~_i = sum_j P_ij x_j / r_i, |mean(x~) - sum_j w_j x_j| is at most
    (||P^T 1 - w||_1 + ||P 1 - 1/N||_1) max|x| (plus rounding), whatever the threshold; so the
    transform preserves the weighted mean exactly at an exact plan."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 50, 3, generator=g, dtype=dtype)
    lw = (3 * torch.randn(3, 50, generator=g, dtype=dtype)).log_softmax(-1)
    for threshold in (1e-2, _threshold(dtype)):
        x_new, plan = ensemble_transform(x, lw, epsilon, threshold=threshold, max_iter=20000)
        col = (plan.sum(-2) - lw.exp()).abs().sum(-1)
        row = (plan.sum(-1) - 1 / 50).abs().sum(-1)
        err = (x_new.mean(-2) - (lw.exp().unsqueeze(-1) * x).sum(-2)).abs().amax(-1)
        scale = x.abs().amax((-1, -2))
        assert (err <= (col + row) * scale + 500 * torch.finfo(dtype).eps * scale).all(), (err, col, row)


# =================================================================================================
# Long sequences
# =================================================================================================
def _ar1(dtype=torch.float64, q=0.19, r=1.0):
    """x_t = 0.9 x_{t-1} + N(0, q) with stationary variance 1 (q = 0.19), y_t = x_t + N(0, r)."""
    one = torch.eye(1, dtype=dtype)
    return LinearGaussianSSM(0.9 * one, q * one, one, r * one, torch.zeros(1, dtype=dtype), one)


def test_kalman_filter_at_T_1e4_matches_pyro_gaussian_hmm():
    """10^4 sequential Kalman steps against Pyro's GaussianHMM (a parallel-scan computation of the
    same log-likelihood): agreement to 1e-9 relative, and finite, positive filter variances."""
    ssm = _ar1()
    T = 10_000
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))
    kf = ssm.kalman_filter(ys)
    assert torch.isfinite(kf.means).all() and (kf.covariances > 0).all()
    one = torch.eye(1)
    # GaussianHMM starts one transition before the first observation: x_0 ~ N(0, s) with
    # 0.81 s + q = 1 gives x_1 ~ N(0, 1), our prior.
    hmm = dist.GaussianHMM(
        dist.MultivariateNormal(torch.zeros(1), (1 - 0.19) / 0.81 * one),
        ssm.A.T,
        dist.MultivariateNormal(torch.zeros(1), ssm.Q),
        ssm.C.T,
        dist.MultivariateNormal(torch.zeros(1), ssm.R),
    )
    exact = hmm.log_prob(ys)
    assert torch.allclose(kf.log_likelihoods.sum(), exact, rtol=1e-9)


def _one_step_log_evidence_variance(ssm, ys, kf, num_particles):
    """First-order variance of log Z_hat for a bootstrap filter that resamples at every step:
    sum_t chi^2_t / N, chi^2_t = E[g^2] / E[g]^2 - 1 of the likelihood g(y_t | x) under the exact
    predictive N(m_t, P_t) (closed form for a Gaussian g: E[g] = N(y; m, P + R) and
    E[g^2] = N(y; m, P + R / 2) / sqrt(4 pi R))."""
    r = float(ssm.R)
    y, m, p = ys[:, 0], kf.predicted_means[:, 0], kf.predicted_covariances[:, 0, 0]

    def log_normal(v):
        return -0.5 * (y - m) ** 2 / v - 0.5 * torch.log(2 * math.pi * v)

    log_ratio = log_normal(p + r / 2) - 0.5 * math.log(4 * math.pi * r) - 2 * log_normal(p + r)
    return float(torch.expm1(log_ratio).sum()) / num_particles


def test_smc_log_evidence_at_T_1e4():
    """T = 10^4, N = 100, five independent filters (seeds 0-4 in one vectorised run), resampling at
    every step. With V the first-order variance above (the per-step chi^2 over N, summed: the
    squared Monte Carlo error, growing like T), the CLT gives log Z_hat - log Z ~ N(-s^2 / 2, s^2)
    with s^2 = V up to the propagation of past errors; allowing s^2 = 2V, each gap must lie in
    [-V - 5 sqrt(2V), 5 sqrt(2V)]. Measured: V = 43.5 (sd 6.6), gaps -45 to -19 over 16 filters,
    their sd 6.7."""
    ssm = _ar1()
    T, N = 10_000, 100
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))
    kf = ssm.kalman_filter(ys)
    exact = kf.log_likelihoods.sum()
    V = _one_step_log_evidence_variance(ssm, ys, kf, N)
    assert 0 < V < 100  # the MC error is O(sqrt(T)): about 0.07 sqrt(T) nats here
    pyro.set_rng_seed(0)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=N, num_filters=5, ess_threshold=1.0).run(ys)
    gap = smc.log_evidence - exact
    assert torch.isfinite(smc.log_evidence).all() and torch.isfinite(smc.filtering_means["x"]).all()
    s = math.sqrt(2 * V)
    assert ((gap > -V - MC_SIGMAS * s) & (gap < MC_SIGMAS * s)).all(), (gap, V)
    assert float(gap.mean()) < 0  # Jensen: E[log Z_hat] < log Z


def test_kalman_rts_and_ep_smoother_at_T_1e4():
    ssm = _ar1()
    _, ys = ssm.simulate(10_000, generator=torch.Generator().manual_seed(1))
    rts = ssm.rts_smoother(ys)
    assert torch.isfinite(rts.means).all() and (rts.covariances > 0).all()
    out = EPSmoother(_nonlinear_copy(ssm), projection="linearization", max_iter=1).smooth(ys)
    assert torch.isfinite(out.means).all() and torch.isfinite(out.covariances).all()
    assert torch.allclose(out.means, rts.means, rtol=1e-8, atol=1e-10)
    assert torch.allclose(out.covariances, rts.covariances, rtol=1e-8, atol=1e-10)


def test_kalman_float32_at_T_1e4():
    ssm32 = _ar1(torch.float32)
    _, ys = _ar1().simulate(10_000, generator=torch.Generator().manual_seed(2))
    kf32 = ssm32.kalman_filter(ys.float())
    kf64 = _ar1().kalman_filter(ys)
    assert torch.isfinite(kf32.log_likelihoods).all()
    # Per-step rounding errors of relative size 1e-7 add up over 10^4 terms of size ~1.
    assert abs(float(kf32.log_likelihoods.double().sum() - kf64.log_likelihoods.sum())) < 1e-7 * 10_000 * 10
    assert (kf32.means.double() - kf64.means).abs().max() < 1e-4


def test_online_filter_long_stream_stays_finite():
    """T = 10^3 with one optimisation step per observation: the carried state stays finite and the
    last filtering mean is within one posterior sd of Kalman's."""
    ssm = _ar1()
    _, ys = ssm.simulate(1000, generator=torch.Generator().manual_seed(3))
    kf = ssm.kalman_filter(ys)
    vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(1), num_iterations=1, num_samples=8, num_regression_samples=32, window=2)
    for t, y in enumerate(ys):
        vf.step(y)
        if t % 100 == 99:
            assert torch.isfinite(vf.elbo) and torch.isfinite(vf.filtering_distribution().mean).all(), t
    sd = float(kf.covariances[-1].sqrt())
    assert abs(float(vf.filtering_distribution().mean) - float(kf.means[-1])) < sd
    assert torch.isfinite(vf.smoothing_samples(4)).all()


# =================================================================================================
# Bad inputs: clear ValueErrors naming the argument (only those not tested elsewhere)
# =================================================================================================
@pytest.mark.parametrize("epsilon", [0.0, -0.5, math.nan])
def test_ensemble_transform_rejects_bad_epsilon(epsilon):
    x = torch.randn(1, 5, 2)
    with pytest.raises(ValueError, match="epsilon"):
        ensemble_transform(x, torch.full((1, 5), -math.log(5)), epsilon)


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
def test_ot_resampler_rejects_invalid_log_weights(bad):
    with pytest.raises(ValueError, match="log_a and log_b"):
        OTResampler(0.5)({"x": torch.randn(2, 6, 1)}, torch.full((2, 6), bad))


def _not_symmetric(d):
    m = torch.eye(d)
    m[0, -1] = 0.5
    return m


BAD_COVARIANCES = [
    (lambda d: -torch.eye(d), "positive definite"),
    (lambda d: torch.zeros(d, d), "positive definite"),
    (lambda d: torch.diag(torch.tensor([1.0] + [-1.0] * (d - 1))), "positive definite"),
    (_not_symmetric, "symmetric"),
    (lambda d: torch.full((d, d), math.nan), "non-finite"),
    (lambda d: torch.eye(d + 1), "shape"),
]


@pytest.mark.parametrize("make, match", BAD_COVARIANCES, ids=["negative", "zero", "indefinite", "asymmetric", "nan", "shape"])
@pytest.mark.parametrize("name", ["Q", "R", "init_cov"])
def test_linear_gaussian_ssm_rejects_bad_covariances(name, make, match):
    d = 2
    eye = torch.eye(d)
    kwargs = dict(A=0.5 * eye, Q=eye, C=eye, R=eye, init_mean=torch.zeros(d), init_cov=eye)
    kwargs[name] = make(d)
    with pytest.raises(ValueError, match=rf"{name}.*{match}|{name} must have shape"):
        LinearGaussianSSM(**kwargs)


# (transition_cov, negative) is already in tests/infer/test_ep_smoother.py::test_bad_input.
NONLINEAR_BAD_COVARIANCES = [
    pytest.param(name, make, match, id=f"{name}-{kind}")
    for name in ("transition_cov", "observation_cov", "init_cov")
    for (make, match), kind in zip(BAD_COVARIANCES[:-1], ["negative", "zero", "indefinite", "asymmetric", "nan"])
    if (name, kind) != ("transition_cov", "negative")
]


@pytest.mark.parametrize("name, make, match", NONLINEAR_BAD_COVARIANCES)
def test_nonlinear_gaussian_ssm_rejects_bad_covariances(name, make, match):
    d = 2
    eye = torch.eye(d)
    kwargs = dict(transition=lambda x: x, transition_cov=eye, observation=lambda x: x, observation_cov=eye, init_mean=torch.zeros(d), init_cov=eye)
    kwargs[name] = make(d)
    with pytest.raises(ValueError, match=rf"{name}.*{match}"):
        NonlinearGaussianSSM(**kwargs)


def test_ssm_models_reject_wrong_shapes():
    eye = torch.eye(2)
    with pytest.raises(ValueError, match="C must have shape"):
        LinearGaussianSSM(eye, eye, torch.eye(3), eye, torch.zeros(2), eye)
    with pytest.raises(ValueError, match="init_mean"):
        LinearGaussianSSM(eye, eye, eye, eye, torch.zeros(3), eye)
    with pytest.raises(ValueError, match="A must be a square"):
        LinearGaussianSSM(torch.zeros(2, 3), eye, eye, eye, torch.zeros(2), eye)
    with pytest.raises(ValueError, match="init_mean"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, eye, torch.zeros(2, 1), eye)
    with pytest.raises(ValueError, match="observation_cov must have shape"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, torch.ones(2), torch.zeros(2), eye)


def test_smc_rejects_observations_of_the_wrong_shape():
    ssm = _lgssm(torch.float64)
    with pytest.raises(ValueError, match="observations"):
        SMC(ssm, num_particles=4).run(torch.tensor(1.0))
    with pytest.raises(ValueError, match="observations"):
        SMC(ssm, num_particles=4).run([[0.0, 0.0]])
    with pytest.raises(ValueError):  # Pyro's own validation of the observed site's event shape
        SMC(ssm, num_particles=4).run(torch.zeros(3, 5))


# =================================================================================================
# Regression tests: one per bug these checks found (each failed before its fix).
# =================================================================================================
def test_normalize_rejects_all_minus_inf_weights():
    with pytest.raises(ValueError, match="log_weights"):
        normalize(torch.full((2, 4), -math.inf))


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
@pytest.mark.parametrize("scheme", [resample.systematic, resample.stratified], ids=lambda s: s.__name__)
def test_index_resampling_rejects_invalid_weights(scheme, bad):
    with pytest.raises(ValueError, match="log_weights"):
        scheme(torch.full((3, 4), bad))


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
def test_multinomial_resampling_rejects_invalid_weights(bad):
    with pytest.raises(ValueError, match="log_weights"):
        resample.multinomial(torch.full((3, 4), bad))


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.5)], ids=["systematic", "ot"])
def test_resampler_rejects_particles_of_the_wrong_length(resampler):
    with pytest.raises(ValueError, match="x"):
        resampler({"x": torch.randn(3, 2)}, torch.full((4,), -math.log(4)))


