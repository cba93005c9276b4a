import math

import pytest
import torch

from pyro_smc.ops.gp_moments import se_ard_kernel, se_ard_linearize, se_ard_moments, se_ard_predict
from tests.tolerances import MC_SIGMAS


def _posterior(E, D, n, seed, dtype=torch.float64, groups=None):
    """A random SE-ARD posterior: (X, beta, gram_inv, lengthscale, variance) and the noise.

    ``groups`` (a list of output indices per group) makes those outputs share one lengthscale.
    """
    g = torch.Generator().manual_seed(seed)
    X = 1.5 * torch.randn(n, D, generator=g, dtype=torch.float64)
    lengthscale = 0.6 + torch.rand(E, D, generator=g, dtype=torch.float64)
    for members in groups or []:
        lengthscale[members] = lengthscale[members[0]].clone()
    variance = 0.5 + torch.rand(E, generator=g, dtype=torch.float64)
    noise = 0.05 + 0.1 * torch.rand(E, generator=g, dtype=torch.float64)
    Y = torch.sin(X @ torch.randn(D, E, generator=g, dtype=torch.float64)) + 0.1 * torch.randn(n, E, generator=g, dtype=torch.float64)
    gram = se_ard_kernel(X, X, lengthscale, variance) + noise[:, None, None] * torch.eye(n, dtype=torch.float64)
    L = torch.linalg.cholesky(gram)
    beta = torch.cholesky_solve(Y.T.unsqueeze(-1), L).squeeze(-1)
    post = tuple(t.to(dtype) for t in (X, beta, torch.cholesky_inverse(L), lengthscale, variance))
    return post, noise.to(dtype), g


def _input(D, seed, scale=0.3):
    g = torch.Generator().manual_seed(1000 + seed)
    A = torch.randn(D, D, generator=g)
    return 0.5 * torch.randn(D, generator=g), scale * (A @ A.T / D + 0.2 * torch.eye(D))


def _close(a, b, atol, rtol=0.0):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=atol, rtol=rtol), (a - b).abs().max().item()


@pytest.mark.parametrize("seed, groups", [(0, None), (1, None), (2, None), (3, [[0, 2]])])
def test_moments_match_monte_carlo(seed, groups):
    E, D, n, N = 3, 2, 15, 200_000
    post, noise, g = _posterior(E, D, n, seed, groups=groups)
    mu, S = _input(D, seed)
    M, V, C = se_ard_moments(mu, S, *post)
    x = torch.distributions.MultivariateNormal(mu, S).sample((N,))
    f, v = se_ard_predict(x, *post)  # the GP posterior at each sample: mean and latent variance

    def check(samples, exact):
        # Each entry is an unbiased sample mean of `samples` (exact centring with the closed form).
        err = (samples.mean(0) - exact).abs()
        bound = MC_SIGMAS * samples.std(0) / math.sqrt(N) + 1e-12
        assert (err < bound).all(), (err / bound).max().item()

    check(f, M)
    r = f - M
    check(r.unsqueeze(-1) * r.unsqueeze(-2) + torch.diag_embed(v), V)
    check((x - mu).unsqueeze(-1) * r.unsqueeze(-2), C)
    # The noisy prediction adds the likelihood variance to the diagonal only.
    Mn, Vn, Cn = se_ard_moments(mu, S, *post, noise=noise)
    _close(Vn, V + torch.diag(noise), atol=1e-14)
    _close(Mn, M, atol=0)
    _close(Cn, C, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_stein_identity(seed):
    # d E[f(x)] / d mu = Cov[x, f(x)]^T S^{-1} for Gaussian x.
    E, D, n = 4, 3, 25
    post, _, _ = _posterior(E, D, n, seed)
    mu, S = _input(D, seed)
    _, _, C = se_ard_moments(mu, S, *post)
    J = torch.autograd.functional.jacobian(lambda m: se_ard_moments(m, S, *post)[0], mu)
    _close(J, torch.linalg.solve(S, C).T, atol=1e-8)


def test_mean_heat_equation():
    # d E[f(x)] / d S = 1/2 E[Hessian f] = 1/2 d^2 E[f(x)] / d mu^2 (gradient through the Cholesky).
    E, D, n = 2, 3, 20
    post, _, _ = _posterior(E, D, n, 3)
    mu, S = _input(D, 3)
    for a in range(E):
        dS = torch.autograd.functional.jacobian(lambda s, a=a: se_ard_moments(mu, s, *post)[0][a], S)
        H = torch.autograd.functional.hessian(lambda m, a=a: se_ard_moments(m, S, *post)[0][a], mu)
        _close((dS + dS.T) / 2, H / 2, atol=1e-8)


def test_gradcheck():
    # Gradients of all three moments with respect to the input mean and (a factor of) the covariance.
    E, D, n = 2, 2, 6
    post, noise, _ = _posterior(E, D, n, 4)
    mu, S = _input(D, 4)
    A = torch.linalg.cholesky(S).requires_grad_()

    def moments(m, A):
        return se_ard_moments(m, A @ A.T, *post, noise=noise)

    assert torch.autograd.gradcheck(moments, (mu.requires_grad_(), A))


def test_chunked_equals_unchunked():
    E, D, n = 4, 2, 12
    post, noise, _ = _posterior(E, D, n, 5)
    mu, S = _input(D, 5)
    mu = mu + 0.1 * torch.randn(2, 3, D)  # batch (2, 3), shared covariance
    full = se_ard_moments(mu, S, *post, noise=noise)
    for chunk_size in (1, 50, n * n - 1, 3 * n * (6 * D + 6)):
        for a, b in zip(se_ard_moments(mu, S, *post, noise=noise, chunk_size=chunk_size), full):
            _close(a, b, atol=1e-12, rtol=1e-12)
    x = torch.randn(7, 5, D)
    for a, b in zip(se_ard_linearize(x, *post, chunk_size=1), se_ard_linearize(x, *post)):
        _close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("groups", [[[0, 1, 2, 3, 4]], [[0, 3], [1, 2, 4]], [[1, 4]]])
def test_shared_lengthscales_match_distinct(groups):
    # Outputs with equal lengthscales share their Q blocks; nudging the lengthscales apart by
    # 1e-12 (relative) takes the one-pair-at-a-time path and must give the same moments.
    E, D, n = 6, 2, 14
    post, noise, _ = _posterior(E, D, n, 11, groups=groups)
    X, beta, gram_inv, ell, var = post
    nudged = ell * (1 + 1e-12 * torch.arange(1, E + 1).unsqueeze(-1))
    mu, S = _input(D, 11)
    mu = mu + 0.2 * torch.randn(3, D)
    for chunk_size in (None, 40):
        shared = se_ard_moments(mu, S, X, beta, gram_inv, ell, var, noise=noise, chunk_size=chunk_size)
        distinct = se_ard_moments(mu, S, X, beta, gram_inv, nudged, var, noise=noise)
        for a, b in zip(shared, distinct):
            _close(a, b, atol=1e-9)
        assert torch.equal(shared[1], shared[1].transpose(-1, -2))


@pytest.mark.parametrize("groups", [[[0, 1, 2]], [[0, 2]]])
def test_gradcheck_in_shared_lengthscales(groups):
    """Before: outputs with equal lengthscales (every output of a default ``MultiOutputGP``) shared
    one Q built from the first member's lengthscale, so the gradient of each member's terms went
    to that member: d V_11 / d log l was (-0.77, 0.78) where finite differences give (0, 0.0047),
    and every hyperparameter fit through the GP smoothers' evidence started from it."""
    E, D, n = 3, 2, 6
    post, noise, _ = _posterior(E, D, n, 7, groups=groups)
    X, beta, gram_inv, ell, var = post
    mu, S = _input(D, 7)

    def moments(ell):
        return se_ard_moments(mu, S, X, beta, gram_inv, ell, var, noise=noise)

    assert torch.autograd.gradcheck(moments, (ell.clone().requires_grad_(),))


def test_batched_matches_loop():
    E, D, n = 3, 2, 10
    post, _, _ = _posterior(E, D, n, 6)
    g = torch.Generator().manual_seed(6)
    mus = torch.randn(4, D, generator=g)
    A = torch.randn(4, D, D, generator=g)
    covs = 0.2 * A @ A.transpose(-1, -2) + 0.1 * torch.eye(D)
    M, V, C = se_ard_moments(mus, covs, *post)
    assert M.shape == (4, E) and V.shape == (4, E, E) and C.shape == (4, D, E)
    for i in range(4):
        Mi, Vi, Ci = se_ard_moments(mus[i], covs[i], *post)
        _close(M[i], Mi, atol=1e-13)
        _close(V[i], Vi, atol=1e-13)
        _close(C[i], Ci, atol=1e-13)
    # Output covariance is symmetric and positive semi-definite.
    assert torch.equal(V, V.transpose(-1, -2))
    assert (torch.linalg.eigvalsh(V) > -1e-12).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_degenerate_input_reduces_to_predict(seed):
    E, D, n = 3, 3, 20
    post, noise, _ = _posterior(E, D, n, seed)
    mu, _ = _input(D, seed)
    M, V, C = se_ard_moments(mu, 1e-12 * torch.eye(D), *post, noise=noise)
    m, v = se_ard_predict(mu, *post, noise=noise)
    _close(M, m, atol=1e-9)
    _close(V, torch.diag(v), atol=1e-8)
    _close(C, torch.zeros(D, E), atol=1e-10)
    # An exactly singular (zero) covariance is allowed too.
    M0, V0, C0 = se_ard_moments(mu, torch.zeros(D, D), *post)
    _close(M0, m, atol=1e-12)
    _close(V0, torch.diag(v - noise), atol=1e-10)
    assert torch.equal(C0, torch.zeros(D, E))


def test_predict_matches_dense_formulas():
    E, D, n = 3, 2, 15
    post, noise, g = _posterior(E, D, n, 8)
    X, beta, _, ell, var = post
    x = torch.randn(4, 6, D, generator=g)
    mean, v = se_ard_predict(x, *post)
    assert mean.shape == v.shape == (4, 6, E)
    for a in range(E):
        diff = (x.reshape(-1, 1, D) - X) / ell[a]
        k = var[a] * torch.exp(-0.5 * (diff * diff).sum(-1))  # (24, n)
        gram = var[a] * torch.exp(-0.5 * (((X[:, None] - X) / ell[a]) ** 2).sum(-1)) + noise[a] * torch.eye(n)
        _close(mean[..., a].reshape(-1), k @ beta[a], atol=1e-12)
        _close(v[..., a].reshape(-1), var[a] - (k * torch.linalg.solve(gram, k.T).T).sum(-1), atol=1e-10)


def test_linearize_matches_autograd():
    E, D, n = 3, 3, 18
    post, noise, g = _posterior(E, D, n, 9)
    x = torch.randn(5, D, generator=g)
    mean, jac, var = se_ard_linearize(x, *post, noise=noise)
    m, v = se_ard_predict(x, *post, noise=noise)
    _close(mean, m, atol=1e-13)
    _close(var, v, atol=1e-13)
    for i in range(5):
        J = torch.autograd.functional.jacobian(lambda z: se_ard_predict(z, *post)[0], x[i])
        _close(jac[i], J, atol=1e-10)


def test_float32_agrees_with_float64():
    E, D, n = 3, 2, 20
    post64, _, _ = _posterior(E, D, n, 10)
    post32, _, _ = _posterior(E, D, n, 10, dtype=torch.float32)
    mu, S = _input(D, 10)
    out32 = se_ard_moments(mu.float(), S.float(), *post32)
    for a, b in zip(out32, se_ard_moments(mu, S, *post64)):
        assert a.dtype == torch.float32
        _close(a.double(), b, atol=1e-3, rtol=1e-3)
    m32, v32 = se_ard_predict(mu.float(), *post32)
    assert m32.dtype == v32.dtype == torch.float32
