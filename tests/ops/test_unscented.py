import math

import pytest
import torch

from pyro_smc.ops.unscented import sigma_points, unscented_moments


@pytest.mark.parametrize("d", [1, 2, 5])
def test_exact_for_linear_maps(d):
    g = torch.Generator().manual_seed(d)
    A, b = torch.randn(3, d, generator=g), torch.randn(3, generator=g)
    L = torch.randn(d, d, generator=g)
    m, P = torch.randn(d, generator=g), L @ L.T + torch.eye(d)
    mean, cov, cross = unscented_moments(lambda x: x @ A.T + b, m, P)
    assert torch.allclose(mean, A @ m + b, atol=1e-10)
    assert torch.allclose(cov, A @ P @ A.T, atol=1e-10)
    assert torch.allclose(cross, P @ A.T, atol=1e-10)


def test_weights_sum_to_one_and_points_have_the_moments():
    m, P = torch.tensor([1.0, -2.0]), torch.tensor([[2.0, 0.3], [0.3, 0.5]])
    points, wm, wc = sigma_points(m, P, alpha=0.5, beta=2.0, kappa=1.0)
    assert points.shape == (5, 2) and math.isclose(float(wm.sum()), 1.0)
    assert torch.allclose(wm @ points, m)
    assert torch.allclose(((points - m) * wm.unsqueeze(-1)).T @ (points - m), P)


def test_quadratic_in_one_dimension_is_exact_with_kappa_default():
    # kappa = 3 - d matches the Gaussian kurtosis, so E[x^2] and Var[x^2] are exact.
    m, p = 0.7, 1.3
    mean, cov, cross = unscented_moments(lambda x: x**2, torch.tensor([m]), torch.tensor([[p]]))
    assert math.isclose(float(mean), m**2 + p, rel_tol=1e-12)
    assert math.isclose(float(cov), 4 * m**2 * p + 2 * p**2, rel_tol=1e-12)
    assert math.isclose(float(cross), 2 * m * p, rel_tol=1e-12)
