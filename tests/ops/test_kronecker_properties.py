"""Property suite of :mod:`pyro_smc.ops.kronecker` and :mod:`pyro_smc.ops.kronecker_tril` (issue 26):
every op on drawn shapes, batch dims (broadcasting or not), dtypes (float32, float64, mixed
(promoted), integer) and defects (non-square or mismatched factors, singular ones), against the
dense ``torch.kron`` oracle in float64. The invariant: a ``ValueError`` naming the op and the
defect, or the dense answer."""

import math

import torch
from hypothesis import event, given
from hypothesis import strategies as st

from pyro_smc.ops import kronecker as K
from pyro_smc.ops import kronecker_tril as KT
from tests.property_cases import BATCH, ENGINE, F32, F64, SEEDS, assert_clear_error, dense_kron, gen, random_tril

OPS = ["matvec", "solve", "logdet", "tril_logdet", "tril_mahalanobis", "tril_trace", "tril_variance", "tril_entropy", "kron", "vec"]
DEFECTS = ["none", "none", "none", "non_square", "wrong_x", "no_broadcast", "mixed_dtype", "integer", "singular"]


def _vec(x):
    return x.mT.reshape(x.shape[:-2] + (-1,))


def _dense_logdet(a, b):
    return torch.linalg.slogdet(dense_kron(b, a)).logabsdet  # B^T kron A


@ENGINE
@given(
    op=st.sampled_from(OPS),
    defect=st.sampled_from(DEFECTS),
    n=st.integers(1, 4),
    p=st.integers(1, 4),
    batch=BATCH,
    dtype=st.sampled_from([F32, F64]),
    tri=st.sampled_from([None, "lower", "upper"]),
    seed=SEEDS,
)
def test_property_kronecker_ops_against_dense_kron(op, defect, n, p, batch, dtype, tri, seed):
    g = gen(seed)
    a, b = random_tril(batch, n, g, dtype), random_tril((), p, g, dtype)
    if tri == "upper":
        b = b.mT.contiguous()
    elif tri is None and op in ("solve", "logdet", "matvec"):  # a general factor
        b = b.mT + (0.3 * torch.randn(p, p, generator=g, dtype=dtype)).tril(-1)
    x = torch.randn(batch + (n, p), generator=g, dtype=dtype)
    if op.startswith("tril_"):
        b = b.mT if tri == "upper" else b  # the tril_* ops take both factors lower triangular
    q_row, q_col = random_tril((), n, g, dtype), random_tril(batch, p, g, dtype)
    if op == "vec" or (op == "kron" and defect != "no_broadcast"):
        defect = "none"  # vec has no factors; kron takes any matrices of any dtype
    expected_error = None
    if defect == "non_square":
        a, expected_error = a[..., :, : max(n - 1, 1)] if n > 1 else torch.ones(batch + (1, 2), dtype=dtype), "square"
    elif defect == "wrong_x" and op in ("matvec", "solve", "tril_mahalanobis"):
        x, expected_error = torch.randn(batch + (n + 1, p), generator=g, dtype=dtype), "shape"
    elif defect == "no_broadcast" and batch and batch[-1] > 1:
        b, expected_error = random_tril((batch[-1] + 1,), p, g, dtype), "broadcast"
    elif defect == "mixed_dtype":
        b = b.to(F64 if dtype == F32 else F32)  # promoted to float64, as torch's elementwise ops do
    elif defect == "integer":
        a, expected_error = torch.eye(n, dtype=torch.long).expand(batch + (n, n)), "floating"
    elif defect == "singular":
        a = a.clone()
        a[..., 0, 0] = 0.0  # a triangular factor with a zero on its diagonal
        if op in ("solve", "tril_mahalanobis", "tril_trace") and (op != "solve" or tri is not None):
            expected_error = "singular"
        elif op == "solve":
            a[..., 0, :] = 0.0  # general: a zero row, exactly singular for LU
            expected_error = "singular"
    event(f"{op}: {expected_error or 'valid'}")
    try:
        got = _call(op, a, b, x, q_row, q_col, tri)
    except Exception as error:  # noqa: BLE001 - the invariant decides
        assert expected_error is not None, f"{op} rejected valid input: {error!r}"
        assert_clear_error(error, expected_error)
        assert op in str(error) or op == "vec", str(error)
        return
    assert expected_error is None, f"{op} accepted a {defect} input"
    want = _dense(op, a, b, x, q_row, q_col, tri)
    got = got.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    if defect == "singular" and op in ("logdet", "tril_logdet", "tril_entropy"):
        assert (got == -math.inf).all() and (want == -math.inf).all()
        return
    promoted = torch.promote_types(torch.promote_types(a.dtype, b.dtype), x.dtype) if op not in ("kron", "vec") else got.dtype
    assert got.dtype == F64 or promoted == F32, (got.dtype, promoted)
    rtol = 1e-3 if dtype == F32 or defect == "mixed_dtype" else 1e-9
    assert torch.isfinite(got).all(), got
    assert ((got - want).abs() <= rtol * (1 + want.abs())).all(), (got, want)


def _call(op, a, b, x, q_row, q_col, tri):
    if op == "matvec":
        return K.kron_matvec(a, b, x)
    if op == "solve":
        return K.kron_solve(a, b, x, tri_a=None if tri is None else "lower", tri_b=tri)
    if op == "logdet":
        return K.kron_logdet(a, b, triangular=tri is not None)
    if op == "tril_logdet":
        return KT.kron_tril_logdet(a, b)
    if op == "tril_mahalanobis":
        return KT.kron_tril_mahalanobis(a, b, x)
    if op == "tril_trace":
        return KT.kron_tril_trace(a, b, q_row, q_col)
    if op == "tril_variance":
        return KT.kron_tril_variance(a, b)
    if op == "tril_entropy":
        return KT.kron_tril_entropy(a, b)
    if op == "kron":
        return K.kron(a, b)
    return K.unvec(K.vec(x), *x.shape[-2:])


def _dense(op, a, b, x, q_row, q_col, tri):
    a, b, x, q_row, q_col = (t.double() for t in (a, b, x, q_row, q_col))
    if op == "matvec":
        return _unvec(dense_kron(b, a) @ _vec(x).unsqueeze(-1), x)
    if op == "solve":
        return _unvec(torch.linalg.solve(dense_kron(b, a), _vec(x).unsqueeze(-1)), x)
    if op in ("logdet", "tril_logdet"):
        return _dense_logdet(a, b) if op == "logdet" else 0.5 * _dense_logdet(a @ a.mT, b @ b.mT)
    cov = dense_kron(b @ b.mT, a @ a.mT)  # V kron U
    if op == "tril_mahalanobis":
        v = _vec(x).unsqueeze(-1)
        return (v.mT @ torch.linalg.solve(cov, v)).squeeze(-1).squeeze(-1)
    if op == "tril_trace":
        cov_q = dense_kron(q_col @ q_col.mT, q_row @ q_row.mT)
        return torch.linalg.solve(cov, cov_q).diagonal(dim1=-2, dim2=-1).sum(-1)
    if op == "tril_variance":
        n, p = a.shape[-1], b.shape[-1]
        return cov.diagonal(dim1=-2, dim2=-1).reshape(cov.shape[:-2] + (p, n)).mT
    if op == "tril_entropy":
        k = a.shape[-1] * b.shape[-1]
        return 0.5 * k * (1 + math.log(2 * math.pi)) + 0.5 * torch.linalg.slogdet(cov).logabsdet
    if op == "kron":
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        aa, bb = a.expand(batch + a.shape[-2:]).reshape((-1,) + a.shape[-2:]), b.expand(batch + b.shape[-2:]).reshape((-1,) + b.shape[-2:])
        return torch.stack([torch.kron(u, v) for u, v in zip(aa, bb)]).reshape(batch + (a.shape[-2] * b.shape[-2], a.shape[-1] * b.shape[-1]))
    return x


def _unvec(v, like):
    n, p = like.shape[-2:]
    return v.squeeze(-1).reshape(v.shape[:-2] + (p, n)).mT
