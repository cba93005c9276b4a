"""QuadraticRegressor properties (hypothesis): exact on quadratics, invalid data and ridge."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.regression import QuadraticRegressor
from tests.property_cases import BUG, F32, FLOAT_DTYPES, PROPERTY, SEEDS, gen
from tests.regression.cases import F64


@PROPERTY
@given(
    d=st.integers(1, 4),
    k=st.integers(0, 3),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    loc=st.sampled_from([0.0, 3.0, 100.0]),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    extra=st.integers(0, 40),
)
def test_quadratic_regressor_is_exact_on_quadratics(d, k, dtype, seed, loc, scale, extra):
    """Targets y = z^T A z + b^T z + c with z = (x - loc) / scale: the quadratic features span them,
    so the least-squares fit reproduces them everywhere (float64 with ridge 0: to rounding; float32
    with the default relative ridge 1e-8: to 1e-3 relative). ``k = 0`` means vector targets (N,)."""
    g = gen(seed)
    outputs = max(k, 1)
    A = torch.randn(outputs, d, d, generator=g, dtype=F64)
    b = torch.randn(outputs, d, generator=g, dtype=F64)
    c = torch.randn(outputs, generator=g, dtype=F64)

    def f(x):
        z = (x.double() - loc) / scale
        y = torch.einsum("ni,kij,nj->nk", z, A, z) + z @ b.T + c
        return y if k else y[:, 0]

    features = 1 + d + d * (d + 1) // 2
    x = (loc + scale * torch.randn(2 * features + extra, d, generator=g, dtype=F64)).to(dtype)
    x_new = (loc + scale * torch.randn(20, d, generator=g, dtype=F64)).to(dtype)
    reg = QuadraticRegressor(ridge=0.0 if dtype == F64 else 1e-8).fit(x, f(x).to(dtype))
    pred = reg(x_new)
    assert pred.dtype == dtype and pred.shape == ((20, k) if k else (20,))
    truth = f(x_new)
    assert float((pred.double() - truth).norm() / truth.norm()) < (1e-3 if dtype == F32 else 1e-8)


INVALID_FITS = ["nan_input", "inf_input", "nan_target", "inf_target", "rows_mismatch", "one_row", "input_1d", "input_3d", "integer_input", "target_3d"]


@PROPERTY
@given(n=st.integers(2, 30), d=st.integers(1, 4), dtype=FLOAT_DTYPES, seed=SEEDS, kind=st.sampled_from(INVALID_FITS))
def test_quadratic_regressor_rejects_invalid_data(n, d, dtype, seed, kind):
    g = gen(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randn(n, generator=g, dtype=dtype)
    i, j = int(torch.randint(n, (), generator=g)), int(torch.randint(d, (), generator=g))
    match = "inputs"
    if kind == "nan_input":
        x[i, j] = math.nan
    elif kind == "inf_input":
        x[i, j] = -math.inf
    elif kind == "nan_target":
        y[i], match = math.nan, "targets"
    elif kind == "inf_target":
        y[i], match = math.inf, "targets"
    elif kind == "rows_mismatch":
        y, match = torch.randn(n + 1 + i, generator=g, dtype=dtype), "targets"
    elif kind == "one_row":
        x, y = x[:1], y[:1]
    elif kind == "input_1d":
        x = x[:, 0]
    elif kind == "input_3d":
        x = x.unsqueeze(0)
    elif kind == "integer_input":
        x = x.round().long()
    elif kind == "target_3d":
        y, match = y.reshape(n, 1, 1), "targets"
    with pytest.raises(ValueError, match=match):
        QuadraticRegressor().fit(x, y)


@PROPERTY
@given(ridge=st.one_of(st.floats(max_value=-1e-300), st.just(math.nan), st.just(math.inf)))
def test_quadratic_regressor_rejects_invalid_ridge(ridge):
    with pytest.raises(ValueError, match="ridge"):
        QuadraticRegressor(ridge=ridge)


# A regression property of a bug the properties found (it failed before its fix).
@BUG
@given(n=st.integers(2, 20), dtype=FLOAT_DTYPES)
def test_quadratic_regressor_rejects_zero_input_columns(n, dtype):
    with pytest.raises(ValueError, match="inputs"):
        QuadraticRegressor().fit(torch.zeros(n, 0, dtype=dtype), torch.zeros(n, dtype=dtype))
