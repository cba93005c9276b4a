import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops import resample
from pyro_smc.ops.weights import normalize
from tests.cases import DTYPE_IDS, DTYPES
from tests.property_cases import BATCH, BUG, F32, F64, FLOAT_DTYPES, PROPERTY, RESAMPLING_SCHEMES, SEEDS, gen, random_log_weights

SCHEMES = [resample.multinomial, resample.residual, resample.stratified, resample.systematic]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unbiased_offspring_counts(scheme):
    # E[#{i: A^i = j}] = N w_j; check with an explicit 5-sigma Monte Carlo error bar.
    torch.manual_seed(0)
    n, reps = 8, 20000
    w = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    lw = w.log().expand(reps, n)
    idx = scheme(lw)
    counts = torch.zeros(reps, n).scatter_add_(1, idx, torch.ones(reps, n))
    mean, sd = counts.mean(0), counts.std(0)
    assert ((mean - n * w).abs() <= 5 * sd / math.sqrt(reps) + 1e-12).all()


@pytest.mark.parametrize("scheme", [resample.stratified, resample.systematic])
def test_low_variance_schemes_keep_floor_counts(scheme):
    # Stratified and systematic give each particle floor(N w) or more... systematic exactly
    # floor or ceil.
    torch.manual_seed(1)
    n = 10
    lw = torch.randn(500, n).log_softmax(-1)
    idx = scheme(lw)
    counts = torch.zeros(500, n).scatter_add_(1, idx, torch.ones(500, n))
    expected = n * lw.exp()
    if scheme is resample.systematic:
        assert ((counts >= expected.floor()) & (counts <= expected.ceil())).all()
    assert (counts.sum(-1) == n).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_weight_particles_never_chosen(scheme):
    lw = torch.tensor([[0.0, -math.inf, -math.inf, 0.0]]).log_softmax(-1).expand(100, 4)
    idx = scheme(lw)
    assert set(idx.unique().tolist()) <= {0, 3}


# =================================================================================================
# Extreme log-weights (+-1e4)
# =================================================================================================
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dominant_weight_resamples_to_that_particle(dtype, scheme):
    n, k = 30, 11
    for lw in (
        torch.zeros(5, n, dtype=dtype).index_fill_(-1, torch.tensor([k]), 1e4),
        torch.full((5, n), -1e4, dtype=dtype).index_fill_(-1, torch.tensor([k]), 0.0),
    ):
        idx = scheme(normalize(lw)[0])
        assert idx.dtype == torch.int64 and idx.shape == (5, n)
        assert (idx == k).all()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.__name__)
def test_index_resampling_of_shifted_weights_is_identical(scheme):
    """Resampling normalise(lw + 1e4) or normalise(lw - 1e4) draws the same ancestors as
    normalise(lw) for the same random numbers (float64: the shift changes only the last bits)."""
    g = torch.Generator().manual_seed(2)
    lw = 2 * torch.randn(6, 40, generator=g)
    results = []
    for shift in (0.0, 1e4, -1e4):
        torch.manual_seed(123)
        results.append(scheme(normalize(lw + shift)[0]))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# =================================================================================================
# Random shapes, dtypes, scales and zero weights (hypothesis)
# =================================================================================================
@PROPERTY
@given(
    batch=BATCH,
    n=st.integers(1, 40),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    scheme=RESAMPLING_SCHEMES,
    scale=st.sampled_from([0.0, 1.0, 5.0, 1e4]),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_index_resampling(batch, n, dtype, seed, scheme, scale, zero_fraction):
    g = gen(seed)
    lw = random_log_weights(batch + (n,), g, dtype, scale, zero_fraction)
    torch.manual_seed(seed)
    idx = scheme(lw)
    assert idx.shape == lw.shape and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < n)).all()
    assert torch.isfinite(lw.gather(-1, idx)).all()  # a zero-weight particle is never an ancestor
    if scheme in (resample.stratified, resample.systematic):
        # Inverse-CDF schemes on sorted points: ancestors are sorted, and systematic resampling
        # gives every particle floor(N w) or ceil(N w) offspring (up to the rounding of N w).
        assert (idx.diff(dim=-1) >= 0).all()
    if scheme is resample.residual:
        # at least floor(N w) offspring each (up to the rounding of N w)
        counts = torch.zeros(lw.shape, dtype=F64).scatter_add_(-1, idx, torch.ones(lw.shape, dtype=F64))
        slack = 1e-3 if dtype == F32 else 1e-9
        assert (counts >= (n * lw.double().exp() - slack).floor()).all()
    if scheme is resample.systematic:
        counts = torch.zeros(lw.shape, dtype=F64).scatter_add_(-1, idx, torch.ones(lw.shape, dtype=F64))
        expected = n * lw.double().exp()
        slack = 1e-3 if dtype == F32 else 1e-9
        assert ((counts >= (expected - slack).floor()) & (counts <= (expected + slack).ceil())).all()


@PROPERTY
@given(batch=BATCH, n=st.integers(1, 60), dtype=FLOAT_DTYPES, seed=SEEDS, scheme=RESAMPLING_SCHEMES)
def test_index_resampling_of_equal_weights(batch, n, dtype, seed, scheme):
    """Equal weights: systematic and stratified keep every particle exactly once."""
    lw = torch.full(batch + (n,), -math.log(n), dtype=dtype)
    torch.manual_seed(seed)
    idx = scheme(lw)
    assert idx.shape == lw.shape and ((idx >= 0) & (idx < n)).all()
    if scheme in (resample.stratified, resample.systematic):
        assert torch.equal(idx, torch.arange(n).expand(lw.shape))


# =================================================================================================
# Invalid log-weights: each test failed before its fix
# =================================================================================================
@BUG
@given(scheme=RESAMPLING_SCHEMES, dtype=FLOAT_DTYPES)
def test_resampling_rejects_scalar_log_weights(scheme, dtype):
    with pytest.raises(ValueError, match="log_weights"):
        scheme(torch.zeros((), dtype=dtype))


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
@pytest.mark.parametrize("scheme", [resample.systematic, resample.stratified], ids=lambda s: s.__name__)
def test_index_resampling_rejects_invalid_weights(scheme, bad):
    with pytest.raises(ValueError, match="log_weights"):
        scheme(torch.full((3, 4), bad))


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
def test_multinomial_resampling_rejects_invalid_weights(bad):
    with pytest.raises(ValueError, match="log_weights"):
        resample.multinomial(torch.full((3, 4), bad))


# =================================================================================================
# Systematic resampling: the counting path (large inputs) against the binary search (small ones)
# =================================================================================================
@PROPERTY
@given(
    batch=BATCH,
    n=st.integers(1, 700),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    scale=st.sampled_from([0.0, 1.0, 5.0, 1e4]),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_systematic_counting_path_matches_search(batch, n, dtype, seed, scale, zero_fraction, monkeypatch):
    """Both implementations of systematic resampling give valid ancestors, and on weights in
    general position (scale > 0: no exact ties between a point and a cumulative weight) the same
    ones. The counting path is used from ``_SEARCH_BELOW`` weights on; forcing each path in turn
    covers every size."""
    g = gen(seed)
    lw = random_log_weights(batch + (n,), g, dtype, scale, zero_fraction)
    out = {}
    for name, threshold in (("search", math.inf), ("count", 0)):
        monkeypatch.setattr(resample, "_SEARCH_BELOW", threshold)
        out[name] = resample.systematic(lw, generator=gen(seed + 1))
    idx = out["count"]
    assert idx.shape == lw.shape and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < n)).all() and (idx.diff(dim=-1) >= 0).all()
    assert torch.isfinite(lw.gather(-1, idx)).all()
    counts = torch.zeros(lw.shape, dtype=F64).scatter_add_(-1, idx, torch.ones(lw.shape, dtype=F64))
    expected = n * lw.double().exp()
    slack = 1e-3 * n if dtype == F32 else 1e-9 * n
    assert ((counts >= (expected - slack).floor()) & (counts <= (expected + slack).ceil())).all()
    # The two paths compare a point (i + u) / N with a cumulative weight in different floating
    # operations, so they may disagree only where the two are equal up to rounding (about 1 in
    # 3000 float32 cases of 2 x 1000 weights); elsewhere they give the same ancestors.
    u = torch.rand(lw.shape[:-1] + (1,), dtype=dtype, generator=gen(seed + 1))
    # In the working precision, as both paths compute them.
    points = ((torch.arange(n, dtype=dtype) + u) / n).expand(lw.shape)
    cdf = lw.exp().cumsum(-1)
    tie = 8 * torch.finfo(dtype).eps
    for position in (out["count"] != out["search"]).nonzero().tolist():
        *row, i = position
        a, b = sorted((int(out["count"][tuple(position)]), int(out["search"][tuple(position)])))
        assert (cdf[tuple(row)][a:b] - points[tuple(position)]).abs().max() <= tie


def test_weighted_quantiles_equal_the_order_statistics_of_the_repeated_sample():
    """Oracle: particles with integer weights are the sample that repeats each one that many
    times; the inverse CDF at level p is that sample's order statistic of index floor(p n)."""
    from pyro_smc.ops.resample import weighted_quantiles

    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 7, 2, generator=g)  # (B, N, event)
    counts = torch.randint(1, 6, (3, 7), generator=g)
    probs = torch.tensor([0.013, 0.25, 0.5, 0.77, 0.999])
    q = weighted_quantiles(values, counts.double().log(), probs)  # (Q, B, event)
    assert q.shape == (5, 3, 2)
    for b in range(3):
        for e in range(2):
            sample = values[b, :, e].repeat_interleave(counts[b]).sort().values
            n = len(sample)
            expected = sample[(probs.double() * n).floor().long()]
            assert torch.equal(q[:, b, e], expected)


@pytest.mark.parametrize("n", [50, 500], ids=["search", "counting"])
@pytest.mark.parametrize("stop_gradient", [False, True], ids=["detach", "stop_gradient"])
@pytest.mark.parametrize("name", list(resample.SCHEMES))
@pytest.mark.parametrize("need", [[True, True, True], [False, True, False], [True, False, True]], ids=["all", "one", "two"])
def test_resample_where_draws_and_copies_as_the_scheme_on_the_rows_that_need_it(name, need, stop_gradient, n):
    # The engine's maybe_resample resamples the rows that need it as one sub-batch by the scheme;
    # resample_where must draw the same ancestors from the same random stream and give the same
    # particles (every event shape and dtype) and log-weights, bit for bit.
    scheme = getattr(resample, name)
    need = torch.tensor(need)
    log_w = torch.randn(3, n, dtype=torch.float64).log_softmax(-1).requires_grad_()
    particles = [torch.randn(3, n, 2, 3, dtype=torch.float64), torch.randint(0, 2, (3, n)).double(), torch.randint(0, 5, (3, n))]
    rows = need.nonzero().squeeze(-1)
    torch.manual_seed(7)
    index = scheme(log_w[rows])
    expected_lw = log_w.index_put((rows,), resample.stop_gradient_log_weights(log_w[rows], index) if stop_gradient else torch.full_like(log_w[rows], -math.log(n)))
    expected = []
    for value in particles:
        idx = index.reshape(index.shape + (1,) * (value.dim() - 2)).expand(index.shape + value.shape[2:])
        expected.append(value.index_put((rows,), value[rows].gather(1, idx)))
    after = torch.rand(())
    torch.manual_seed(7)
    new, new_lw = resample.resample_where(need, bool(need.all()), log_w, particles, resample.SCHEMES[name], stop_gradient, resample._SEARCH_BELOW)
    assert torch.equal(torch.rand(()), after)  # the same draws consumed
    for got, want in zip(new, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(new_lw, expected_lw)
    if stop_gradient:
        (grad,) = torch.autograd.grad(new_lw[need].sum(), log_w)
        (want,) = torch.autograd.grad(expected_lw[need].sum(), log_w)
        assert torch.equal(grad, want) and grad.abs().sum() > 0


def test_residual_offspring_counts_have_the_exact_law():
    """Residual resampling: particle j gets floor(N w_j) copies for certain plus a
    Binomial(R, r_j / R) share of the R = N - sum floor(N w) residual draws. The sample mean and
    variance of the counts against those exact moments, with 5-sigma error bars (the variance's
    from the counts' fourth moment)."""
    torch.manual_seed(3)
    n, reps = 8, 40000
    w = torch.tensor([0.31, 0.22, 0.15, 0.1, 0.1, 0.07, 0.04, 0.01], dtype=torch.float64)
    idx = resample.residual(w.log().expand(reps, n))
    counts = torch.zeros(reps, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(reps, n, dtype=torch.float64))
    floor = (n * w).floor()
    rest = n * w - floor
    r = n - floor.sum()
    assert bool((counts >= floor).all()) and bool((counts <= floor + r).all())
    mean, var = floor + rest, r * (rest / r) * (1 - rest / r)
    centred = counts - counts.mean(0)
    var_se = ((centred**2 - centred.pow(2).mean(0)).std(0)) / math.sqrt(reps)
    assert ((counts.mean(0) - mean).abs() <= 5 * counts.std(0) / math.sqrt(reps) + 1e-12).all()
    assert ((counts.var(0) - var).abs() <= 5 * var_se + 1e-12).all()
    # and never more spread than multinomial resampling, N w_j (1 - w_j)
    assert bool((var <= n * w * (1 - w) + 1e-12).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_residual_whole_counts_are_deterministic(dtype):
    """When every N w_j is whole (no residual mass) the copies are exactly N w_j, in every
    filter of a batch, and no draw is asked of an all-zero residual row."""
    w = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=dtype)
    for _ in range(20):
        idx = resample.residual(w.log())
        counts = torch.zeros(2, 4, dtype=dtype).scatter_add_(1, idx, torch.ones(2, 4, dtype=dtype))
        assert torch.equal(counts, 4 * w)
