"""QuadraticRegressor: exact recovery of quadratics (float64 and float32), analytic gradients, batch shapes."""

import torch

from pyro_smc.regression import QuadraticRegressor
from tests.regression.cases import F64, _gen, _random_quadratic, _rel_err


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
