"""Every model satisfies the state-space-model protocol(s) that make sense for it, and every
Gaussian engine takes every Gaussian model as it is."""

import pytest
import torch

from pyro_smc import SMC, EPSmoother
from pyro_smc.infer import gaussian_filter, gaussian_smoother
from pyro_smc.models import ChaoticRNN, DiagonalLinearGaussianSSM, GaussianStateSpaceModel, LinearGaussianSSM, Lorenz96SSM, NonlinearGaussianSSM, StateSpaceModel, time_dependent
from tests.cases import assert_same_marginals

PROJECTIONS = ["linearization", "unscented", "moment_matching"]


def _linear(seed=0, d=3, e=2):
    g = torch.Generator().manual_seed(seed)
    A = 0.3 * torch.randn(d, d, generator=g) + 0.5 * torch.eye(d)
    return LinearGaussianSSM(A, 0.5 * torch.eye(d), torch.randn(e, d, generator=g), 0.2 * torch.eye(e), torch.randn(d, generator=g), torch.eye(d))


def _diagonal():
    return DiagonalLinearGaussianSSM(torch.tensor([0.9, -0.5]), torch.tensor([1.0, 2.0]), 0.5, 0.3, init_scale=1.5)


def _nonlinear():
    one = torch.ones(1, 1)
    return NonlinearGaussianSSM(lambda x: torch.sin(x), 0.1 * one, time_dependent(lambda x, t: x**2 / 20 + t), one, torch.zeros(1), one)


MODELS = {
    "linear": _linear,
    "diagonal": _diagonal,
    "nonlinear": _nonlinear,
    "chaotic_rnn": lambda: ChaoticRNN(3, generator=torch.Generator().manual_seed(0)),
    "chaotic_rnn_surrogate": lambda: ChaoticRNN(3, generator=torch.Generator().manual_seed(0)).as_nonlinear_gaussian(),
    "lorenz96": lambda: Lorenz96SSM(6),
}
GAUSSIAN = ["linear", "diagonal", "nonlinear", "chaotic_rnn_surrogate", "lorenz96"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_is_a_state_space_model(name):
    model = MODELS[name]()
    assert isinstance(model, StateSpaceModel)
    assert isinstance(model, GaussianStateSpaceModel) == (name in GAUSSIAN)
    xs, ys = model.simulate(7, generator=torch.Generator().manual_seed(1))
    assert xs.shape == (7, model.state_dim) and ys.shape == (7, model.obs_dim)


def test_other_objects_are_not_models():
    assert not isinstance(object(), StateSpaceModel)
    assert not isinstance(lambda x: x, GaussianStateSpaceModel)


@pytest.mark.parametrize("name", GAUSSIAN)
def test_gaussian_members_have_the_documented_shapes(name):
    model = MODELS[name]()
    d, e = model.state_dim, model.obs_dim
    assert model.init_mean.shape == (d,) and model.init_cov.shape == (d, d)
    assert model.transition_cov.shape == (d, d) and model.observation_cov.shape == (e, e)
    x = torch.randn(4, d)
    assert model.transition_fn(x, 2).shape == (4, d) and model.observation_fn(x, 2).shape == (4, e)
    mean, var = model.observation_mean_var(x, 2)
    torch.testing.assert_close(mean, model.observation_fn(x, 2))
    assert var is None


def test_nonlinear_model_passes_time_explicitly():
    model = _nonlinear()
    assert not model.transition_takes_time and model.observation_takes_time
    x = torch.ones(1)
    torch.testing.assert_close(model.observation_fn(x, 3), x / 20 + 3)
    torch.testing.assert_close(model.transition_fn(x, 3), torch.sin(x))


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("name", ["linear", "diagonal"])
def test_linear_models_go_straight_into_every_gaussian_engine(name, projection):
    model = MODELS[name]()
    _, ys = model.simulate(12, generator=torch.Generator().manual_seed(2))
    lin = model if name == "linear" else model.as_linear_gaussian()
    kf, rts = lin.kalman_filter(ys), lin.rts_smoother(ys)
    filt = gaussian_filter(model, ys, projection)
    assert_same_marginals(filt, kf)
    for out in (gaussian_smoother(model, ys, projection), EPSmoother(model, projection=projection, max_iter=3).smooth(ys)):
        assert_same_marginals(out, rts, evidence=False)


def test_smc_runs_every_model():
    for name in sorted(MODELS):
        model = MODELS[name]()
        _, ys = model.simulate(5, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            smc = SMC(model, num_particles=20).run(ys)
        assert torch.isfinite(smc.log_evidence).all(), name


def test_diagonal_model_keeps_its_gradient_through_the_gaussian_engines():
    model = _diagonal()
    _, ys = model.simulate(6, generator=torch.Generator().manual_seed(4))
    gaussian_filter(model, ys, "linearization").log_evidence.backward()
    assert model.transition_diag.unconstrained().grad is not None
