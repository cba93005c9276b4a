"""Tests of :mod:`pyro_smc.ops.kronecker_tril`: the Gaussian terms of ``V kron U`` from its Cholesky
factors against the dense covariance, and their input checks (the property suite over every
Kronecker op is in ``test_kronecker_properties.py``)."""

import pytest
import torch

from pyro_smc.ops import kronecker_tril
from pyro_smc.ops.kronecker import kron, vec
from pyro_smc.ops.kronecker_tril import (
    kron_tril_entropy,
    kron_tril_logdet,
    kron_tril_mahalanobis,
    kron_tril_trace,
    kron_tril_variance,
)
from tests.ops.test_kronecker import BATCHES, SHAPES, _close, _tril
from tests.property_cases import F64, gen, random_tril


def test_all_names_resolve():
    for name in kronecker_tril.__all__:
        assert callable(getattr(kronecker_tril, name))


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


# Found by the property suite (issue 26); each failed before its fix.
@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: kron_tril_variance(torch.zeros(2, 3), torch.eye(2)), "scale_tril_row"),  # returned zeros
        (lambda: kron_tril_variance(torch.eye(2), torch.ones(3)), "scale_tril_col"),  # returned garbage
        (lambda: kron_tril_trace(torch.zeros(2, 3), torch.eye(2), torch.eye(2), torch.eye(2)), "scale_tril_row_p"),
        (lambda: kron_tril_trace(torch.eye(3), torch.eye(2), torch.eye(2), torch.eye(2)), "scale_tril_row_q"),
        (lambda: kron_tril_trace(torch.eye(2), torch.eye(2), torch.eye(2), torch.eye(3)), "scale_tril_col_q"),
        (lambda: kron_tril_trace(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.eye(2), torch.eye(2), torch.eye(2)), "singular"),  # NaN
        (lambda: kron_tril_entropy(torch.eye(2), torch.zeros(2, 3)), "scale_tril_col"),  # named it "b"
    ],
)
def test_kron_tril_ops_reject_malformed_input_naming_it(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("op", ["mahalanobis", "trace", "variance"])
def test_mixed_float_dtypes_are_promoted(op):
    g = gen(3)
    a, b, x = random_tril((), 3, g, F64), random_tril((), 2, g, F64), torch.randn(3, 2, generator=g, dtype=F64)
    calls = {
        "mahalanobis": lambda a, b, x: kron_tril_mahalanobis(a, b, x),
        "trace": lambda a, b, x: kron_tril_trace(a, b, a.double(), b.double()),
        "variance": lambda a, b, x: kron_tril_variance(a, b),
    }
    exact = calls[op](a, b, x)
    for mixed in ((a.float(), b, x), (a, b.float(), x), (a, b, x.float())):
        got = calls[op](*mixed)
        assert got.dtype == F64
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
