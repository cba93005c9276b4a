"""pyro_smc.plotting draws what the results hold (checked on the artists' data)."""

import matplotlib
import numpy as np
import pytest
import torch

from pyro_smc import SMC, EPSmoother
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.plotting import plot_ep_iterations, plot_ess, plot_means

matplotlib.use("Agg")


@pytest.fixture
def run():
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.8 * eye, 0.3 * eye, eye, 0.5 * eye, torch.zeros(2), eye)
    xs, ys = ssm.simulate(20)
    smc = SMC(ssm, num_particles=200, num_filters=3, store_history=True).run(ys)
    yield ssm, xs, ys, smc
    import matplotlib.pyplot as plt

    plt.close("all")


def test_smc_means_and_band_are_the_runs(run):
    ssm, xs, ys, smc = run
    ax = plot_means(smc, truth=xs, dim=1, filter=2, level=0.8)
    mean, truth = ax.lines[0], ax.lines[1]
    np.testing.assert_allclose(mean.get_ydata(), smc.filtering_means["x"][:, 2, 1].numpy())
    np.testing.assert_allclose(truth.get_ydata(), xs[:, 1].numpy())
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    q = smc.filtering_quantiles([0.1, 0.9])[:, :, 2, 1]
    assert np.isclose(band.min(), float(q[0].min())) and np.isclose(band.max(), float(q[1].max()))


def test_gaussian_band_is_mean_plus_minus_z_sd(run):
    ssm, xs, ys, _ = run
    kf = ssm.kalman_filter(ys)
    ax = plot_means(kf, level=0.9)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    sd = kf.covariances[:, 0, 0].sqrt()
    assert np.isclose(band.max(), float((kf.means[:, 0] + 1.6448536 * sd).max()), atol=1e-6)
    assert np.isclose(band.min(), float((kf.means[:, 0] - 1.6448536 * sd).min()), atol=1e-6)


def test_smoothed_trajectories_band_from_their_quantiles(run):
    _, _, _, smc = run
    paths = smc.smooth(50)
    ax = plot_means(paths, level=0.5)
    np.testing.assert_allclose(ax.lines[0].get_ydata(), paths["x"][:, :, 0, 0].mean(0).numpy())


def test_without_history_there_is_no_band(run):
    ssm, _, ys, _ = run
    ax = plot_means(SMC(ssm, num_particles=50).run(ys))
    assert len(ax.collections) == 0 and len(ax.lines) == 1


def test_ess_marks_the_resampling_steps(run):
    _, _, _, smc = run
    ax = plot_ess(smc, filters=[1])
    np.testing.assert_allclose(ax.lines[0].get_ydata(), (smc.ess_history[:, 1] / 200).numpy())
    np.testing.assert_array_equal(ax.lines[1].get_xdata(), smc.resampled[:, 1].nonzero().flatten().numpy())


def test_ep_iterations_leave_out_the_first_sweep(run):
    ssm, _, ys, _ = run
    result = EPSmoother(ssm, tol=1e-10, max_iter=5).smooth(ys)
    ax = plot_ep_iterations(result, tol=1e-10)
    assert len(ax.lines[0].get_xdata()) == len(result.history) - 1


def test_wrong_inputs_are_named(run):
    ssm, _, ys, smc = run
    with pytest.raises(TypeError, match="plot_means takes"):
        plot_means(ys)
    with pytest.raises(ValueError, match="level"):
        plot_means(smc, level=1.0)
    with pytest.raises(ValueError, match="dim=5"):
        plot_means(smc, dim=5)
    with pytest.raises(ValueError, match="filter=7"):
        plot_means(smc, filter=7)
    with pytest.raises(ValueError, match="history"):
        plot_ep_iterations(ssm.rts_smoother(ys))
    with pytest.raises(TypeError, match="plot_ess takes"):
        plot_ess(ssm.rts_smoother(ys))


def test_the_axis_names_the_state_key_plotted(run):
    """The y-axis named ``x[dim]`` whenever ``key`` was left to its default, whatever the only
    state key was called."""
    import pyro
    import pyro.distributions as dist

    class Walk:
        def init(self, state):
            pass

        def step(self, state, y=None):
            state["level"] = pyro.sample("level", dist.Normal(state.get("level", torch.zeros(())), 1.0))
            pyro.sample("y", dist.Normal(state["level"], 1.0), obs=y)

    smc = SMC(Walk(), num_particles=50).run(torch.randn(5))
    assert plot_means(smc).get_ylabel() == "level[0]"
    assert plot_means(run[3], dim=1).get_ylabel() == "x[1]"
