import pytest
import torch

from pyro_smc.ops import kronecker
from pyro_smc.ops.kronecker import (
    kron,
    kron_logdet,
    kron_matvec,
    kron_solve,
    kron_tril_entropy,
    kron_tril_logdet,
    kron_tril_mahalanobis,
    kron_tril_trace,
    kron_tril_variance,
    unvec,
    vec,
)
from tests.tolerances import EXACT_ATOL, EXACT_RTOL

SHAPES = [(1, 1), (3, 2), (2, 4), (4, 4)]
BATCHES = [(), (3,)]


def _tril(batch, d, g):
    lower = torch.randn(*batch, d, d, generator=g).tril(-1) * 0.5
    return lower + torch.diag_embed(torch.rand(*batch, d, generator=g) + 0.5)


def _general(batch, d, g):
    return torch.randn(*batch, d, d, generator=g) + 2 * torch.eye(d)


def _close(a, b):
    return torch.allclose(a, b, rtol=EXACT_RTOL * 100, atol=EXACT_ATOL * 100)


def test_all_names_resolve():
    for name in kronecker.__all__:
        assert callable(getattr(kronecker, name))


def test_vec_is_column_major_and_batched_kron_matches_torch_kron():
    x = torch.arange(6.0).reshape(2, 3)
    assert vec(x).tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    assert torch.equal(unvec(vec(x), 2, 3), x)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 2, 4, generator=g), torch.randn(3, 3, 2, generator=g)
    out = kron(a, b)
    assert out.shape == (3, 6, 8)
    for i in range(3):
        assert torch.equal(out[i], torch.kron(a[i], b[i]))


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n,p", SHAPES)
def test_matvec_and_solve_match_dense(n, p, batch):
    g = torch.Generator().manual_seed(n * 10 + p)
    a, b, x = _general(batch, n, g), _general(batch, p, g), torch.randn(*batch, n, p, generator=g)
    # torch.kron (no batching) as the oracle; it rejects a transposed view, hence .contiguous()
    pairs = zip(a.reshape(-1, n, n), b.reshape(-1, p, p))
    dense = torch.stack([torch.kron(bb.T.contiguous(), aa) for aa, bb in pairs]).reshape(*batch, n * p, n * p)
    y = kron_matvec(a, b, x)
    assert _close(vec(y), (dense @ vec(x).unsqueeze(-1)).squeeze(-1))
    assert _close(vec(kron_solve(a, b, y)), torch.linalg.solve(dense, vec(y)))
    assert _close(kron_solve(a, b, y), x)
    assert _close(kron_logdet(a, b), torch.linalg.slogdet(dense).logabsdet)


@pytest.mark.parametrize("n,p", SHAPES)
def test_triangular_solves_read_only_their_triangle(n, p):
    g = torch.Generator().manual_seed(1)
    lo, up = _tril((), n, g), _tril((), p, g).T
    y = torch.randn(n, p, generator=g)
    # garbage in the unused triangles must be ignored
    lo_dirty, up_dirty = lo + torch.ones(n, n).triu(1), up + torch.ones(p, p).tril(-1)
    x = kron_solve(lo_dirty, up_dirty, y, tri_a="lower", tri_b="upper")
    assert _close(kron_matvec(lo, up, x), y)
    assert _close(x, kron_solve(lo, up, y))
    assert _close(kron_logdet(lo, up, triangular=True), kron_logdet(lo, up))
    with pytest.raises(ValueError, match="tri_a"):
        kron_solve(lo, up, y, tri_a="diag")


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n,p", SHAPES)
def test_tril_covariance_helpers_match_dense(n, p, batch):
    g = torch.Generator().manual_seed(n + 7 * p)
    lr, lc, lr2, lc2 = _tril(batch, n, g), _tril(batch, p, g), _tril(batch, n, g), _tril(batch, p, g)
    x = torch.randn(*batch, n, p, generator=g)
    cov = kron(lc @ lc.mT, lr @ lr.mT)  # Cov(vec W) = V kron U
    cov2 = kron(lc2 @ lc2.mT, lr2 @ lr2.mT)
    assert _close(2 * kron_tril_logdet(lr, lc), torch.linalg.slogdet(cov).logabsdet)
    v = vec(x).unsqueeze(-1)
    assert _close(kron_tril_mahalanobis(lr, lc, x), (v.mT @ torch.linalg.solve(cov, v)).reshape(batch))
    assert _close(kron_tril_trace(lr, lc, lr2, lc2), torch.linalg.solve(cov, cov2).diagonal(dim1=-2, dim2=-1).sum(-1))
    assert _close(vec(kron_tril_variance(lr, lc)), cov.diagonal(dim1=-2, dim2=-1))
    mvn = torch.distributions.MultivariateNormal(torch.zeros(n * p), covariance_matrix=cov)
    assert _close(kron_tril_entropy(lr, lc), mvn.entropy())


def test_float32_and_gradients():
    g = torch.Generator().manual_seed(3)
    a, b, y = _tril((), 3, g), _tril((), 2, g), torch.randn(3, 2, generator=g)
    for t in (a, b, y):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, y: kron_solve(a, b, y, tri_a="lower", tri_b="lower"), (a, b, y))
    assert torch.autograd.gradcheck(lambda a, b: kron_logdet(a, b, triangular=True), (a, b))
    out = kron_solve(a.detach().float(), b.detach().float(), y.detach().float(), tri_a="lower", tri_b="lower")
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), kron_solve(a, b, y).detach(), atol=1e-5)
