import pyro.distributions as dist
import pytest
import torch

from pyro_smc.ops.affine_chain import AffineChainResult, affine_chain_smoother, associative_scan
from pyro_smc.ops.kalman import kalman_filter, rts_smoother

D64 = torch.float64


def _spd(n, g, batch=(), scale=0.3):
    m = torch.randn(*batch, n, n, generator=g, dtype=D64)
    return m @ m.mT / n + scale * torch.eye(n, dtype=D64)


def _random_model(T, d, e, seed):
    """Random time-varying affine model and observations drawn from it (float64)."""
    g = torch.Generator().manual_seed(seed)
    F = 0.3 * torch.randn(T - 1, d, d, generator=g, dtype=D64) + 0.7 * torch.eye(d, dtype=D64)
    c = torch.randn(T - 1, d, generator=g, dtype=D64)
    Q, R = _spd(d, g, (T - 1,)), _spd(e, g, (T,))
    H = torch.randn(T, e, d, generator=g, dtype=D64)
    m0, P0 = torch.randn(d, generator=g, dtype=D64), _spd(d, g)
    r = torch.randn(T, e, generator=g, dtype=D64)
    return m0, P0, F, c, Q, H, r, R


def _dense(m0, P0, F, c, Q, H, r, R, observed=None):
    """Smoothed marginals and per-step log-evidence increments by brute-force joint Gaussian algebra."""
    T, e = r.shape
    d = m0.shape[0]
    # x = G z + mu with z = (x_0 - m0, w_0, ..., w_{T-2}) independent, Cov z = blockdiag(P0, Q_t).
    G = torch.zeros(T * d, T * d, dtype=D64)
    mu = torch.zeros(T, d, dtype=D64)
    mu[0] = m0
    for t in range(T):
        G[t * d : (t + 1) * d, t * d : (t + 1) * d] = torch.eye(d, dtype=D64)
        if t > 0:
            mu[t] = F[t - 1] @ mu[t - 1] + c[t - 1]
            G[t * d : (t + 1) * d, : t * d] = F[t - 1] @ G[(t - 1) * d : t * d, : t * d]
    Sx = G @ torch.block_diag(P0, *Q) @ G.T
    Hb = torch.block_diag(*H)
    Sr = Hb @ Sx @ Hb.T + torch.block_diag(*R)
    Sxr, mr = Sx @ Hb.T, Hb @ mu.reshape(-1)
    obs = torch.ones(T, e, dtype=torch.bool) if observed is None else observed
    idx = obs.reshape(-1).nonzero().squeeze(-1)
    rv = r.reshape(-1)
    K = torch.linalg.solve(Sr[idx][:, idx], Sxr[:, idx].T).T
    mean = mu.reshape(-1) + K @ (rv[idx] - mr[idx])
    cov = Sx - K @ Sxr[:, idx].T
    means = mean.reshape(T, d)
    covs = torch.stack([cov[t * d : (t + 1) * d, t * d : (t + 1) * d] for t in range(T)])

    def log_p(upto):  # log p(r_{<upto}) over observed entries
        sel = idx[idx < upto * e]
        if sel.numel() == 0:
            return torch.zeros((), dtype=D64)
        return dist.MultivariateNormal(mr[sel], Sr[sel][:, sel]).log_prob(rv[sel])

    incs = torch.stack([log_p(t + 1) - log_p(t) for t in range(T)])
    return means, covs, incs


def _assert_results_close(a: AffineChainResult, b: AffineChainResult, tol):
    for name, x, y in zip(a._fields, a, b):
        assert torch.allclose(x, y, atol=tol, rtol=0), name


@pytest.mark.parametrize("parallel", [True, False])
def test_time_invariant_matches_kalman(parallel):
    T, d, e = 9, 2, 2
    m0, P0, F, c, Q, H, r, R = _random_model(T, d, e, seed=0)
    A, Qi, C, Ri = F[0], Q[0], H[0], R[0]

    def time_invariant(m0, P0):
        zeros = torch.zeros(T - 1, d, dtype=D64)
        return affine_chain_smoother(m0, P0, A.expand(T - 1, d, d), zeros, Qi.expand(T - 1, d, d), C.expand(T, e, d), r, Ri.expand(T, e, e), parallel=parallel)

    out = time_invariant(m0, P0)
    filt = kalman_filter(r, A, Qi, C, Ri, m0, P0)
    smooth = rts_smoother(filt, A)
    pairs = [
        (out.predicted_means, filt.predicted_means),
        (out.predicted_covariances, filt.predicted_covariances),
        (out.filtering_means, filt.means),
        (out.filtering_covariances, filt.covariances),
        (out.means, smooth.means),
        (out.covariances, smooth.covariances),
        (out.log_evidence_increments, filt.log_evidence_increments),
    ]
    for x, y in pairs:
        assert torch.allclose(x, y, atol=1e-10, rtol=0)
    # Pyro's GaussianHMM starts one transition before the first observation (and multiplies
    # row vectors from the right): pick its initial N(mu, S) and our prior as its push-forward.
    mu, S = torch.randn(d, dtype=D64, generator=torch.Generator().manual_seed(1)), torch.eye(d, dtype=D64)
    m0, P0 = A @ mu, A @ S @ A.T + Qi
    out = time_invariant(m0, P0)
    hmm = dist.GaussianHMM(
        dist.MultivariateNormal(mu, S),
        A.T,
        dist.MultivariateNormal(torch.zeros(d, dtype=D64), Qi),
        C.T,
        dist.MultivariateNormal(torch.zeros(e, dtype=D64), Ri),
    )
    assert torch.allclose(out.log_evidence_increments.sum(), hmm.log_prob(r), atol=1e-9, rtol=0)


@pytest.mark.parametrize("T", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_affine_parallel_matches_sequential_and_dense(T, seed):
    args = _random_model(T, 3, 2, seed)
    par = affine_chain_smoother(*args)
    seq = affine_chain_smoother(*args, parallel=False)
    _assert_results_close(par, seq, 1e-9)
    means, covs, incs = _dense(*args)
    assert torch.allclose(par.means, means, atol=1e-9, rtol=0)
    assert torch.allclose(par.covariances, covs, atol=1e-9, rtol=0)
    assert torch.allclose(par.log_evidence_increments, incs, atol=1e-9, rtol=0)


@pytest.mark.parametrize("seed", [0, 3])
def test_missing_data(seed):
    T, d, e = 23, 3, 3
    m0, P0, F, c, Q, H, r, R = _random_model(T, d, e, seed)
    g = torch.Generator().manual_seed(seed + 100)
    observed = torch.rand(T, e, generator=g) < 0.6
    observed[[0, 4, 5, 22]] = False  # fully missing steps, including the first and the last
    observed[7] = True
    r = torch.where(observed, r, torch.full_like(r, float("nan")))
    par = affine_chain_smoother(m0, P0, F, c, Q, H, r, R, observed)
    seq = affine_chain_smoother(m0, P0, F, c, Q, H, r, R, observed, parallel=False)
    _assert_results_close(par, seq, 1e-9)
    means, covs, incs = _dense(m0, P0, F, c, Q, H, r, R, observed)
    assert torch.allclose(par.means, means, atol=1e-9, rtol=0)
    assert torch.allclose(par.covariances, covs, atol=1e-9, rtol=0)
    assert torch.allclose(par.log_evidence_increments, incs, atol=1e-9, rtol=0)
    none = ~observed.any(-1)
    assert (par.log_evidence_increments[none] == 0).all() and (seq.log_evidence_increments[none] == 0).all()
    assert all(torch.isfinite(x).all() for x in par)
    # NaN at missing entries must not leak into gradients, and both paths give the same ones.
    leaves = [x.clone().requires_grad_() for x in (m0, P0, F, c, Q, H, r, R)]
    grads = []
    for parallel in (True, False):
        out = affine_chain_smoother(*leaves, observed, parallel=parallel)
        grads.append(torch.autograd.grad(out.log_evidence_increments.sum() + out.means.sum(), leaves))
    for i, (gp, gs) in enumerate(zip(*grads)):
        if i in (1, 4, 7):  # covariances: the paths symmetrise differently, so compare symmetric parts
            gp, gs = gp + gp.mT, gs + gs.mT
        assert torch.isfinite(gp).all() and torch.allclose(gp, gs, atol=1e-8, rtol=0)


def test_gradcheck_parallel():
    T, d, e = 4, 2, 1
    m0, P0, F, c, Q, H, r, R = _random_model(T, d, e, seed=5)
    BQ = torch.linalg.cholesky(Q).requires_grad_()
    BR = torch.linalg.cholesky(R).requires_grad_()
    BP = torch.linalg.cholesky(P0).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (m0, F, c, H, r)]

    def spd(B):
        return B @ B.mT + 0.1 * torch.eye(B.shape[-1], dtype=D64)

    def fn(m0, F, c, H, r, BP, BQ, BR):
        out = affine_chain_smoother(m0, spd(BP), F, c, spd(BQ), H, r, spd(BR))
        return out.log_evidence_increments.sum(), out.means

    assert torch.autograd.gradcheck(fn, (*leaves, BP, BQ, BR))


def test_float32_parallel():
    T, d, e = 80, 2, 1
    args64 = _random_model(T, d, e, seed=2)
    ref = affine_chain_smoother(*args64, parallel=False)
    out = affine_chain_smoother(*(a.float() for a in args64))
    assert all(x.dtype == torch.float32 for x in out)
    for name, x, y in zip(ref._fields, out, ref):
        assert torch.allclose(x.double(), y, rtol=1e-4, atol=1e-4 * y.abs().max().item()), name


def _matrices(n, seed):
    return (torch.randn(n, 3, 3, generator=torch.Generator().manual_seed(seed), dtype=D64),)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 33])
def test_associative_scan(n):
    def add(a, b):
        return (a[0] + b[0],)

    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(n), dtype=D64)
    assert torch.allclose(associative_scan(add, (x,))[0], x.cumsum(0))
    assert torch.allclose(associative_scan(add, [x], reverse=True)[0], x.flip(0).cumsum(0).flip(0))
    (M,) = _matrices(n, n)
    M = M / 2  # keeps long products of order 1
    fwd = associative_scan(lambda a, b: (a[0] @ b[0],), (M,))[0]
    rev = associative_scan(lambda a, b: (a[0] @ b[0],), (M,), reverse=True)[0]
    acc = M[0]
    for t in range(n):
        acc = M[0] if t == 0 else acc @ M[t]
        assert torch.allclose(fwd[t], acc, atol=1e-12)
    acc = M[-1]
    for t in range(n - 1, -1, -1):
        acc = M[-1] if t == n - 1 else acc @ M[t]  # reverse: later elements on the left
        assert torch.allclose(rev[t], acc, atol=1e-12)


def test_associative_scan_bad_input():
    with pytest.raises(ValueError, match="elems"):
        associative_scan(lambda a, b: a, (torch.zeros(3), torch.zeros(2)))
    with pytest.raises(ValueError, match="elems"):
        associative_scan(lambda a, b: a, ())


@pytest.mark.parametrize(
    "name, index, bad",
    [
        ("init_mean", 0, torch.zeros(3, 1, dtype=D64)),
        ("init_cov", 1, torch.zeros(2, 3, dtype=D64)),
        ("F", 2, torch.zeros(5, 3, 3, dtype=D64)),
        ("c", 3, torch.zeros(3, 3, dtype=D64)),
        ("Q", 4, torch.zeros(4, 3, 2, dtype=D64)),
        ("H", 5, torch.zeros(5, 1, 2, dtype=D64)),
        ("r", 6, torch.zeros(5, dtype=D64)),
        ("R", 7, torch.zeros(5, 2, 1, dtype=D64)),
    ],
)
def test_bad_shapes(name, index, bad):
    args = list(_random_model(5, 3, 2, seed=0))
    args[index] = bad
    with pytest.raises(ValueError, match=name):
        affine_chain_smoother(*args)


def test_bad_observed():
    args = _random_model(5, 3, 2, seed=0)
    with pytest.raises(ValueError, match="observed"):
        affine_chain_smoother(*args, observed=torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="observed"):
        affine_chain_smoother(*args, observed=torch.ones(5, 2))
