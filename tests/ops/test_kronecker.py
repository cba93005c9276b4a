import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops import kronecker
from pyro_smc.ops.kronecker import (
    kron,
    kron_logdet,
    kron_matvec,
    kron_solve,
    unvec,
    vec,
)
from tests.property_cases import BATCH, BUG, F32, F64, FLOAT_DTYPES, PROPERTY, SEEDS, dense_kron, gen, random_tril
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


# =================================================================================================
# Random shapes, dtypes and triangles against dense torch.kron (hypothesis)
# =================================================================================================
TRI = st.sampled_from([None, "lower", "upper"])


@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), batch=BATCH, dtype=FLOAT_DTYPES, seed=SEEDS, tri_a=TRI, tri_b=TRI)
def test_kronecker_ops_match_dense_kron(n, p, batch, dtype, seed, tri_a, tri_b):
    g = gen(seed)

    def factor(size, tri):
        if tri is None:
            clean = torch.randn(*batch, size, size, generator=g, dtype=dtype) / math.sqrt(size) + 2 * torch.eye(size, dtype=dtype)
            return clean, clean
        clean = random_tril(batch, size, g, dtype)
        clean = clean if tri == "lower" else clean.transpose(-1, -2)
        # The unused triangle holds garbage: a triangular solve must read only its own triangle.
        noise = torch.randn(*batch, size, size, generator=g, dtype=dtype)
        return clean, clean + (noise.triu(1) if tri == "lower" else noise.tril(-1))

    a, a_dirty = factor(n, tri_a)
    b, b_dirty = factor(p, tri_b)
    x = torch.randn(*batch, n, p, generator=g, dtype=dtype)
    dense = dense_kron(b, a)
    rtol = 1e-4 if dtype == F32 else 1e-10

    y = kron_matvec(a, b, x)
    assert y.shape == x.shape and y.dtype == dtype
    ref = (dense @ vec(x).double().unsqueeze(-1)).squeeze(-1)
    assert (vec(y).double() - ref).abs().max() <= rtol * (1 + ref.abs().max())

    sol = kron_solve(a_dirty, b_dirty, y, tri_a=tri_a, tri_b=tri_b)
    ref_sol = torch.linalg.solve(dense, vec(y).double())
    assert sol.shape == x.shape and sol.dtype == dtype
    assert (vec(sol).double() - ref_sol).abs().max() <= 10 * rtol * (1 + ref_sol.abs().max())

    triangular = tri_a is not None and tri_b is not None
    logdet = kron_logdet(a, b, triangular=triangular)
    ref_logdet = torch.linalg.slogdet(dense).logabsdet
    assert logdet.shape == batch and (logdet.double() - ref_logdet).abs().max() <= rtol * (n * p + ref_logdet.abs().max())


# =================================================================================================
# Invalid input
# =================================================================================================
@PROPERTY
@given(bad=st.text(max_size=8).filter(lambda s: s not in ("lower", "upper")), which=st.sampled_from(["tri_a", "tri_b"]))
def test_kron_solve_rejects_unknown_triangle(bad, which):
    with pytest.raises(ValueError, match=which):
        kron_solve(torch.eye(2), torch.eye(3), torch.ones(2, 3), **{which: bad})


# Each of these failed before its fix.
@BUG
@given(n=st.integers(1, 4), p=st.integers(1, 4), off=st.integers(1, 2), op=st.sampled_from(["matvec", "solve", "logdet"]))
def test_kronecker_ops_reject_shape_mismatch(n, p, off, op):
    a, b = torch.eye(n), torch.eye(p)
    x = torch.ones(n + off, p)  # rows do not match a
    with pytest.raises(ValueError):
        if op == "matvec":
            kron_matvec(a, b, x)
        elif op == "solve":
            kron_solve(a, b, x)
        else:
            kron_logdet(torch.ones(n, n + off), b)


@BUG
@given(n=st.integers(1, 4), p=st.integers(1, 4), seed=SEEDS)
def test_kron_solve_rejects_a_singular_triangular_factor(n, p, seed):
    g = gen(seed)
    a = random_tril((), n, g, F64)
    a[int(torch.randint(n, (), generator=g)), :] = 0.0  # a zero row: singular
    y = torch.randn(n, p, generator=g, dtype=F64)
    with pytest.raises(ValueError):
        kron_solve(a, torch.eye(p, dtype=F64), y, tri_a="lower")


# Found by the property suite (issue 26); each failed before its fix.
@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: vec(torch.zeros(3)), "vec: x"),  # IndexError
        (lambda: unvec(torch.zeros(5), 2, 3), "unvec: v"),  # RuntimeError from reshape
        (lambda: unvec(torch.tensor(1.0), 1, 1), "unvec: v"),  # 0-d: IndexError
        (lambda: kron(torch.zeros(3), torch.eye(2)), "kron: a must"),  # "not enough values to unpack"
        (lambda: kron(torch.zeros(2, 2, 2), torch.zeros(3, 2, 2)), "broadcast"),  # RuntimeError
        (lambda: kron_solve(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.eye(2), torch.ones(2, 2)), "singular"),  # LinAlgError
        (lambda: kron_logdet(torch.eye(2, dtype=torch.long), torch.eye(2, dtype=torch.long)), "floating"),
        (lambda: kron_solve(torch.eye(2).expand(3, 2, 2), torch.eye(2).expand(4, 2, 2), torch.ones(2, 2)), "broadcast"),
        (lambda: kron_logdet(torch.eye(2).expand(3, 2, 2), torch.eye(2).expand(4, 2, 2)), "broadcast"),
        (lambda: kron_matvec(torch.eye(2).expand(2, 1, 2, 2), torch.eye(2), torch.ones(3, 2, 2)), None),
    ],
)
def test_kronecker_ops_reject_malformed_input_naming_it(call, name):
    if name is None:  # batch dims that broadcast are fine
        assert call().shape == (2, 3, 2, 2)
        return
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("op", ["matvec", "solve", "solve_tri", "logdet"])
def test_mixed_float_dtypes_are_promoted(op):
    # Before: kron_solve raised "linalg.solve: Expected A and B to have the same dtype" and
    # kron_matvec "expected m1 and m2 to have the same dtype", while the triangular ops promoted.
    g = gen(3)
    a, b, x = random_tril((), 3, g, F64), random_tril((), 2, g, F64), torch.randn(3, 2, generator=g, dtype=F64)
    calls = {
        "matvec": lambda a, b, x: kron_matvec(a, b, x),
        "solve": lambda a, b, x: kron_solve(a, b, x),
        "solve_tri": lambda a, b, x: kron_solve(a, b, x, tri_a="lower", tri_b="lower"),
        "logdet": lambda a, b, x: kron_logdet(a, b),
    }
    exact = calls[op](a, b, x)
    for mixed in ((a.float(), b, x), (a, b.float(), x), (a, b, x.float())):
        got = calls[op](*mixed)
        assert got.dtype == F64
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
