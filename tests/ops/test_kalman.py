import pyro.distributions as dist
import pytest
import torch

from pyro_smc.ops.kalman import kalman_filter, rts_smoother


def _random_model(d, dy, seed):
    g = torch.Generator().manual_seed(seed)
    A = 0.9 * torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    def spd(n):
        m = torch.randn(n, n, generator=g)
        return m @ m.T / n + 0.3 * torch.eye(n)
    C = torch.randn(dy, d, generator=g)
    return A, spd(d), C, spd(dy), torch.randn(d, generator=g), spd(d), g


def _dense_joint(A, Q, C, R, m0, P0, T):
    """Mean and covariance of (x_1..x_T, y_1..y_T) by brute-force linear algebra."""
    d = A.shape[0]
    # x = M (x_1-noise, w_2.., w_T) stacked; build the linear map from independent noises.
    Lx = torch.zeros(T * d, T * d)
    mean_x = torch.zeros(T * d)
    blocks_cov = torch.block_diag(P0, *[Q] * (T - 1))
    for t in range(T):
        for s in range(t + 1):
            Lx[t * d : (t + 1) * d, s * d : (s + 1) * d] = torch.linalg.matrix_power(A, t - s)
        mean_x[t * d : (t + 1) * d] = torch.linalg.matrix_power(A, t) @ m0
    cov_x = Lx @ blocks_cov @ Lx.T
    Cb = torch.block_diag(*[C] * T)
    cov_y = Cb @ cov_x @ Cb.T + torch.block_diag(*[R] * T)
    return mean_x, cov_x, Cb @ mean_x, cov_y, Cb @ cov_x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_and_smoother_match_dense_gaussian(seed):
    d, dy, T = 3, 2, 6
    A, Q, C, R, m0, P0, g = _random_model(d, dy, seed)
    ys = torch.randn(T, dy, generator=g)
    mx, Sx, my, Sy, Syx = _dense_joint(A, Q, C, R, m0, P0, T)
    out = kalman_filter(ys, A, Q, C, R, m0, P0)
    # Exact log evidence.
    exact = dist.MultivariateNormal(my, Sy).log_prob(ys.reshape(-1))
    assert torch.allclose(out.log_likelihoods.sum(), exact, rtol=1e-10)
    # Smoother = conditional of x on all y.
    K = torch.linalg.solve(Sy, Syx).T
    post_mean = mx + K @ (ys.reshape(-1) - my)
    post_cov = Sx - K @ Syx
    sm = rts_smoother(out, A)
    assert torch.allclose(sm.means.reshape(-1), post_mean, atol=1e-9)
    for t in range(T):
        assert torch.allclose(sm.covariances[t], post_cov[t * d : (t + 1) * d, t * d : (t + 1) * d], atol=1e-9)
    # Filter at t = conditional on y_{1:t}: the last filtered state equals the smoothed one, and
    # each filtered mean equals a dense conditional on the prefix.
    for t in range(T):
        k = (t + 1) * dy
        Kt = torch.linalg.solve(Sy[:k, :k], Syx[:k, t * d : (t + 1) * d]).T
        mean_t = mx[t * d : (t + 1) * d] + Kt @ (ys.reshape(-1)[:k] - my[:k])
        assert torch.allclose(out.means[t], mean_t, atol=1e-9)


def test_log_evidence_matches_pyro_gaussian_hmm():
    # Pyro's GaussianHMM starts from a state before the first transition: x_1 = A x_0 + w with
    # x_0 ~ N(mu, S). Choose our prior of x_1 to be that distribution.
    d, dy, T = 2, 2, 20
    A, Q, C, R, _, _, g = _random_model(d, dy, 7)
    mu, S = torch.randn(d, generator=g), torch.eye(d)
    m0, P0 = A @ mu, A @ S @ A.T + Q
    ys = torch.randn(T, dy, generator=g)
    hmm = dist.GaussianHMM(
        dist.MultivariateNormal(mu, S), A.T, dist.MultivariateNormal(torch.zeros(d), Q), C.T, dist.MultivariateNormal(torch.zeros(dy), R)
    )
    ours = kalman_filter(ys, A, Q, C, R, m0, P0).log_likelihoods.sum()
    assert torch.allclose(ours, hmm.log_prob(ys), rtol=1e-10)
