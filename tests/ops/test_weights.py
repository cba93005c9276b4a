"""pyro_smc.ops.weights: normalisation, ESS and log-mean-exp of log-weights, against float64
references, at extreme log-weights (+-1e4), on random inputs and on invalid input."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops.weights import ess, ess_of_weights, log_mean_exp, normalize
from tests.cases import DTYPE_IDS, DTYPES, ulp
from tests.property_cases import BATCH, BUG, F64, FLOAT_DTYPES, PROPERTY, SEEDS, eps, gen


def test_weights_helpers():
    lw = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    nlw, log_sum = normalize(lw)
    assert torch.allclose(nlw.exp().sum(-1), torch.ones(2))
    assert torch.allclose(log_sum, lw.logsumexp(-1))
    w = nlw.exp()
    assert torch.allclose(ess(nlw), 1 / (w * w).sum(-1))
    assert torch.allclose(ess(nlw[1]), torch.tensor(3.0))
    assert torch.allclose(log_mean_exp(lw), lw.exp().mean(-1).log())


# =================================================================================================
# Extreme log-weights (+-1e4)
# =================================================================================================
@pytest.mark.parametrize("shift", [1e4, -1e4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_weights_are_shift_invariant_at_1e4(dtype, shift):
    g = torch.Generator().manual_seed(0)
    lw = (3 * torch.randn(4, 50, generator=g)).to(dtype)
    shifted = lw + shift
    # The shift itself rounds the inputs to the spacing of numbers near 1e4 (1e-3 in float32).
    tol = 4 * ulp(dtype, abs(shift))
    base_lw, base_sum = normalize(lw)
    new_lw, new_sum = normalize(shifted)
    assert torch.isfinite(new_lw).all() and torch.isfinite(new_sum).all()
    assert (new_lw - base_lw).abs().max() <= tol
    assert (new_sum - (base_sum + shift)).abs().max() <= tol
    assert new_lw.logsumexp(-1).abs().max() <= tol
    assert (ess(new_lw) - ess(base_lw)).abs().max() <= 50 * tol
    assert (log_mean_exp(shifted) - (log_mean_exp(lw) + shift)).abs().max() <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("big", [True, False], ids=["one_at_+1e4", "others_at_-1e4"])
def test_one_dominant_weight(dtype, big):
    """A weight 1e4 nats above the others: normalised exactly to a point mass, ESS 1."""
    n, k = 20, 7
    lw = torch.zeros(3, n, dtype=dtype)
    if big:
        lw[:, k] = 1e4
    else:
        lw.fill_(-1e4)
        lw[:, k] = 0.0
    nlw, log_sum = normalize(lw)
    assert torch.isfinite(log_sum).all()
    assert torch.equal(nlw[:, k], torch.zeros(3, dtype=dtype))
    assert (nlw[:, torch.arange(n) != k] <= -1e4 + 2 * ulp(dtype, 1e4)).all()
    assert torch.allclose(ess(nlw), torch.ones(3, dtype=dtype))
    expected = (1e4 if big else 0.0) - math.log(n)
    assert (log_mean_exp(lw) - expected).abs().max() <= 4 * ulp(dtype, 1e4)


# =================================================================================================
# Random shapes, dtypes, scales, offsets and zero weights (hypothesis)
# =================================================================================================
@PROPERTY
@given(
    batch=BATCH,
    n=st.integers(1, 40),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]),
    offset=st.floats(-1e4, 1e4),
    shift=st.floats(-1e4, 1e4),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_weights_functions(batch, n, dtype, seed, scale, offset, shift, zero_fraction):
    g = gen(seed)
    shape = batch + (n,)
    lw = (offset + scale * torch.randn(shape, generator=g, dtype=F64)).to(dtype)
    zero = torch.rand(shape, generator=g) < zero_fraction
    zero.scatter_(-1, torch.randint(n, batch + (1,), generator=g), False)
    lw = lw.masked_fill(zero, -math.inf)
    finite = torch.isfinite(lw)
    magnitude = float(lw[finite].abs().max()) + 1.0
    tol = 16 * eps(dtype) * magnitude

    nlw, log_sum = normalize(lw)
    assert nlw.shape == shape and log_sum.shape == batch and nlw.dtype == log_sum.dtype == dtype
    assert not torch.isnan(nlw).any() and torch.isfinite(log_sum).all()
    assert torch.equal(torch.isfinite(nlw), finite)  # zero weights stay exactly zero
    ref_sum = lw.double().logsumexp(-1)
    assert (log_sum.double() - ref_sum).abs().max() <= tol
    assert (nlw.double() - (lw.double() - ref_sum.unsqueeze(-1)))[finite].abs().max() <= tol
    assert nlw.double().logsumexp(-1).abs().max() <= tol

    e = ess(nlw)
    assert e.shape == batch and e.dtype == dtype and torch.isfinite(e).all()
    ref_ess = torch.exp(-torch.logsumexp(2 * (lw.double() - ref_sum.unsqueeze(-1)), -1))
    assert ((e.double() / ref_ess) - 1).abs().max() <= 4 * tol + 1e-5
    assert (e >= 1 - 1e-4).all() and (e <= finite.sum(-1) * (1 + 1e-4)).all()

    lme = log_mean_exp(lw)
    assert lme.shape == batch and (lme.double() - (ref_sum - math.log(n))).abs().max() <= tol
    if batch:
        lme0 = log_mean_exp(lw, dim=0)
        assert lme0.shape == shape[1:] and not torch.isnan(lme0).any()

    # Shifting every log-weight changes nothing but the normaliser (up to the rounding of the shift).
    shifted_lw, shifted_sum = normalize(lw + shift)
    shift_tol = 16 * eps(dtype) * (magnitude + abs(shift))
    assert (shifted_lw - nlw)[finite].abs().max() <= shift_tol
    assert (shifted_sum.double() - log_sum.double() - shift).abs().max() <= shift_tol


# =================================================================================================
# Invalid log-weights: each test failed before its fix
# =================================================================================================
def test_normalize_rejects_all_minus_inf_weights():
    with pytest.raises(ValueError, match="log_weights"):
        normalize(torch.full((2, 4), -math.inf))


@BUG
@given(n=st.integers(1, 10), dtype=FLOAT_DTYPES, seed=SEEDS, bad=st.sampled_from([math.nan, math.inf]))
def test_normalize_rejects_nan_and_plus_inf_weights(n, dtype, seed, bad):
    lw = torch.randn(2, n, generator=gen(seed), dtype=dtype)
    lw[1, int(torch.randint(n, (), generator=gen(seed)))] = bad
    with pytest.raises(ValueError, match="log_weights"):
        normalize(lw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ess_of_weights_is_ess_of_their_logs(dtype):
    """Against the definition 1 / sum w_i^2 on normalised weights, and equal to ess() bit for bit."""
    g = torch.Generator().manual_seed(3)
    log_w = torch.randn(4, 50, generator=g, dtype=torch.float64).to(dtype)
    log_w = log_w - torch.logsumexp(log_w, -1, keepdim=True)
    w = log_w.exp()
    assert torch.equal(ess_of_weights(w), ess(log_w))
    exact = 1 / log_w.double().exp().square().sum(-1)
    assert torch.allclose(ess_of_weights(w).double(), exact, rtol=50 * torch.finfo(dtype).eps)
    # Unchanged by a common factor (unnormalised weights).
    assert torch.allclose(ess_of_weights(7.5 * w), ess_of_weights(w), rtol=10 * torch.finfo(dtype).eps)
