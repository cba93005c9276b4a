"""ChaoticRNN: the simulator, the Pyro step and the Gaussian surrogate agree."""

import math

import pyro
import pytest
import torch
from pyro import poutine

from pyro_smc import SMC, OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.models import ChaoticRNN


def test_step_log_density_matches_the_equations():
    rnn = ChaoticRNN(generator=torch.Generator().manual_seed(0))
    x_prev, x, y = torch.randn(5), torch.randn(5), torch.randn(5)
    rnn.init({})
    rnn._t = 3
    trace = poutine.trace(poutine.condition(rnn.step, data={"x_3": x})).get_trace({"x": x_prev}, y)
    mean = x_prev + (0.001 / 0.025) * (-x_prev + 2.5 * torch.tanh(x_prev) @ rnn.weight.T)
    log_f = torch.distributions.Normal(mean, 0.1).log_prob(x).sum()
    log_g = torch.distributions.StudentT(2.0, x, 0.1).log_prob(y).sum()
    torch.testing.assert_close(trace.log_prob_sum(), log_f + log_g)


def test_simulate_is_reproducible_and_heavy_tailed():
    rnn = ChaoticRNN(generator=torch.Generator().manual_seed(0))
    xs, ys = rnn.simulate(2000, generator=torch.Generator().manual_seed(1))
    xs2, ys2 = rnn.simulate(2000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(xs, xs2) and torch.equal(ys, ys2)
    noise = (ys - xs).flatten()
    # Median |noise| of a scaled t_2 is r * t_{0.75}(2) = 0.0816; sd of the sample median ~ 1 / (2 f(m) sqrt(n)).
    q75 = 0.1 * 0.5 / math.sqrt(0.375)
    assert abs(float(noise.abs().median()) - q75) < 5 * 0.0035
    assert float(noise.abs().max()) > 20 * q75  # tails far beyond a Gaussian's


def test_filters_beat_the_raw_observations():
    torch.manual_seed(0)
    rnn = ChaoticRNN(generator=torch.Generator().manual_seed(0))
    xs, ys = rnn.simulate(40, generator=torch.Generator().manual_seed(2))
    pf = SMC(rnn, num_particles=500).run(ys).filtering_means["x"].reshape(40, 5)
    pyro.clear_param_store()
    vf = OnlineVariationalFilter(rnn, StreamingFilterGuide(5), num_iterations=10, num_regression_samples=64)
    means = []
    for y in ys:
        means.append(vf.step(y).filtering_distribution().mean)
    rmse = {name: float((m - xs).square().mean().sqrt()) for name, m in (("pf", pf), ("vf", torch.stack(means)), ("raw", ys))}
    assert rmse["pf"] < rmse["raw"] and rmse["vf"] < rmse["raw"], rmse


def test_gaussian_surrogate_and_errors():
    rnn = ChaoticRNN(generator=torch.Generator().manual_seed(0))
    ssm = rnn.as_nonlinear_gaussian()
    sd = 0.1 * (0.5 / math.sqrt(0.375)) / 0.6744897501960817
    torch.testing.assert_close(ssm.observation_cov, sd**2 * torch.eye(5))
    with pytest.raises(ValueError, match="tau"):
        ChaoticRNN(tau=0.0)
    with pytest.raises(ValueError, match="weight"):
        ChaoticRNN(state_dim=3, weight=torch.eye(2))


def test_laplace_start_on_a_student_t_observation():
    """x ~ N(0, 1), y ~ t_2(x, 0.1), y = 2: the exact posterior mean is about 1.9. An unclipped
    Newton step from the prior mean (where log g is convex) once started the filter at 5.7."""
    vf = OnlineVariationalFilter(ChaoticRNN(state_dim=1, generator=torch.Generator().manual_seed(0)), StreamingFilterGuide(1), num_iterations=0)
    vf.step(torch.tensor([2.0]))
    assert 1.5 < float(vf.filtering_distribution().mean) < 2.5


def test_state_dim_and_the_protocols():
    from pyro_smc.models.protocol import GaussianStateSpaceModel, StateSpaceModel

    rnn = ChaoticRNN(3, generator=torch.Generator().manual_seed(0))
    assert rnn.state_dim == rnn.obs_dim == 3
    assert isinstance(rnn, StateSpaceModel) and not isinstance(rnn, GaussianStateSpaceModel)
    assert isinstance(rnn.as_nonlinear_gaussian(), GaussianStateSpaceModel)
    with pytest.raises(TypeError):
        ChaoticRNN(dim=3)  # the removed old name
    assert not hasattr(rnn, "dim")
