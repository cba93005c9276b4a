"""Laplace by clipped Newton and the Gaussian regression kernel, against closed forms."""

import math

import torch

from pyro_smc.ops.laplace import gram_scale_tril, jittered, laplace_newton, regression_kernel


def _spd(d, g):
    a = torch.randn(d, d, generator=g)
    return a @ a.T + d * torch.eye(d)


def test_linear_gaussian_likelihood_gives_the_kalman_update_in_one_step():
    g = torch.Generator().manual_seed(0)
    d, e = 3, 2
    m, P = torch.randn(d, generator=g), _spd(d, g)
    H, R, y = torch.randn(e, d, generator=g), _spd(e, g), torch.randn(e, generator=g)
    R_inv = torch.linalg.inv(R)

    def log_g(x):
        r = y - H @ x
        return -0.5 * r @ R_inv @ r

    loc, cov = laplace_newton(log_g, m, P, max_steps=1)
    S = H @ P @ H.T + R
    K = P @ H.T @ torch.linalg.inv(S)
    torch.testing.assert_close(loc, m + K @ (y - H @ m))
    torch.testing.assert_close(cov, P - K @ S @ K.T)


def test_convex_log_likelihood_far_from_the_data_is_not_a_jump():
    """Student-t(nu=2) likelihood of y = 0 seen from x = 50: log g is convex there, so an unclipped
    Newton step would move away or overshoot; the clipped step climbs the log-posterior, stays
    within the prior's reach and returns the prior precision's inverse (no curvature added)."""
    m, P = torch.tensor([50.0]), torch.tensor([[1.0]])

    def log_g(x):
        return -1.5 * torch.log1p(x.square().sum() / 2)

    def log_post(x):
        return float(log_g(x) - 0.5 * (x - m).square().sum())

    loc, cov = laplace_newton(log_g, m, P)
    assert log_post(loc) >= log_post(m)
    assert 45 < float(loc) < 50
    # The exact posterior mode solves x - 50 = -3x / (2 + x^2): near 49.94.
    x = 50.0
    for _ in range(50):
        x = 50.0 - 3 * x / (2 + x * x)
    assert abs(float(loc) - x) < 1e-4
    assert 0.9 < float(cov) <= 1.0 + 1e-6


def test_regression_kernel_recovers_the_joint_gaussian_conditional():
    g = torch.Generator().manual_seed(1)
    d = 2
    joint = _spd(2 * d, g).double()
    mean = torch.randn(2 * d, generator=g).double()
    z = mean + torch.randn(200_000, 2 * d, generator=g).double() @ torch.linalg.cholesky(joint).T
    x, x_prev = z[:, :d], z[:, d:]
    weight, bias, cov = regression_kernel(x, x_prev)
    s_xx, s_px, s_pp = joint[:d, :d], joint[d:, :d], joint[d:, d:]
    w_exact = s_px @ torch.linalg.inv(s_xx)
    # Sampling error of regression coefficients ~ sd / sqrt(n); 5 sigma with sd <= ~3 here.
    tol = 5 * 3 / math.sqrt(len(z))
    assert (weight - w_exact).abs().max() < tol
    assert (bias - (mean[d:] - w_exact @ mean[:d])).abs().max() < 5 * tol
    assert (cov - (s_pp - w_exact @ s_px.T)).abs().max() < 5 * tol * float(s_pp.abs().max())


def test_jittered_is_symmetric_and_positive_definite():
    c = torch.tensor([[1.0, 1.0], [0.9999, 1.0]])
    out = jittered(c)
    assert torch.equal(out, out.T)
    assert bool((torch.linalg.eigvalsh(out) > 0).all())


def test_gram_scale_tril_is_the_cholesky_factor_of_the_gram_matrix():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(7, 4, generator=g).to(dtype)
        L = gram_scale_tril(a)
        torch.testing.assert_close(L, torch.linalg.cholesky(a.T @ a))
    # rank-deficient: still lower triangular, diagonal >= 0, L L^T = A^T A
    a = torch.randn(5, 3, generator=g, dtype=torch.float64)
    a[:, 2] = a[:, 0] - a[:, 1]
    L = gram_scale_tril(a)
    assert torch.equal(L, L.tril()) and bool((L.diagonal() >= 0).all())
    torch.testing.assert_close(L @ L.T, a.T @ a)
