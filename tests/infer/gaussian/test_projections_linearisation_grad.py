"""Linearisation with a gradient: the Jacobian of each step is taken at the detached mean and its
dependence on the mean put back by a custom autograd function (``projections._value_and_jacobian``),
so that a long run is linear in T. Values and gradients against the previous implementation (the
Jacobian through the attached mean) and gradcheck in float64; a second derivative raises
(the mixed term d2J / dtheta dm is not in the graph) rather than be wrong."""

import contextlib

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.infer import extended_kalman_filter, extended_rts_smoother
from pyro_smc.infer.gaussian import projections, recorded
from pyro_smc.models import NonlinearGaussianSSM


def _attached_value_and_jacobian(fn, mean, t):
    """The previous implementation: the copies m + z_i from the attached mean."""
    mu = fn(mean, t)
    create_graph = torch.is_grad_enabled() and mu.requires_grad
    with torch.enable_grad():
        z = mean.new_zeros(mean.shape[:-1] + (mu.shape[-1], mean.shape[-1]), requires_grad=True)
        copies = fn((mean if create_graph else mean.detach()).unsqueeze(-2) + z, t)
        total = copies.diagonal(dim1=-2, dim2=-1).sum()
        (J,) = torch.autograd.grad(total, z, grad_outputs=torch.ones_like(total), create_graph=create_graph)
    return mu, J


@contextlib.contextmanager
def _attached(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(projections, "_value_and_jacobian", _attached_value_and_jacobian)
        patch.setattr(recorded, "_value_and_jacobian", _attached_value_and_jacobian)
        yield


def _model(a, b, m0):
    """2-d state, both maps nonlinear and depending on parameters; 2-d observation."""
    q = torch.tensor([[0.3, 0.05], [0.05, 0.2]])

    def transition(x):
        return torch.stack([a * x[..., 0] + 0.5 * torch.sin(x[..., 1]), 0.9 * x[..., 1] + b * torch.tanh(x[..., 0])], -1)

    def observation(x):
        return torch.stack([x[..., 0] + 0.1 * x[..., 1] ** 2, b * torch.sin(x[..., 1])], -1)

    return NonlinearGaussianSSM(transition, q, observation, 0.2 * torch.eye(2), m0, torch.eye(2))


def _params():
    return [torch.tensor(0.8, requires_grad=True), torch.tensor(0.6, requires_grad=True), torch.tensor([0.3, -0.2], requires_grad=True)]


def _data(T, seed=0):
    with torch.no_grad():
        _, ys = _model(*_params()).simulate(T, generator=torch.Generator().manual_seed(seed))
    ys[2] = float("nan")
    ys[4, 1] = float("nan")
    return ys


def _outputs(run, ys, params):
    w = torch.linspace(-1, 1, ys.shape[0])
    out = run(_model(*params), ys)
    return out.log_evidence + (w[:, None] * out.means).sum() + 0.3 * out.covariances.sum()


RUNS = {
    "ERTSS": extended_rts_smoother,
    "EKF": extended_kalman_filter,
    "EP sequential": lambda ssm, ys: EPSmoother(ssm, projection="linearization", max_iter=40, tol=1e-11).smooth(ys),
    "EP parallel": lambda ssm, ys: EPSmoother(ssm, projection="linearization", max_iter=60, tol=1e-11, schedule="parallel").smooth(ys),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_values_and_gradients_equal_the_attached_jacobian(name, monkeypatch):
    ys, params = _data(12), _params()
    new = _outputs(RUNS[name], ys, params)
    g_new = torch.autograd.grad(new, params)
    with _attached(monkeypatch):
        old = _outputs(RUNS[name], ys, params)
        g_old = torch.autograd.grad(old, params)
    assert torch.allclose(new, old, atol=1e-12, rtol=1e-12)
    for a, b in zip(g_new, g_old):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-10), (name, a, b)
    assert all(bool(g.abs().sum() > 0) for g in g_new)  # every parameter reaches the outputs


def test_gradcheck_of_the_smoother_and_no_silent_second_derivative():
    ys = _data(5)
    f = lambda a, b, m0: _outputs(extended_rts_smoother, ys, [a, b, m0])  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(_params()))
    params = _params()
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(f(*params), params, create_graph=True)


def test_jacobian_gradient_in_the_mean_and_the_parameter():
    """``J(m, a)`` of one map: its first derivatives in ``m`` and ``a`` by gradcheck."""

    def jacobian(m, a):
        _, J = projections._value_and_jacobian(lambda x, t: torch.stack([a * torch.sin(x[..., 0] * x[..., 1]), x[..., 1] ** 3 * a], -1), m, 0)
        return J

    m, a = torch.tensor([0.4, -0.7], requires_grad=True), torch.tensor(1.3, requires_grad=True)
    assert torch.autograd.gradcheck(jacobian, (m, a))


def test_a_linear_map_with_a_parameter_in_the_covariances_only():
    """A linear map's Jacobian is a constant: differentiating the evidence in Q alone raised
    'element 0 of tensors does not require grad'. It now equals the Kalman filter's gradient."""
    from pyro_smc.infer import extended_kalman_filter
    from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM

    s = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(1, dtype=torch.float64)
    ys = torch.randn(10, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ssm = NonlinearGaussianSSM(lambda x: 0.9 * x, torch.exp(s) * eye, lambda x: 2 * x, eye, torch.zeros(1, dtype=torch.float64), eye)
    (grad,) = torch.autograd.grad(extended_kalman_filter(ssm, ys).log_evidence, s)
    exact = LinearGaussianSSM(0.9 * eye, torch.exp(s) * eye, 2 * eye, eye, torch.zeros(1, dtype=torch.float64), eye)
    (expected,) = torch.autograd.grad(exact.log_evidence(ys), s)
    assert torch.allclose(grad, expected)
