"""Value/score-function regressors: exactness, closed forms, gradients, detachment, checkpoints, validation."""

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.regression import KernelRidgeRegressor, MLPRegressor, QuadraticRegressor, Regressor, make_regressor
from tests.property_cases import BUG, F32, FLOAT_DTYPES, PROPERTY, SEEDS, gen

SEED = 0
F64 = torch.float64

# Small, fast settings per regressor, used wherever the test is about the interface rather than accuracy.
FAST = {
    "quadratic": {},
    "kernel": {},
    "mlp": {"hidden_dims": (16, 16), "num_steps": 30},
}


def _gen(offset=0):
    return torch.Generator().manual_seed(SEED + offset)


def _random_quadratic(d, k, g, dtype=F64):
    """``y_j(x) = x^T A_j x + b_j^T x + c_j`` with its gradient ``(A_j + A_j^T) x + b_j``."""
    A = torch.randn(k, d, d, generator=g, dtype=dtype)
    b = torch.randn(k, d, generator=g, dtype=dtype)
    c = torch.randn(k, generator=g, dtype=dtype)

    def f(x):
        return torch.einsum("ni,kij,nj->nk", x, A, x) + x @ b.T + c

    def grad(x):  # (n, k, d)
        return torch.einsum("kij,nj->nki", A + A.transpose(-1, -2), x) + b

    return f, grad


def _regressor(name, **kwargs):
    if name == "mlp":
        kwargs.setdefault("generator", _gen(99))
    return make_regressor(name, **{**FAST[name], **kwargs})


def _state_tensors(state):
    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _rel_err(pred, truth):
    return float((pred - truth).norm() / truth.norm())


# ----------------------------------------------------------------------------------------------- quadratic


def test_quadratic_exact_recovery_vector_valued_float64():
    g = _gen()
    d, k = 4, 3
    f, _ = _random_quadratic(d, k, g)
    x = 2 * torch.randn(200, d, generator=g, dtype=F64) + 1
    x_test = 3 * torch.randn(50, d, generator=g, dtype=F64)
    reg = QuadraticRegressor().fit(x, f(x))
    assert reg(x_test).shape == (50, k)
    # The default relative ridge 1e-8 biases the fit at that level; ridge = 0 is exact to rounding.
    assert _rel_err(reg(x_test), f(x_test)) < 1e-7
    assert _rel_err(QuadraticRegressor(ridge=0.0).fit(x, f(x))(x_test), f(x_test)) < 1e-10


def test_quadratic_float32():
    g = _gen()
    f, _ = _random_quadratic(3, 2, g, dtype=torch.float32)
    x = torch.randn(300, 3, generator=g, dtype=torch.float32)
    x_test = torch.randn(40, 3, generator=g, dtype=torch.float32)
    pred = QuadraticRegressor().fit(x, f(x))(x_test)
    assert pred.dtype == torch.float32
    assert _rel_err(pred, f(x_test)) < 1e-4


def test_quadratic_gradient_matches_analytic():
    g = _gen()
    d, k = 3, 3
    f, grad = _random_quadratic(d, k, g)
    x = torch.randn(150, d, generator=g, dtype=F64)
    reg = QuadraticRegressor().fit(x, f(x))
    x_test = torch.randn(7, d, generator=g, dtype=F64, requires_grad=True)
    pred = reg(x_test)
    # Each output of sample n depends on x_test[n] only, so summing over n gives per-sample gradients.
    jac = torch.stack([torch.autograd.grad(pred[:, j].sum(), x_test, retain_graph=True)[0] for j in range(k)], 1)
    expected = grad(x_test.detach())
    torch.testing.assert_close(jac, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


def test_quadratic_scalar_targets_and_batch_shapes():
    g = _gen()
    x = torch.randn(100, 2, generator=g, dtype=F64)
    reg = QuadraticRegressor().fit(x, (x**2).sum(-1))
    x_new = torch.randn(4, 5, 2, generator=g, dtype=F64)
    assert reg(x_new).shape == (4, 5)
    torch.testing.assert_close(reg(x_new), (x_new**2).sum(-1), rtol=1e-6, atol=1e-6)
    assert reg(x_new[0, 0]).shape == ()


@pytest.mark.parametrize("name", ["quadratic", "kernel", "mlp"])
def test_gradcheck_in_x(name):
    g = _gen()
    x = torch.randn(40, 2, generator=g, dtype=F64)
    y = torch.stack([x[:, 0].sin(), x[:, 1] * x[:, 0]], -1)
    reg = _regressor(name).fit(x, y)
    x_test = torch.randn(5, 2, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(reg, (x_test,))


# ----------------------------------------------------------------------------------------------- kernel ridge


def test_kernel_interpolates_smooth_function_error_decreases_with_n():
    g = _gen()

    def f(x):
        return x[:, 0].sin() + 0.5 * x[:, 1].cos()

    def rmse(reg):
        return float((reg(x_test) - f(x_test)).pow(2).mean().sqrt())

    x_test = 2 * torch.rand(200, 2, generator=g, dtype=F64) - 1
    errors = []
    for n in (25, 100, 400):
        x = 4 * torch.rand(n, 2, generator=g, dtype=F64) - 2
        # A fixed bandwidth isolates the effect of N (the median heuristic hardly moves with N here).
        errors.append(rmse(KernelRidgeRegressor(bandwidth=1.0, ridge=1e-10).fit(x, f(x))))
    assert errors[-1] < 1e-4, errors
    assert errors[0] > 2 * errors[1] > 4 * errors[2], errors
    assert rmse(KernelRidgeRegressor(ridge=1e-10).fit(x, f(x))) < 1e-4


@pytest.mark.parametrize("n", [40, 51])  # an even and an odd number of pairs
def test_kernel_median_heuristic(n):
    x = torch.randn(n, 3, generator=_gen(), dtype=F64)
    reg = KernelRidgeRegressor().fit(x, x[:, 0])
    expected = np.median(torch.pdist(x).numpy())
    assert abs(float(reg.fitted_bandwidth) - expected) < 1e-12 * expected
    # Recomputed at each fit.
    reg.fit(3 * x, x[:, 0])
    assert abs(float(reg.fitted_bandwidth) - 3 * expected) < 1e-12 * expected


def test_kernel_constant_target_predicted_exactly():
    g = _gen()
    x = torch.randn(30, 2, generator=g, dtype=F64)
    y = torch.tensor([3.7, -1.25], dtype=F64).expand(30, 2)
    pred = KernelRidgeRegressor(ridge=1e-4).fit(x, y)(5 * torch.randn(10, 2, generator=g, dtype=F64))
    torch.testing.assert_close(pred, y[:10], rtol=0, atol=1e-14)


@pytest.mark.parametrize("bandwidth", [None, 0.7])
def test_kernel_matches_dense_closed_form(bandwidth):
    g = _gen()
    n, lam = 60, 1e-2
    x = torch.randn(n, 3, generator=g, dtype=F64)
    y = torch.stack([x.sin().sum(-1), x[:, 0] * x[:, 1]], -1)
    x_test = torch.randn(15, 3, generator=g, dtype=F64)
    reg = KernelRidgeRegressor(bandwidth=bandwidth, ridge=lam).fit(x, y)

    h = float(np.median(torch.pdist(x).numpy())) if bandwidth is None else bandwidth

    def kernel(a, b):
        return torch.exp(-((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / (2 * h**2))

    y_mean = y.mean(0)
    alpha = torch.linalg.solve(kernel(x, x) + n * lam * torch.eye(n, dtype=F64), y - y_mean)
    torch.testing.assert_close(reg(x_test), y_mean + kernel(x_test, x) @ alpha, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------- MLP


def _smooth_2d(x):
    return x[:, 0].sin() * x[:, 1].cos() + 0.3 * x[:, 0]


def test_mlp_fits_smooth_2d_function():
    g = _gen()
    x = 2 * torch.rand(256, 2, generator=g, dtype=torch.float32) - 1
    x_test = 1.8 * torch.rand(200, 2, generator=g, dtype=torch.float32) - 0.9
    reg = MLPRegressor(hidden_dims=(32, 32), num_steps=300, generator=_gen(1)).fit(x, _smooth_2d(x))
    pred = reg(x_test)
    assert pred.shape == (200,) and pred.dtype == torch.float32
    assert float((pred - _smooth_2d(x_test)).pow(2).mean().sqrt() / _smooth_2d(x_test).std()) < 0.1


def test_mlp_warm_start_and_determinism():
    g = _gen()
    x = 2 * torch.rand(128, 2, generator=g, dtype=F64) - 1
    y = _smooth_2d(x)
    reg = MLPRegressor(hidden_dims=(16, 16), num_steps=100, generator=_gen(1)).fit(x, y)
    first = reg.losses.clone()
    reg.fit(x, y)
    fresh = MLPRegressor(hidden_dims=(16, 16), num_steps=100, generator=_gen(2)).fit(x, y)
    assert reg.losses.shape == (100,)
    assert reg.losses[0] < 0.5 * fresh.losses[0]
    assert reg.losses[0] < 2 * first[-1]
    # Same generator seed, same weights; minibatches come from the generator too.
    a = MLPRegressor(hidden_dims=(8,), num_steps=20, batch_size=32, generator=_gen(3)).fit(x, y)
    b = MLPRegressor(hidden_dims=(8,), num_steps=20, batch_size=32, generator=_gen(3)).fit(x, y)
    assert torch.equal(a(x), b(x))


# ----------------------------------------------------------------------------------------------- shared behaviour


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


def test_make_regressor():
    assert isinstance(make_regressor("quadratic"), QuadraticRegressor)
    assert isinstance(make_regressor("kernel", bandwidth=2.0), KernelRidgeRegressor)
    assert make_regressor("kernel", bandwidth=2.0).bandwidth == 2.0
    mlp = make_regressor("mlp", hidden_dims=(8,))
    assert isinstance(mlp, MLPRegressor) and mlp.hidden_dims == (8,)
    assert make_regressor(mlp) is mlp
    assert all(isinstance(make_regressor(n), Regressor) for n in ("quadratic", "kernel", "mlp"))
    with pytest.raises(ValueError, match="spec.*'kernel'.*'mlp'.*'quadratic'"):
        make_regressor("gp")
    with pytest.raises(ValueError, match="kwargs"):
        make_regressor(mlp, num_steps=3)


def test_the_old_import_path_re_exports_the_same_objects():
    import pyro_smc.regression as new
    import pyro_smc.regression as old

    assert all(getattr(old, name) is getattr(new, name) for name in new.__all__)
    assert old.__all__ == new.__all__


# =================================================================================================
# QuadraticRegressor properties (hypothesis): exact on quadratics, invalid data and ridge
# =================================================================================================
@PROPERTY
@given(
    d=st.integers(1, 4),
    k=st.integers(0, 3),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    loc=st.sampled_from([0.0, 3.0, 100.0]),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    extra=st.integers(0, 40),
)
def test_quadratic_regressor_is_exact_on_quadratics(d, k, dtype, seed, loc, scale, extra):
    """Targets y = z^T A z + b^T z + c with z = (x - loc) / scale: the quadratic features span them,
    so the least-squares fit reproduces them everywhere (float64 with ridge 0: to rounding; float32
    with the default relative ridge 1e-8: to 1e-3 relative). ``k = 0`` means vector targets (N,)."""
    g = gen(seed)
    outputs = max(k, 1)
    A = torch.randn(outputs, d, d, generator=g, dtype=F64)
    b = torch.randn(outputs, d, generator=g, dtype=F64)
    c = torch.randn(outputs, generator=g, dtype=F64)

    def f(x):
        z = (x.double() - loc) / scale
        y = torch.einsum("ni,kij,nj->nk", z, A, z) + z @ b.T + c
        return y if k else y[:, 0]

    features = 1 + d + d * (d + 1) // 2
    x = (loc + scale * torch.randn(2 * features + extra, d, generator=g, dtype=F64)).to(dtype)
    x_new = (loc + scale * torch.randn(20, d, generator=g, dtype=F64)).to(dtype)
    reg = QuadraticRegressor(ridge=0.0 if dtype == F64 else 1e-8).fit(x, f(x).to(dtype))
    pred = reg(x_new)
    assert pred.dtype == dtype and pred.shape == ((20, k) if k else (20,))
    truth = f(x_new)
    assert float((pred.double() - truth).norm() / truth.norm()) < (1e-3 if dtype == F32 else 1e-8)


INVALID_FITS = ["nan_input", "inf_input", "nan_target", "inf_target", "rows_mismatch", "one_row", "input_1d", "input_3d", "integer_input", "target_3d"]


@PROPERTY
@given(n=st.integers(2, 30), d=st.integers(1, 4), dtype=FLOAT_DTYPES, seed=SEEDS, kind=st.sampled_from(INVALID_FITS))
def test_quadratic_regressor_rejects_invalid_data(n, d, dtype, seed, kind):
    g = gen(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randn(n, generator=g, dtype=dtype)
    i, j = int(torch.randint(n, (), generator=g)), int(torch.randint(d, (), generator=g))
    match = "inputs"
    if kind == "nan_input":
        x[i, j] = math.nan
    elif kind == "inf_input":
        x[i, j] = -math.inf
    elif kind == "nan_target":
        y[i], match = math.nan, "targets"
    elif kind == "inf_target":
        y[i], match = math.inf, "targets"
    elif kind == "rows_mismatch":
        y, match = torch.randn(n + 1 + i, generator=g, dtype=dtype), "targets"
    elif kind == "one_row":
        x, y = x[:1], y[:1]
    elif kind == "input_1d":
        x = x[:, 0]
    elif kind == "input_3d":
        x = x.unsqueeze(0)
    elif kind == "integer_input":
        x = x.round().long()
    elif kind == "target_3d":
        y, match = y.reshape(n, 1, 1), "targets"
    with pytest.raises(ValueError, match=match):
        QuadraticRegressor().fit(x, y)


@PROPERTY
@given(ridge=st.one_of(st.floats(max_value=-1e-300), st.just(math.nan), st.just(math.inf)))
def test_quadratic_regressor_rejects_invalid_ridge(ridge):
    with pytest.raises(ValueError, match="ridge"):
        QuadraticRegressor(ridge=ridge)


# A regression property of a bug the properties found (it failed before its fix).
@BUG
@given(n=st.integers(2, 20), dtype=FLOAT_DTYPES)
def test_quadratic_regressor_rejects_zero_input_columns(n, dtype):
    with pytest.raises(ValueError, match="inputs"):
        QuadraticRegressor().fit(torch.zeros(n, 0, dtype=dtype), torch.zeros(n, dtype=dtype))
