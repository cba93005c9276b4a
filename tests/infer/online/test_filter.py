"""OnlineVariationalFilter against the Kalman filter, smoother and exact gradients."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.models import DiagonalLinearGaussianSSM, LinearGaussianSSM
from pyro_smc.ops import kalman
from tests.cases import DTYPE_IDS, DTYPES, ar1_ssm, as_float64, isotropic_lgssm


def _ssm(d=3, dy=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    A = 0.8 * torch.eye(d, dtype=dtype) + 0.05 * torch.randn(d, d, generator=g, dtype=dtype)
    C = torch.randn(dy, d, generator=g, dtype=dtype)
    return LinearGaussianSSM(A, 0.2 * torch.eye(d, dtype=dtype), C, 0.3 * torch.eye(dy, dtype=dtype), torch.zeros(d, dtype=dtype), torch.eye(d, dtype=dtype))


def _plug_kalman(guide, kf, A, t):
    """Sets the guide to the exact filtering marginal at t and the exact backward kernel p(x_{t-1} | x_t, y_{1:t-1})."""
    guide.set_marginal(kf.means[t], kf.covariances[t])
    if t > 0:
        pred = kf.predicted_covariances[t]
        gain = kf.covariances[t - 1] @ A.T @ torch.linalg.inv(pred)
        guide.set_kernel(gain, kf.means[t - 1] - gain @ A @ kf.means[t - 1], kf.covariances[t - 1] - gain @ pred @ gain.T)


def _exact_filter(ssm, ys):
    """Kalman filter that treats an all-NaN observation as missing (predict only)."""
    m, P = ssm.init_mean, ssm.init_cov
    means, covs, pcovs, lls = [], [], [], []
    for t, y in enumerate(ys):
        if t > 0:
            m, P = kalman.predict(m, P, ssm.A, ssm.Q)
        pcovs.append(P)
        if torch.isnan(y).all():
            ll = torch.zeros((), dtype=y.dtype)
        else:
            m, P, ll = kalman.update(m, P, y, ssm.C, ssm.R)
        means.append(m)
        covs.append(P)
        lls.append(ll)
    return kalman.FilterResult(torch.stack(means), torch.stack(covs), torch.stack(means), torch.stack(pcovs), torch.stack(lls))


@pytest.mark.parametrize("missing", [False, True])
def test_exact_kalman_increments_are_deterministic(missing):
    ssm = _ssm()
    _, ys = ssm.simulate(8, generator=torch.Generator().manual_seed(1))
    if missing:
        ys[3] = float("nan")
    kf = _exact_filter(ssm, ys)
    guide = StreamingFilterGuide(3, covariance="full")
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=0, initialize="previous", num_regression_samples=64)
    for t, y in enumerate(ys):
        _plug_kalman(guide, kf, ssm.A, t)
        vf.step(y)
        # Every sample's increment is log p(y_t | y_{1:t-1}), not just their mean.
        torch.testing.assert_close(vf.last_increments, kf.log_evidence_increments[t].expand(64), rtol=0, atol=1e-10)
    torch.testing.assert_close(vf.elbo, kf.log_evidence, rtol=0, atol=1e-9)
    if not missing:
        torch.testing.assert_close(vf.elbo, ssm.log_evidence(ys), rtol=0, atol=1e-9)


def test_lagged_smoothing_samples_match_rts():
    ssm = _ssm()
    _, ys = ssm.simulate(6, generator=torch.Generator().manual_seed(2))
    kf = ssm.kalman_filter(ys)
    guide = StreamingFilterGuide(3, covariance="full")
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=0, initialize="previous", window=3, num_regression_samples=16)
    for t, y in enumerate(ys):
        _plug_kalman(guide, kf, ssm.A, t)
        vf.step(y)
    n = 20000
    torch.manual_seed(3)
    samples = vf.smoothing_samples(n)
    assert samples.shape == (n, 4, 3)
    rts = ssm.rts_smoother(ys)
    sd = rts.covariances[-4:].diagonal(dim1=-2, dim2=-1).sqrt()
    assert ((samples.mean(0) - rts.means[-4:]).abs() < 5 * sd / math.sqrt(n)).all()
    # Variances: the sample variance has sd ~ var * sqrt(2 / n).
    var = rts.covariances[-4:].diagonal(dim1=-2, dim2=-1)
    assert ((samples.var(0) - var).abs() < 5 * var * math.sqrt(2 / n)).all()
    with pytest.raises(ValueError, match="lag"):
        vf.smoothing_samples(10, lag=4)


def _joint_kl(guide, kf, A, t):
    """KL(q(x_{t-1}, x_t) || p(x_{t-1}, x_t | y_{1:t}))."""
    exact = StreamingFilterGuide(A.shape[0], covariance="full").double()
    _plug_kalman(exact, kf, A, t)
    return torch.distributions.kl_divergence(guide.joint_distribution(), exact.joint_distribution())


def test_fitted_filter_matches_kalman_figure_1a():
    """Campbell et al. (2021), Figure 1a: d = 10, diagonal dynamics and emissions, T = 10."""
    torch.manual_seed(0)
    d = 10
    F = torch.diag(0.5 + 0.5 * torch.rand(d, dtype=torch.float64))
    G = torch.diag(0.5 + 0.5 * torch.rand(d, dtype=torch.float64))
    eye = torch.eye(d, dtype=torch.float64)
    ssm = LinearGaussianSSM(F, 0.01 * eye, G, 0.01 * eye, torch.zeros(d, dtype=torch.float64), eye)
    _, ys = ssm.simulate(10)
    kf = ssm.kalman_filter(ys)
    guide = StreamingFilterGuide(d).double()
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=100, lr=0.002, num_samples=32, regressor="quadratic")
    for t, y in enumerate(ys):
        vf.step(y)
        q = vf.filtering_distribution()
        sd = kf.covariances[t].diagonal().sqrt()
        assert ((q.mean - kf.means[t]).abs() < 0.3 * sd).all(), t
        assert ((q.variance / sd.square()).log().abs() < 0.25).all(), t
        if t > 0:
            # A 20-dimensional joint: 0.25 nats is e.g. 20% variance errors in every coordinate;
            # 100 iterations at 32 samples give ~0.1 (seeds 0-2), the start alone ~1.
            assert float(_joint_kl(guide, kf, F, t).detach()) < 0.25, t
    # The running ELBO is a lower bound that ends close to the log evidence.
    exact = float(ssm.log_evidence(ys))
    assert exact - 1.5 < float(vf.elbo) < exact + 0.3


def test_score_recursion_matches_kalman_gradient():
    """With exact q's, G_t = E_q[S_t] estimates grad_theta log p(y_{1:t}) (Fisher's identity)."""
    torch.manual_seed(0)
    a = torch.tensor([0.7, 0.9], dtype=torch.float64)
    c = torch.tensor([0.8, 0.6], dtype=torch.float64)
    pyro.clear_param_store()
    model = DiagonalLinearGaussianSSM(a, c, 0.3, 0.25)
    lg = model.as_linear_gaussian()
    _, ys = lg.simulate(5)
    kf = lg.kalman_filter(ys)
    guide = StreamingFilterGuide(2, covariance="full").double()
    n = 2000
    vf = OnlineVariationalFilter(model, guide, num_iterations=0, initialize="previous", learn_parameters=True, parameter_lr=lambda t: 0.0, num_regression_samples=n)
    aa, cc = a.clone().requires_grad_(), c.clone().requires_grad_()
    for t, y in enumerate(ys):
        _plug_kalman(guide, kf, lg.A, t)
        vf.step(y)
        ll = kalman.kalman_filter(ys[: t + 1], torch.diag(aa), lg.Q, torch.diag(cc), lg.R, lg.init_mean, lg.init_cov).log_evidence
        exact = torch.cat([torch.zeros(2, dtype=a.dtype) if g is None else g for g in torch.autograd.grad(ll, [aa, cc], allow_unused=True)])
        # Monte Carlo error: the regression's mean over n draws; per-draw scores here have sd < 15.
        estimate = torch.cat([g.reshape(-1) for g in vf.log_evidence_gradient.values()])
        assert (estimate - exact).abs().max() < 5 * 15 / math.sqrt(n), t


def test_errors_name_the_step():
    ssm = _ssm()
    vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(3).double(), num_iterations=1, num_regression_samples=8)
    y = torch.zeros(2, dtype=torch.float64)
    vf.step(y)
    with pytest.raises(ValueError, match="step 1.*inf"):
        vf.step(torch.tensor([0.0, float("inf")], dtype=torch.float64))
    with pytest.raises(ValueError, match="step 1.*shape"):
        vf.step(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="step 1.*partly NaN"):
        vf.step(torch.tensor([0.0, float("nan")], dtype=torch.float64))
    with pytest.raises(ValueError, match="state_dim"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(2).double(), num_iterations=1).step(y)
    with pytest.raises(ValueError, match="online mode"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(3, num_steps=4))
    with pytest.raises(ValueError, match="initialize"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(3), initialize="prior")
    with pytest.raises(ValueError, match="num_samples"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(3), num_samples=0)
    with pytest.raises(ValueError, match="lr"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(3), lr=-1.0)
    with pytest.raises(ValueError, match="regressor"):
        OnlineVariationalFilter(ssm, StreamingFilterGuide(3), regressor="cubic")


class _TwoLatents:
    def init(self, state):
        pass

    def step(self, state, y):
        x = pyro.sample("x", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("z", dist.Normal(0.0, 1.0))
        state["x"] = x
        pyro.sample("y", dist.Normal(x, 1.0).to_event(1), obs=y)


def test_one_latent_site_per_step_required():
    vf = OnlineVariationalFilter(_TwoLatents(), StreamingFilterGuide(2), num_iterations=1)
    with pytest.raises(ValueError, match="exactly one latent site"):
        vf.step(torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("regressor,backward", [("quadratic", "linear"), ("kernel", "linear"), ("mlp", "mlp")])
def test_constant_state_and_no_param_store_growth(dtype, regressor, backward):
    ssm = _ssm(dtype=dtype)
    _, ys = ssm.simulate(12, generator=torch.Generator().manual_seed(4))
    guide = StreamingFilterGuide(3, backward=backward, hidden_dims=(8,)).to(dtype)
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=5, regressor=regressor, num_regression_samples=32, window=4)
    n_params = sum(p.numel() for p in guide.parameters())
    sizes = []
    for y in ys:
        vf.step(y)
        sizes.append((len(pyro.get_param_store()), len(vf._kernels), sum(p.numel() for p in guide.parameters())))
        assert vf.filtering_distribution().mean.dtype == dtype
    assert sizes[-1] == sizes[4] == (sizes[0][0], 4, n_params)
    assert torch.isfinite(vf.elbo)
    # Carried state is detached from every graph.
    assert all(not v.requires_grad for v in vf._state.values())
    assert vf.smoothing_samples(5).shape == (5, 5, 3)


def test_online_parameter_learning_converges():
    """Gradient-difference updates move (a, c) from (0.4, 0.5) to the truth (0.8, 1.0)."""
    torch.manual_seed(1)
    d, q, r = 2, 0.5, 0.3
    truth = DiagonalLinearGaussianSSM(torch.full((d,), 0.8), torch.full((d,), 1.0), q, r)
    _, ys = truth.as_linear_gaussian().simulate(400)
    pyro.clear_param_store()
    model = DiagonalLinearGaussianSSM(torch.full((d,), 0.4), torch.full((d,), 0.5), q, r)
    vf = OnlineVariationalFilter(
        model, StreamingFilterGuide(d), num_iterations=3, num_samples=16, num_regression_samples=64, learn_parameters=True, parameter_lr=0.01
    )
    vf.run(ys)
    params = vf.parameters()
    # The start is 0.4 / 0.5 away; the Robbins-Monro noise at t = 400 is a few hundredths.
    assert (params["transition_diag"] - 0.8).abs().max() < 0.12
    assert (params["emission_diag"] - 1.0).abs().max() < 0.12


class _LateParameter(pyro.nn.PyroModule):
    """Reads its transition parameter only from the second step on."""

    def __init__(self):
        super().__init__()
        self.a = pyro.nn.PyroParam(torch.tensor(0.5))
        self.c = pyro.nn.PyroParam(torch.tensor(1.0))

    def init(self, state):
        pass

    def step(self, state, y):
        loc = state["x"] * self.a if "x" in state else torch.zeros(1)
        x = pyro.sample(f"x_{len(state)}_{int(y.sum() * 0)}", dist.Normal(loc, 0.5).to_event(1))
        state["x"] = x
        pyro.sample("y", dist.Normal(self.c * x, 0.3).to_event(1), obs=y)


def test_parameters_first_read_later_are_learned():
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(_LateParameter(), StreamingFilterGuide(1), num_iterations=2, num_regression_samples=16, learn_parameters=True)
    for y in torch.randn(4, 1):
        vf.step(y)
    params = vf.parameters()
    assert set(params) == {"a", "c"} and float(params["a"]) != 0.5


@pytest.mark.parametrize("learn", [False, True])
def test_state_dict_resume_is_bit_identical(learn, tmp_path):
    d, q, r = 2, 0.5, 0.3
    _, ys = DiagonalLinearGaussianSSM(torch.full((d,), 0.8), torch.full((d,), 1.0), q, r).as_linear_gaussian().simulate(10)

    def build():
        pyro.clear_param_store()
        model = DiagonalLinearGaussianSSM(torch.full((d,), 0.4), torch.full((d,), 0.5), q, r)
        guide = StreamingFilterGuide(d, covariance="full")
        return OnlineVariationalFilter(model, guide, num_iterations=3, num_regression_samples=32, window=3, learn_parameters=learn)

    torch.manual_seed(0)
    vf = build()
    vf.run(ys[:6])
    torch.save(vf.state_dict(), tmp_path / "ckpt.pt")
    for y in ys[6:]:  # continue the stream (run would start a new one)
        vf.step(y)
    expected = (vf.elbo, vf.filtering_distribution().mean, vf.parameters(), vf.smoothing_samples(4))

    torch.manual_seed(123)  # the checkpoint's RNG state must win
    resumed = build()
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    assert resumed.t == 6
    for y in ys[6:]:
        resumed.step(y)
    got = (resumed.elbo, resumed.filtering_distribution().mean, resumed.parameters(), resumed.smoothing_samples(4))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and torch.equal(got[3], expected[3])
    assert got[2].keys() == expected[2].keys() and all(torch.equal(got[2][k], expected[2][k]) for k in got[2])


@pytest.mark.parametrize("n", [4, 64])  # more parameters than samples, and fewer
def test_per_sample_gradients_match_a_loop(n):
    from pyro_smc.ops.jacobian import per_sample_gradients

    torch.manual_seed(0)
    a, c, unused = (torch.randn(k, dtype=torch.float64, requires_grad=True) for k in (5, 5, 3))
    x0, x1 = torch.randn(n, 5, dtype=torch.float64), torch.randn(n, 5, dtype=torch.float64)
    values = dist.Normal(x0 * a, 0.1).log_prob(x1).sum(-1) + dist.Normal(x1 * c.exp(), 0.3).log_prob(torch.ones(5)).sum(-1)
    expected = torch.stack([torch.cat([*torch.autograd.grad(values[i], [a, c], retain_graph=True), torch.zeros(3, dtype=a.dtype)]) for i in range(n)])
    got = per_sample_gradients(values, [a, c, unused])
    torch.testing.assert_close(got, expected)


def test_too_few_regression_samples_warn():
    with pytest.warns(UserWarning, match="quadratic features"):
        OnlineVariationalFilter(_ssm(), StreamingFilterGuide(3), num_regression_samples=8)


@pytest.mark.parametrize("missing_steps", [(3,), (0, 3)])
def test_a_none_observation_is_predict_only(missing_steps):
    """step(None) is the same predict-only step as an all-NaN observation, also at t = 0."""
    ssm = _ssm()
    _, ys = ssm.simulate(6, generator=torch.Generator().manual_seed(1))
    for t in missing_steps:
        ys[t] = float("nan")
    kf = _exact_filter(ssm, ys)
    guide = StreamingFilterGuide(3, covariance="full")
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=0, initialize="previous", num_regression_samples=64)
    for t, y in enumerate(ys):
        _plug_kalman(guide, kf, ssm.A, t)
        vf.step(None if t in missing_steps else y)
        torch.testing.assert_close(vf.last_increments, kf.log_evidence_increments[t].expand(64), rtol=0, atol=1e-10)
    torch.testing.assert_close(vf.log_evidence, kf.log_evidence, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="step 6.*Tensor or None"):
        vf.step([0.0, 0.0])


def test_run_is_init_then_steps_and_log_evidence_is_the_elbo():
    ssm = _ssm()
    _, ys = ssm.simulate(4, generator=torch.Generator().manual_seed(5))

    def build():
        return OnlineVariationalFilter(ssm, StreamingFilterGuide(3).double(), num_iterations=2, num_regression_samples=32)

    torch.manual_seed(0)
    stepped = build().init()
    for y in ys:
        stepped.step(y)
    torch.manual_seed(0)
    ran = build().run(ys)
    assert torch.equal(ran.log_evidence, stepped.log_evidence)
    out = ran.result  # the typed snapshot: the increments telescope to the running ELBO
    assert out.filtering_means.shape == (4, 3) and out.filtering_covariances.shape == (4, 3, 3)
    torch.testing.assert_close(out.log_evidence_increments.sum(), out.log_evidence)
    torch.testing.assert_close(out.filtering_means[-1], ran.filtering_distribution().mean)
    assert ran.run(ys[:2]).t == 2  # a second run starts a new stream
    assert ran.result.filtering_means.shape == (2, 3)
    assert ran.elbo is ran.log_evidence and not hasattr(ran, "elbo_increment")
    assert torch.isfinite(ran.log_evidence)
    bad = ys.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match="step 2.*partly NaN"):
        ran.run(bad)
    assert ran.t == 2  # checked before anything ran
    with pytest.raises(ValueError, match="observations"):
        ran.run(torch.tensor(1.0))


def test_a_bare_streaming_family_is_an_online_guide():
    from pyro_smc.guides import StreamingFamily

    ssm = _ssm()
    _, ys = ssm.simulate(3, generator=torch.Generator().manual_seed(6))
    vf = OnlineVariationalFilter(ssm, StreamingFamily(3, covariance="full").double(), num_iterations=1, num_regression_samples=64)
    assert vf.run(ys).smoothing_samples(4).shape == (4, 3, 3)
    with pytest.raises(ValueError, match="online mode"):
        OnlineVariationalFilter(ssm, StreamingFamily(3, num_kernels=2))


# =================================================================================================
# Both dtypes and a long stream
# =================================================================================================
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_online_filter_matches_kalman_in_both_dtypes(dtype):
    """The fitted filtering means are within 0.5 posterior sd of Kalman's at every step (measured
    worst case about 0.2 sd for seeds 0-4) and the running ELBO is a lower bound close to log p."""
    torch.set_default_dtype(dtype)
    ssm = isotropic_lgssm(dtype, a=0.8, q=0.2, r=0.3)
    _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(1))
    kf = as_float64(ssm).kalman_filter(ys.double())
    vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2).to(dtype), num_iterations=5, num_regression_samples=64)
    for t, y in enumerate(ys):
        vf.step(y)
        q = vf.filtering_distribution()
        assert q.mean.dtype == dtype and torch.isfinite(q.mean).all()
        sd = kf.covariances[t].diagonal().sqrt()
        assert ((q.mean.double() - kf.means[t]).abs() < 0.5 * sd).all(), t
    exact = float(kf.log_evidence)
    assert torch.isfinite(vf.elbo) and exact - 2.0 < float(vf.elbo) < exact + 0.5


def test_online_filter_long_stream_stays_finite():
    """T = 10^3 with one optimisation step per observation: the carried state stays finite and the
    last filtering mean is within one posterior sd of Kalman's. The stopping rule is off, so every
    step takes exactly that one step (its check cost more than the step; it is tested in
    test_stopping.py)."""
    ssm = ar1_ssm()
    _, ys = ssm.simulate(1000, generator=torch.Generator().manual_seed(3))
    kf = ssm.kalman_filter(ys)
    vf = OnlineVariationalFilter(
        ssm, StreamingFilterGuide(1), num_iterations=1, num_samples=8, num_regression_samples=32, window=2, stop_sigmas=None
    )
    for t, y in enumerate(ys):
        vf.step(y)
        if t % 100 == 99:
            assert torch.isfinite(vf.elbo) and torch.isfinite(vf.filtering_distribution().mean).all(), t
    sd = float(kf.covariances[-1].sqrt())
    assert abs(float(vf.filtering_distribution().mean) - float(kf.means[-1])) < sd
    assert torch.isfinite(vf.smoothing_samples(4)).all()
