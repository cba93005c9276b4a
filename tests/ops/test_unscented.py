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


def test_cached_weights_are_not_shared_and_survive_inference_mode():
    m, P = torch.zeros(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    with torch.inference_mode():
        unscented_moments(torch.sin, m, P, kappa=0.5)  # first use of this setting builds the cache here
    m = m.clone().requires_grad_()
    mean, _, _ = unscented_moments(torch.sin, m, P, kappa=0.5)
    mean.sum().backward()
    assert torch.isfinite(m.grad).all()
    _, wm, _ = sigma_points(m.detach(), P, kappa=0.5)
    wm.zero_()
    _, wm2, _ = sigma_points(m.detach(), P, kappa=0.5)
    assert float(wm2.sum()) == pytest.approx(1.0)
