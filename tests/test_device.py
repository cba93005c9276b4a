"""Every engine runs on its inputs' device: no tensor is created on a hard-coded (or default) device.

With ``--device cuda`` the inputs live on the GPU and the default device stays the CPU, so any
tensor the library creates without ``device=`` lands on the CPU and the run fails with a device
mismatch. Without a GPU the same leak is caught on the CPU: the engines run with the default device
set to ``meta``, so a tensor created without ``device=`` is a meta tensor, and mixing it with the
(CPU) inputs raises ``Tensor on device meta is not on the expected device cpu``. The first test
shows the detector catches such a leak. The same trick catches dtype leaks: each case runs in
float32 and float64 with the default dtype set to the other one, and its outputs must keep the
inputs' dtype (a float64 tensor leaking into a float32 run promotes its results to float64).
Where an exact answer exists (Kalman, RTS, the float64 CPU run, least squares, a closed-form
density) the case checks it too, so a run that "works" by silently moving or casting data is
still caught; the rest check finiteness.
"""

import contextlib
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro.nn import PyroModule, PyroSample

from pyro_smc import SMC, SMC2, SMCELBO, EPSmoother, OnlineVariationalFilter
from pyro_smc.arviz import to_inference_data
from pyro_smc.distributions import MatrixNormal
from pyro_smc.gp import MultiOutputGP
from pyro_smc.guides import AutoKroneckerFlow, StreamingFilterGuide
from pyro_smc.infer.gaussian import smoothers as gaussian_smoothers
from pyro_smc.models import ChaoticRNN, DiagonalLinearGaussianSSM, LinearGaussianSSM, NonlinearGaussianSSM
from pyro_smc.resamplers import MultinomialResampler, OTResampler, SoftResampler, StratifiedResampler, SystematicResampler
from tests.guides.streaming.test_guide import _set_exact_smoother, _trajectory_model


DTYPES = {"float32": torch.float32, "float64": torch.float64}


@pytest.fixture(params=list(DTYPES))
def opts(request, device):
    """Factory keywords of the inputs: ``torch.eye(2, **opts)``."""
    return {"device": device, "dtype": DTYPES[request.param]}


@contextlib.contextmanager
def strict(opts):
    """Where the engine runs: the default device and dtype are ones the inputs are not in."""
    other = torch.float64 if opts["dtype"] == torch.float32 else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(other)
    try:
        with torch.device("meta") if opts["device"].type == "cpu" else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(old)


def _on(t, opts):
    return t.device == opts["device"] and t.dtype == opts["dtype"]


def _lgssm(opts, d=2, a=0.5):
    eye = torch.eye(d, **opts)
    return LinearGaussianSSM(a * eye, eye, eye, 0.5 * eye, torch.zeros(d, **opts), eye)


def _data(ssm, T=10, seed=0):
    return ssm.simulate(T, generator=torch.Generator(device=ssm.A.device).manual_seed(seed))[1]


def _tol(opts):
    return 1e-4 if opts["dtype"] == torch.float32 else 1e-8


def test_the_detector_catches_tensors_created_without_device_or_dtype(opts):
    x = torch.ones(3, **opts)
    with pytest.raises(RuntimeError, match="device"), strict(opts):
        x + torch.zeros(3, dtype=x.dtype)
    with strict(opts):
        if x.dtype == torch.float32:  # float32 + a leaked float64 tensor is promoted: caught by _on
            assert not _on(x + torch.zeros(3, device=x.device), opts)
        assert _on(x + torch.zeros_like(x), opts)


@pytest.mark.parametrize(
    "resampler",
    [SystematicResampler(), StratifiedResampler(), MultinomialResampler(), SoftResampler(0.5), OTResampler(0.5)],
    ids=lambda r: type(r).__name__,
)
def test_smc_and_its_arviz_data(opts, resampler):
    """Filters' log Z within 5 standard errors of the Kalman value (plus the resamplers' bias)."""
    ssm = _lgssm(opts)
    ys = _data(ssm)
    with strict(opts):
        smc = SMC(ssm, num_particles=200, num_filters=8, resampler=resampler, ess_threshold=1.0).run(ys)
        idata = to_inference_data(smc)
    assert _on(smc.log_evidence, opts) and _on(smc.filtering_means["x"], opts) and _on(smc.log_weights, opts)
    gap = smc.log_evidence.double() - ssm.log_evidence(ys).double()
    assert abs(float(gap.mean())) < 5 * float(gap.std()) / math.sqrt(8) + 0.1, gap
    assert idata.posterior["x"].shape[:2] == (8, 200)


def test_smcelbo_learns_under_svi(opts):
    """Gradient steps from a = 0.2 toward the data's a = 0.8 under SVI + SMCELBO + OT resampling."""
    ys = _data(_lgssm(opts, a=0.8), T=30)
    model = DiagonalLinearGaussianSSM(torch.full((2,), 0.2, **opts), torch.ones(2, **opts), 1.0, 0.5)
    with strict(opts):
        svi = SVI(model, None, pyro.optim.Adam({"lr": 0.05}), SMCELBO(num_particles=50, num_filters=2, resampler=OTResampler(0.5)))
        losses = [svi.step(ys) for _ in range(15)]
    assert all(math.isfinite(v) for v in losses)
    assert _on(model.transition_diag, opts) and (model.transition_diag > 0.4).all()


def test_kalman_oracles(opts):
    ssm = _lgssm(opts)
    ys = _data(ssm)
    with strict(opts):
        kf, rts, log_z = ssm.kalman_filter(ys), ssm.rts_smoother(ys), ssm.log_evidence(ys)
    assert _on(kf.means, opts) and _on(rts.covariances, opts) and _on(log_z, opts)
    ref = LinearGaussianSSM(*(t.cpu().double() for t in (ssm.A, ssm.Q, ssm.C, ssm.R, ssm.init_mean, ssm.init_cov))).log_evidence(ys.cpu().double())
    assert abs(float(log_z) - float(ref)) < _tol(opts) * abs(float(ref))


@pytest.mark.parametrize("projection", ["linearization", "unscented"])
def test_gaussian_smoothers_and_ep_equal_rts_on_a_linear_model(opts, projection):
    lin = _lgssm(opts)
    ys = _data(lin)
    # The linear model goes to the Gaussian engines as it is (the state-space-model protocol).
    ssm = lin
    with strict(opts):
        sweep = gaussian_smoothers.gaussian_smoother(ssm, ys, projection=projection)
        ep = EPSmoother(ssm, projection=projection, max_iter=2).smooth(ys)
    rts = lin.rts_smoother(ys)
    tol = 100 * _tol(opts)
    for out in (sweep, ep):
        assert _on(out.means, opts) and _on(out.covariances, opts)
        torch.testing.assert_close(out.means, rts.means, rtol=tol, atol=tol)
        torch.testing.assert_close(out.covariances, rts.covariances, rtol=tol, atol=tol)


def _gp_ssm(opts):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 1, generator=g, dtype=torch.float64).to(**opts)
    gp_f = MultiOutputGP(X, (0.5 * X + 0.1 * X**2).squeeze(-1), noise=0.01)
    gp_g = MultiOutputGP(X, X.squeeze(-1), noise=0.01)
    eye = torch.eye(1, **opts)
    ys = torch.randn(8, 1, generator=g, dtype=torch.float64).to(**opts)
    return NonlinearGaussianSSM(gp_f, 0.1 * eye, gp_g, 0.1 * eye, torch.zeros(1, **opts), eye), ys


def test_gp_dynamics_under_moment_matching(opts):
    """GP-RTSS and EP with GP dynamics and measurement against the float64 CPU run. The GP solves
    have condition number about 30 * variance / noise ~ 3e3, so a float32 run is good to about
    eps * 3e3 ~ 4e-4 (measured 5e-4); the tolerance is 10 eps * 3e3."""
    ssm, ys = _gp_ssm(opts)
    with strict(opts):
        rtss = gaussian_smoothers.gp_rtss(ssm, ys)
        ep = EPSmoother(ssm, projection="moment_matching", max_iter=2).smooth(ys)
    ref_ssm, ref_ys = _gp_ssm({"device": torch.device("cpu"), "dtype": torch.float64})
    ref_rtss = gaussian_smoothers.gp_rtss(ref_ssm, ref_ys)
    ref_ep = EPSmoother(ref_ssm, projection="moment_matching", max_iter=2).smooth(ref_ys)
    tol = 10 * torch.finfo(opts["dtype"]).eps * 3e3
    for out, ref in ((rtss, ref_rtss), (ep, ref_ep), (ep.first_sweep, ref_rtss)):
        assert _on(out.means, opts) and _on(out.covariances, opts)
        assert (out.means.cpu().double() - ref.means).abs().max() < tol
        assert (out.covariances.cpu().double() - ref.covariances).abs().max() < tol


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
def test_kronecker_flow_svi_predictive_and_arviz(opts, kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64).to(**opts)
    w_true = torch.tensor([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0]], **opts)
    y = x @ w_true + 0.1 * torch.randn(40, 2, generator=g, dtype=torch.float64).to(**opts)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 2, dtype=x.dtype, device=x.device), 1.0).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(x @ w, 0.1).to_event(1), obs=y)

    with strict(opts):
        guide = AutoKroneckerFlow(model, kind=kind, **({"hidden_dims": (8,)} if kind == "nonlinear" else {}))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        # 150 steps: on seeds 0-2, both dtypes and every kind, the mean lands within 0.074 of the
        # least-squares fit (it starts about 2 away).
        losses = [svi.step(x, y) for _ in range(150)]
        draws = Predictive(model, guide=guide, num_samples=20, return_sites=["w"])(x)["w"]
        idata = to_inference_data(guide, x, model=model, num_draws=10)
    assert all(math.isfinite(v) for v in losses) and _on(draws, opts)
    assert all(_on(p, opts) for p in guide.parameters())
    # The posterior mean is the least-squares fit up to the prior's pull and posterior sd 0.1 / sqrt(40).
    ls = torch.linalg.lstsq(x, y).solution
    assert (draws.mean(0) - ls).abs().max() < 0.15, (draws.mean(0), ls)
    assert idata.posterior["w"].shape == (1, 10, 3, 2)


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
def test_kronecker_flow_local_and_constrained_sites(opts, kind):
    """Subsampled local matrices, LKJ, simplex and positive sites: every parameter, sample,
    median and quantile on the inputs' device and dtype, with JIT-traced ELBO and flows."""
    from pyro.infer import JitTrace_ELBO

    data = torch.linspace(-1.0, 1.0, 30, **opts)

    def model():
        corr = pyro.sample("corr", dist.LKJCholesky(3, torch.ones((), **opts)))
        probs = pyro.sample("probs", dist.Dirichlet(torch.ones(3, **opts)))
        w = pyro.sample("w", dist.LogNormal(torch.zeros(3, 2, **opts), 1.0).to_event(2))
        with pyro.plate("data", 30, subsample_size=10, device=opts["device"]) as idx:
            m = pyro.sample("m", dist.Normal(torch.zeros(2, 2, **opts), 1.0).to_event(2))
            mean = m.sum((-1, -2)) + corr.sum() + probs.sum() + w.sum()
            pyro.sample("y", dist.Normal(mean, 1.0), obs=data[idx])

    with strict(opts):
        guide = AutoKroneckerFlow(model, kind=kind, **({"hidden_dims": (4,)} if kind == "nonlinear" else {}))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), JitTrace_ELBO(ignore_jit_warnings=True))
        losses = [svi.step() for _ in range(3)]
        sample, median = guide(), guide.median()
        quantiles = guide.quantiles([0.25, 0.75])
    assert all(math.isfinite(v) for v in losses)
    assert guide.matrix_sites == {"w": (3, 2), "m": (2, 2)}
    assert all(_on(p, opts) for p in guide.parameters())
    for out in (sample, median, quantiles):
        assert all(_on(v, opts) for v in out.values())
    assert median["m"].shape == (30, 2, 2) and sample["m"].shape == (10, 2, 2) and quantiles["m"].shape == (2, 30, 2, 2)
    assert (quantiles["w"][0] < quantiles["w"][1]).all() and (quantiles["w"][0] > 0).all()
    torch.testing.assert_close(median["probs"].sum(), torch.ones((), **opts))


def test_matrix_normal(opts):
    loc = torch.zeros(3, 2, **opts)
    row, col = torch.eye(3, **opts), 2 * torch.eye(2, **opts)
    with strict(opts):
        d = MatrixNormal(loc, row, col)
        w = d.rsample((500,))
        lp = d.log_prob(w)
    assert _on(w, opts) and _on(lp, opts)
    # Row scale I and column scale 2 I: independent entries with sd 2.
    ref = dist.Normal(torch.zeros(3, 2, **opts), 2.0).to_event(2).log_prob(w)
    torch.testing.assert_close(lp, ref)


@pytest.mark.parametrize("regressor", ["quadratic", "kernel", "mlp"])
def test_online_filter_with_parameter_learning(opts, regressor):
    """Filtering means within 0.5 posterior sd of Kalman's (the tolerance of
    tests/infer/test_online.py::test_online_filter_matches_kalman_in_both_dtypes), with online
    parameter learning and a checkpoint on the way."""
    true = DiagonalLinearGaussianSSM(torch.full((2,), 0.8, **opts), torch.ones(2, **opts), 0.5, 0.3)
    ys = true.as_linear_gaussian().simulate(6, generator=torch.Generator(device=opts["device"]).manual_seed(0))[1]
    model = DiagonalLinearGaussianSSM(torch.full((2,), 0.8, **opts), torch.ones(2, **opts), 0.5, 0.3)
    guide = StreamingFilterGuide(2).to(**opts)
    kf = true.as_linear_gaussian().kalman_filter(ys)
    with strict(opts):
        vf = OnlineVariationalFilter(model, guide, num_iterations=10, num_regression_samples=64, regressor=regressor, learn_parameters=True, parameter_lr=1e-3)
        for t, y in enumerate(ys):
            vf.step(y)
            q = vf.filtering_distribution()
            assert _on(q.mean, opts)
            assert ((q.mean - kf.means[t]).abs() < 0.5 * kf.covariances[t].diagonal().sqrt()).all(), t
        vf.load_state_dict(vf.state_dict())
        vf.step(ys[-1])
    assert torch.isfinite(vf.elbo) and _on(vf.elbo, opts)
    assert _on(model.transition_diag, opts) and torch.isfinite(model.transition_diag).all()


def test_streaming_guide_offline_under_svi(opts):
    lin = _lgssm(opts)
    ys = _data(lin, T=4)
    guide = StreamingFilterGuide(2, _trajectory_model(lin), num_steps=4, covariance="full").to(**opts)
    with strict(opts):
        svi = SVI(_trajectory_model(lin), guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
        losses = [svi.step(ys) for _ in range(5)]
        means, covs = guide.marginals()
        joint = guide.joint_distribution()
    assert all(math.isfinite(v) for v in losses)
    assert _on(means, opts) and _on(covs, opts) and _on(joint.loc, opts)
    # At the exact smoother every draw's log p(y, x) - log q(x) is the log evidence.
    with torch.no_grad():
        _set_exact_smoother(guide, lin, ys)
    with strict(opts):
        elbo = -Trace_ELBO().loss(_trajectory_model(lin), guide, ys)
    assert abs(elbo - float(lin.log_evidence(ys))) < _tol(opts) * (1 + abs(elbo)), (elbo, float(lin.log_evidence(ys)))


def test_chaotic_rnn_under_smc(opts):
    rnn = ChaoticRNN(state_dim=3, generator=torch.Generator().manual_seed(0)).to(**opts)
    with strict(opts):
        _, ys = rnn.simulate(5, generator=torch.Generator(device=opts["device"]).manual_seed(1))
        smc = SMC(rnn, num_particles=50, num_filters=2).run(ys)
        surrogate = gaussian_smoothers.unscented_kalman_filter(rnn.as_nonlinear_gaussian(), ys)
    assert _on(ys, opts) and _on(smc.log_evidence, opts) and _on(surrogate.means, opts)
    assert torch.isfinite(smc.log_evidence).all() and torch.isfinite(surrogate.means).all()


class _StaticAR1(PyroModule):
    """x_t = rho x_{t-1} + N(0, 1), y_t ~ N(x_t, sigma^2); rho, sigma static, priors on the inputs' device/dtype."""

    def __init__(self, opts):
        super().__init__()
        one = torch.ones((), **opts)
        self.rho = PyroSample(dist.Uniform(-one, one))
        self.sigma = PyroSample(dist.LogNormal(-0.5 * one, 0.5 * one))
        self.zero, self.one = 0 * one, one

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(self.zero, self.one))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], self.one))
        pyro.sample("y", dist.Normal(state["x"], self.sigma), obs=y)


def test_smc2(opts):
    """SMC2's parameters, weights, evidence and records stay on the inputs' device and dtype."""
    ys = torch.randn(8, **opts)
    pyro.set_rng_seed(0)
    with strict(opts):
        smc2 = SMC2(_StaticAR1(opts), num_parameter_particles=16, num_particles=8, ess_threshold=0.9).run(ys)
        out = smc2.result
    assert out.rejuvenated.any()
    assert _on(smc2.log_evidence, opts) and _on(smc2.log_weights, opts) and _on(smc2.parameters["sigma"], opts)
    assert _on(out.log_evidence_increments, opts) and _on(out.acceptance_rates, opts)
    assert bool(torch.isfinite(smc2.log_evidence))
