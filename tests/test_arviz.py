"""pyro_smc.arviz.to_inference_data: SMC runs (filtering and smoothed), the streaming filter and guides."""

import math

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_smc import SMC, OnlineVariationalFilter
from pyro_smc.arviz import to_inference_data
from pyro_smc.guides import AutoKroneckerFlow, StreamingFilterGuide
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import OTResampler


def _ssm():
    eye = torch.eye(2)
    return LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)


def test_smc_equal_weight_draws_and_stats():
    torch.manual_seed(0)
    ssm = _ssm()
    _, ys = ssm.simulate(10)
    smc = SMC(ssm, num_particles=300, num_filters=3, ess_threshold=1e-9).run(ys)  # never resamples: unequal weights
    n = 20000
    idata = to_inference_data(smc, num_draws=n, generator=torch.Generator().manual_seed(1))
    x = idata.posterior["x"].values
    assert x.shape == (3, n, 2)
    # Equal-weight draws are unbiased for the weighted particle mean.
    w = smc.log_weights.exp()
    mean = (w.unsqueeze(-1) * smc.state["x"]).sum(1)
    sd = ((w.unsqueeze(-1) * (smc.state["x"] - mean.unsqueeze(1)) ** 2).sum(1)).sqrt()
    assert np.all(np.abs(x.mean(1) - mean.numpy()) < 5 * sd.numpy() / math.sqrt(n))
    stats = idata.sample_stats
    np.testing.assert_allclose(stats["log_evidence"].values[:, 0], smc.log_evidence.numpy(), rtol=1e-6)
    np.testing.assert_allclose(stats["ess"].values[:, 0], smc.ess.numpy(), rtol=1e-6)
    assert stats["log_weight"].shape == (3, n)
    summary = az.summary(idata, var_names=["x"])
    assert len(summary) == 2


def test_single_filter_and_errors():
    ssm = _ssm()
    _, ys = ssm.simulate(5)
    idata = to_inference_data(SMC(ssm, num_particles=50).run(ys))
    assert idata.posterior["x"].shape == (1, 50, 2)
    with pytest.raises(ValueError, match="not been run"):
        to_inference_data(SMC(ssm, num_particles=50))
    with pytest.raises(ValueError, match="cannot convert"):
        to_inference_data(3)


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1], 2]).to_event(2))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, s).to_event(1), obs=y)


@pytest.mark.parametrize("make_guide", [AutoNormal, lambda m: AutoKroneckerFlow(m, kind="linear")])
def test_guides(make_guide):
    pyro.clear_param_store()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    guide = make_guide(_regression)
    guide(x, y)
    idata = to_inference_data(guide, x, y, num_draws=40, num_chains=2)
    assert idata.posterior["w"].shape == (2, 20, 3, 2) and idata.posterior["s"].shape == (2, 20)
    assert az.summary(idata) is not None
    with pytest.raises(ValueError, match="multiple"):
        to_inference_data(guide, x, y, num_draws=41, num_chains=2)


def test_streaming_filter_and_guide():
    ssm = _ssm()
    _, ys = ssm.simulate(6)
    vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=2, num_regression_samples=16, window=3)
    vf.run(ys)
    idata = to_inference_data(vf, num_draws=30)
    assert idata.posterior["x"].shape == (1, 30, 4, 2)

    def model(ys):
        state = {}
        ssm.init(state)
        for y in ys:
            ssm.step(state, y)

    guide = StreamingFilterGuide(2, model)
    idata = to_inference_data(guide, ys, num_draws=10)
    assert idata.posterior["x_5"].shape == (1, 10, 2)


def test_smc_export_uses_the_weighted_particles_not_the_ot_shrunk_ones():
    """OT resampling's barycentric map shrinks the cloud (bias O(epsilon)); the export draws from
    the weighted particles before resampling, so its spread matches the Kalman filter."""
    torch.manual_seed(0)
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(30, generator=torch.Generator().manual_seed(0))
    smc = SMC(ssm, num_particles=2000, num_filters=2, resampler=OTResampler(epsilon=0.5)).run(ys)
    assert bool(smc.resampled[-1].all())
    sd = ssm.kalman_filter(ys).covariances[-1].diagonal().sqrt()
    x = to_inference_data(smc, generator=torch.Generator().manual_seed(1)).posterior["x"].values
    # Sample sd of n draws has relative sd ~ 1/sqrt(2n); the shrunk cloud is ~50% too narrow.
    assert np.all(np.abs(x.std(1) / sd.numpy() - 1) < 0.1)
    assert float(smc.state["x"].std(1).max() / sd.max()) < 0.7


@pytest.mark.parametrize("method", ["ffbs", "rejection", "genealogy"])
@pytest.mark.parametrize("num_filters", [1, 3])
def test_smc_smoothed_trajectories(method, num_filters):
    torch.manual_seed(0)
    ssm = _ssm()
    T, S = 7, 40
    _, ys = ssm.simulate(T)
    smc = SMC(ssm, num_particles=100, num_filters=num_filters, store_history=True).run(ys)
    torch.manual_seed(5)
    idata = to_inference_data(smc, smoothing=method, num_draws=S)
    torch.manual_seed(5)
    expected = smc.smooth(S, method=method)["x"]  # (S, T, B, 2)
    x = idata.posterior["x"]
    assert x.dims == ("chain", "draw", "time", "x_dim_0")
    assert x.shape == (num_filters, S, T, 2)
    np.testing.assert_array_equal(x.coords["time"].values, np.arange(T))
    np.testing.assert_array_equal(x.coords["chain"].values, np.arange(num_filters))
    np.testing.assert_array_equal(x.coords["draw"].values, np.arange(S))
    np.testing.assert_array_equal(x.values, expected.permute(2, 0, 1, 3).numpy())
    stats = idata.sample_stats
    assert stats["log_evidence"].shape == (num_filters, S)
    np.testing.assert_allclose(stats["log_evidence"].values[:, 0], smc.log_evidence.numpy(), rtol=1e-6)
    np.testing.assert_allclose(idata.attrs["log_evidence"], smc.log_evidence.tolist(), rtol=1e-6)
    assert idata.attrs["smoothing"] == method
    summary = az.summary(idata, var_names=["x"])
    assert len(summary) == T * 2


def test_smc_smoothed_default_draws_and_mean_near_kalman():
    torch.manual_seed(0)
    eye = torch.eye(2)
    # Unit observation noise: a bootstrap filter does not collapse on an outlying observation.
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(8, generator=torch.Generator().manual_seed(0))
    smc = SMC(ssm, num_particles=500, num_filters=2, store_history=True).run(ys)
    idata = to_inference_data(smc, smoothing="ffbs")
    x = idata.posterior["x"].values  # (2, 500, 8, 2)
    assert x.shape == (2, 500, 8, 2)
    smoothed = ssm.rts_smoother(ys)
    sd = smoothed.covariances.diagonal(dim1=-2, dim2=-1).sqrt().numpy()
    # Pooled over both filters: 1000 trajectories; MC and particle error well inside 0.5 sd.
    assert np.all(np.abs(x.mean((0, 1)) - smoothed.means.numpy()) < 0.5 * sd)


def test_smc_smoothed_errors():
    ssm = _ssm()
    _, ys = ssm.simulate(4)
    with pytest.raises(ValueError, match="store_history=True"):
        to_inference_data(SMC(ssm, num_particles=20).run(ys), smoothing="ffbs")
    with pytest.raises(ValueError, match="not been run"):
        to_inference_data(SMC(ssm, num_particles=20, store_history=True), smoothing="ffbs")
    smc = SMC(ssm, num_particles=20, store_history=True).run(ys)
    with pytest.raises(ValueError, match="method"):
        to_inference_data(smc, smoothing="bogus", num_draws=5)
    with pytest.raises(ValueError, match="num_draws"):
        to_inference_data(smc, smoothing="ffbs", num_draws=0)
    with pytest.raises(ValueError, match="generator"):
        to_inference_data(smc, smoothing="ffbs", generator=torch.Generator())
    with pytest.raises(ValueError, match="smoothing= applies"):
        to_inference_data(lambda: None, smoothing="ffbs")
    # Existing calls on a history-keeping engine still export the filtering particles.
    assert to_inference_data(smc).posterior["x"].shape == (1, 20, 2)


# --- Gaussian results --------------------------------------------------------------------------
def _gaussian_problem():
    from pyro_smc.models import LinearGaussianSSM

    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.7 * eye, 0.5 * eye, eye, 0.3 * eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(12, generator=torch.Generator().manual_seed(3))
    return ssm, ys


@pytest.mark.parametrize("kind", ["ep", "rts", "kalman", "urtss"])
def test_gaussian_result_draws_have_its_marginals(kind):
    """Draws from a Gaussian result's marginals: their mean within 5 sigma / sqrt(n) of the
    result's mean at every step and entry, their variance within 5 of its standard errors."""
    from pyro_smc import EPSmoother
    from pyro_smc.infer import unscented_rts_smoother

    ssm, ys = _gaussian_problem()
    result = {
        "ep": lambda: EPSmoother(ssm).smooth(ys),
        "rts": lambda: ssm.rts_smoother(ys),
        "kalman": lambda: ssm.kalman_filter(ys),
        "urtss": lambda: unscented_rts_smoother(ssm, ys),
    }[kind]()
    n = 4000
    idata = to_inference_data(result, num_draws=n, num_chains=4, generator=torch.Generator().manual_seed(0))
    x = torch.as_tensor(idata.posterior["x"].values)  # (4, 1000, T, d)
    assert x.shape == (4, n // 4, 12, 2) and idata.posterior["x"].dims == ("chain", "draw", "time", "x_dim_0")
    flat = x.reshape(n, 12, 2)
    var = result.covariances.diagonal(dim1=-2, dim2=-1)
    assert ((flat.mean(0) - result.means).abs() < 5 * (var / n).sqrt()).all()
    assert ((flat.var(0) - var).abs() < 5 * var * (2 / (n - 1)) ** 0.5).all()
    expected = {"ep": "EPSmoother", "rts": "RTS smoother", "kalman": "Kalman filter", "urtss": "Gaussian smoother"}[kind]
    assert idata.attrs["method"] == expected
    assert idata.attrs["log_evidence"] == pytest.approx(float(ssm.log_evidence(ys)), abs=1e-6)  # exact on a linear model
    if kind == "ep":
        assert idata.attrs["converged"] == 1 and len(idata.attrs["ep_changes"]) == len(result.history)
    summary = az.summary(idata, var_names=["x"], kind="stats")
    assert len(summary) == 24


def test_gaussian_result_errors_name_the_problem():
    from pyro_smc.infer import GaussianSmootherResult

    ssm, ys = _gaussian_problem()
    with pytest.raises(ValueError, match="multiple of num_chains"):
        to_inference_data(ssm.rts_smoother(ys), num_draws=10, num_chains=3)
    covs = torch.eye(2).repeat(4, 1, 1)
    covs[2, 1, 1] = -1.0
    with pytest.raises(ValueError, match="time step 2"):
        to_inference_data(GaussianSmootherResult(torch.zeros(4, 2), covs))
