"""The interface every regressor shares: gradients in x, detachment, checkpoints, dtype and device, validation."""

import io

import pytest
import torch

from pyro_smc.regression import KernelRidgeRegressor, MLPRegressor, QuadraticRegressor, make_regressor
from tests.regression.cases import F64, _gen, _regressor, _state_tensors


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_gradcheck_in_x(name):
    g = _gen()
    x = torch.randn(40, 2, generator=g, dtype=F64)
    y = torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 0]], -1)
    reg = _regressor(name).fit(x, y)
    x_test = torch.randn(5, 2, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(reg, (x_test,))


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_stored_tensors_detached(name):
    g = _gen()
    x = torch.randn(50, 3, generator=g, dtype=F64, requires_grad=True)
    y = torch.stack([x.sum(-1), (x**2).sum(-1)], -1)  # has a grad_fn
    reg = _regressor(name).fit(x, y)
    tensors = list(_state_tensors(reg.state_dict()))
    assert tensors
    for t in tensors:
        assert not t.requires_grad and t.grad_fn is None
    # Backpropagating through a prediction reaches x_new only.
    x_new = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True)
    reg(x_new).sum().backward()
    assert x_new.grad is not None and x.grad is None
    assert all(t.grad is None for t in _state_tensors(reg.state_dict()))


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_state_dict_round_trip(name):
    g = _gen()
    x = torch.randn(50, 2, generator=g, dtype=F64)
    kwargs = {"quadratic": {"ridge": 1e-3}, "kernel": {"ridge": 1e-3, "bandwidth": 0.8}, "mlp": {"activation": "silu"}}[name]
    reg = _regressor(name, **kwargs).fit(x, x[:, 0] * x[:, 1])
    buffer = io.BytesIO()
    torch.save(reg.state_dict(), buffer)
    buffer.seek(0)
    restored = make_regressor(name)  # default hyperparameters: the state must carry them
    assert not restored.fitted
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.fitted
    x_test = torch.randn(9, 2, generator=g, dtype=F64)
    assert torch.equal(restored(x_test), reg(x_test))
    with pytest.raises(ValueError, match="state"):
        (QuadraticRegressor() if name != "quadratic" else KernelRidgeRegressor()).load_state_dict(reg.state_dict())


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_a_state_dict_is_a_snapshot(name):
    """Before: the MLP's state dict held its live weights, which the next (warm-started, in-place)
    fit changed: a state taken before a refit restored predictions 54 away from the ones it was
    taken at, and an online filter's checkpoint moved with the run it was taken from."""
    g = _gen()
    x = torch.randn(50, 2, generator=g, dtype=F64)
    reg = _regressor(name).fit(x, x[:, 0] * x[:, 1])
    x_test = torch.randn(9, 2, generator=g, dtype=F64)
    before, state = reg(x_test), reg.state_dict()
    reg.fit(x, 5 + 3 * x[:, 0] - x[:, 1] ** 2)
    restored = make_regressor(name)
    restored.load_state_dict(state)
    assert torch.equal(restored(x_test), before)


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_float32_device_and_constant_size_refits(name, device):
    g = _gen()
    reg = _regressor(name)
    sizes = None
    for step in range(3):
        x = (torch.randn(64, 3, generator=g) + step).to(device=device, dtype=torch.float32)
        reg.fit(x, torch.stack([x.sum(-1), x[:, 0] ** 2], -1))
        current = [t.shape for t in _state_tensors(reg.state_dict())]
        assert sizes is None or current == sizes  # nothing accumulates across fits
        sizes = current
    pred = reg(x[:5])
    assert pred.shape == (5, 2) and pred.dtype == torch.float32 and pred.device == x.device
    assert torch.isfinite(pred).all()


def test_predict_before_fit_raises():
    with pytest.raises(RuntimeError, match="not fitted"):
        QuadraticRegressor()(torch.zeros(3, 2))


@pytest.mark.parametrize(
    "inputs, targets, match",
    [
        (torch.zeros(10), torch.zeros(10), "inputs"),
        (torch.zeros(2, 10, 3), torch.zeros(2), "inputs"),
        (torch.zeros(1, 3), torch.zeros(1), "inputs.*N >= 2"),
        (torch.zeros(10, 3), torch.zeros(9), "targets"),
        (torch.zeros(10, 3), torch.zeros(10, 2, 2), "targets"),
        (torch.full((10, 3), float("nan")), torch.zeros(10), "inputs contain non-finite"),
        (torch.zeros(10, 3), torch.full((10,), float("inf")), "targets contain non-finite"),
    ],
)
@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_fit_validation(name, inputs, targets, match):
    with pytest.raises(ValueError, match=match):
        _regressor(name).fit(inputs, targets)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (QuadraticRegressor, {"ridge": -1.0}, "ridge"),
        (KernelRidgeRegressor, {"ridge": -1e-3}, "ridge"),
        (KernelRidgeRegressor, {"bandwidth": 0.0}, "bandwidth"),
        (KernelRidgeRegressor, {"bandwidth": -2.0}, "bandwidth"),
        (MLPRegressor, {"hidden_dims": ()}, "hidden_dims"),
        (MLPRegressor, {"hidden_dims": (16, 0)}, "hidden_dims"),
        (MLPRegressor, {"hidden_dims": 16}, "hidden_dims"),
        (MLPRegressor, {"activation": "relu6"}, "activation"),
        (MLPRegressor, {"num_steps": 0}, "num_steps"),
        (MLPRegressor, {"lr": 0.0}, "lr"),
        (MLPRegressor, {"batch_size": 0}, "batch_size"),
    ],
)
def test_constructor_validation(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_predict_wrong_dim_raises(name):
    x = torch.randn(20, 3, generator=_gen(), dtype=F64)
    reg = _regressor(name).fit(x, x[:, 0])
    with pytest.raises(ValueError, match="x must have trailing dimension d=3"):
        reg(torch.zeros(5, 2, dtype=F64))
