"""KernelRidgeRegressor: convergence in N, the median heuristic, constant targets, the dense closed form."""

import numpy as np
import pytest
import torch

from pyro_smc.regression import KernelRidgeRegressor
from tests.regression.cases import F64, _gen


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
