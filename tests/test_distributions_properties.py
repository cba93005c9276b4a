"""Property suite of :class:`pyro_smc.distributions.MatrixNormal` (issue 26): drawn shapes (zero-size
dims included), batch dims, dtypes and defects of every argument (not a tensor, non-square, wrong
size, not lower triangular, zero or negative diagonal, NaN, inf, integer or float16 dtypes, batch
dims that do not broadcast; mixed float32/float64, which is promoted). The invariant: a
``ValueError`` naming the argument, or ``log_prob``, ``entropy``, ``mean``, ``variance`` and both closed-form KLs equal to those of the dense
``MultivariateNormal`` with covariance ``V kron U`` (``torch.kron``)."""

import math

import pyro.distributions as dist
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch.distributions import MultivariateNormal, kl_divergence

from pyro_smc.distributions import MatrixNormal
from tests.property_cases import BATCH, ENGINE, F32, F64, SEEDS, assert_clear_error, dense_kron, gen, random_tril

DEFECTS = ["none"] * 6 + [
    "not_tensor",
    "non_square",
    "wrong_size",
    "upper",
    "zero_diag",
    "negative_diag",
    "nan",
    "inf",
    "integer",
    "half",
    "mixed_dtype",
    "no_broadcast",
    "empty",
]
WHICH = ["loc", "scale_tril_row", "scale_tril_col"]


def _vec(x):
    return x.mT.reshape(x.shape[:-2] + (-1,))


def _spoil(defect, value, which, g):
    """``value`` with ``defect``; ``None`` if the defect does not apply to this argument."""
    if defect == "not_tensor":
        return value.tolist()
    if defect == "integer":
        return value.long()
    if defect == "half":
        return value.half()
    if defect == "nan" or defect == "inf":
        value = value.clone()
        value[..., -1, 0] = math.nan if defect == "nan" else math.inf
        return value
    if which == "loc":
        return None
    k = value.shape[-1]
    if defect == "non_square":
        return value[..., :, :-1] if k > 1 else torch.ones(value.shape[:-1] + (2,), dtype=value.dtype)
    if defect == "wrong_size":
        return random_tril(value.shape[:-2], k + 1, g, value.dtype)
    if defect == "upper" and k > 1:
        value = value.clone()
        value[..., 0, -1] = 0.5
        return value
    if defect in ("zero_diag", "negative_diag"):
        value = value.clone()
        value[..., 0, 0] = 0.0 if defect == "zero_diag" else -0.5
        return value
    return None


@ENGINE
@given(
    n=st.integers(1, 4),
    p=st.integers(1, 4),
    batch=BATCH,
    dtype=st.sampled_from([F32, F64]),
    defect=st.sampled_from(DEFECTS),
    which=st.sampled_from(WHICH),
    validate=st.sampled_from([None, True]),
    seed=SEEDS,
)
def test_property_matrix_normal_against_the_dense_gaussian(n, p, batch, dtype, defect, which, validate, seed):
    g = gen(seed)
    args = {
        "loc": torch.randn(batch + (n, p), generator=g, dtype=dtype),
        "scale_tril_row": random_tril(batch, n, g, dtype),
        "scale_tril_col": random_tril((), p, g, dtype),
    }
    expected = None
    if defect == "empty":
        args["loc"], expected = torch.zeros(batch + (0, p), dtype=dtype), "loc"
        args["scale_tril_row"] = torch.eye(0, dtype=dtype)
    elif defect == "no_broadcast":
        if batch:  # a last batch dim of size batch[-1] + 1 against the others' batch[-1]
            other = batch[:-1] + (batch[-1] + 1,)
            k = {"loc": None, "scale_tril_row": n, "scale_tril_col": p}[which]
            args[which] = torch.randn(other + (n, p), generator=g, dtype=dtype) if k is None else random_tril(other, k, g, dtype)
            expected = "broadcast" if batch[-1] > 1 else None
    elif defect == "mixed_dtype":  # promoted to float64, as torch's broadcast_all does
        args[which] = args[which].to(F64 if dtype == F32 else F32)
    elif defect != "none":
        spoiled = _spoil(defect, args[which], which, g)
        if spoiled is not None:
            args[which], expected = spoiled, which
    event(f"{defect} {which}: {expected or 'valid'}")
    validating = validate if validate is not None else torch.distributions.Distribution._validate_args
    if not validating and defect in ("upper", "zero_diag", "negative_diag"):
        return  # only checked with validation, as in torch (the default: on)
    try:
        d = MatrixNormal(**args, validate_args=validate)
    except Exception as error:  # noqa: BLE001 - the invariant decides
        assert expected is not None, f"rejected a valid MatrixNormal: {error!r}"
        assert_clear_error(error, expected)
        return
    assert expected is None, f"accepted {defect} {which}"
    loc, row, col = (args[k].double() for k in WHICH)
    cov = dense_kron(col @ col.mT, row @ row.mT)  # V kron U
    cov = cov.expand(d.batch_shape + cov.shape[-2:])
    mvn = MultivariateNormal(_vec(loc).expand(cov.shape[:-1]), covariance_matrix=cov)
    promoted = F64 if defect == "mixed_dtype" else dtype
    rtol = 1e-4 if F32 in (dtype, args[which].dtype) else 1e-10
    value = d.rsample((2,))
    assert value.shape == (2,) + d.batch_shape + (n, p) and value.dtype == promoted and torch.isfinite(value).all()
    other = loc + torch.randn(loc.shape, generator=g, dtype=F64)
    for x in (value.double(), other):
        want, got = mvn.log_prob(_vec(x)), d.log_prob(x.to(dtype)).double()
        assert ((got - want).abs() <= rtol * (n * p + want.abs())).all(), (got, want)
    assert ((d.entropy().double() - mvn.entropy()).abs() <= rtol * (n * p + mvn.entropy().abs())).all()
    assert torch.equal(d.mean, args["loc"].to(promoted).expand(d.batch_shape + (n, p)))
    var = cov.diagonal(dim1=-2, dim2=-1).reshape(cov.shape[:-2] + (p, n)).mT
    assert ((d.variance.double() - var).abs() <= rtol * var).all()
    # KL to a second matrix normal and to a diagonal Normal prior, against the dense formulas.
    q_row, q_col = random_tril((), n, g, dtype), random_tril((), p, g, dtype)
    q = MatrixNormal(torch.randn(n, p, generator=g, dtype=dtype), q_row, q_col)
    q_mvn = MultivariateNormal(_vec(q.loc.double()), covariance_matrix=dense_kron(q_col.double() @ q_col.double().mT, q_row.double() @ q_row.double().mT))
    prior_scale = 0.5 + torch.rand(n, p, generator=g, dtype=dtype)
    prior = dist.Normal(torch.zeros(n, p, dtype=dtype), prior_scale).to_event(2)
    prior_mvn = MultivariateNormal(torch.zeros(n * p, dtype=F64), covariance_matrix=torch.diag(_vec(prior_scale.double()) ** 2))
    for target, dense in ((q, q_mvn), (prior, prior_mvn)):
        want, got = kl_divergence(mvn, dense), kl_divergence(d, target).double()
        assert ((got - want).abs() <= 10 * rtol * (n * p + want.abs())).all(), (got, want)
