"""Property-based tests (hypothesis) of the public numerical boundaries: random shapes, float32 and
float64, extreme and invalid values. Each property demands a correct result or a clear
``ValueError``; never NaN, never a silent wrong answer.

Random tensors come from a ``torch.Generator`` seeded by a hypothesis-drawn integer (so shrinking
works on shapes, dtypes and special values, and every example is reproducible). Examples are
derandomised, so a run is deterministic. The library bugs the properties found (since fixed) are
pinned by the regression properties at the end of the file.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributions import MultivariateNormal

from pyro_smc.distributions import MatrixNormal
from pyro_smc.ops import resample
from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.gaussian import to_moment, to_natural, tril_from_vector, tril_to_vector
from pyro_smc.ops.kronecker import kron_logdet, kron_matvec, kron_solve, vec
from pyro_smc.ops.sinkhorn import sinkhorn, squared_distances, transport_plan
from pyro_smc.ops.weights import ess, log_mean_exp, normalize
from pyro_smc.regression import QuadraticRegressor
from pyro_smc.resamplers import MultinomialResampler, OTResampler, StratifiedResampler, SystematicResampler

# The autouse fixture of conftest.py (float64 default dtype, seeds) runs once per test, not per
# example; every property below passes its dtype explicitly, so that is harmless.
# No example database and no explain phase: nothing is written under .hypothesis/.
PROPERTY = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# For the regression properties of fixed bugs: report the first failing example as it is (no
# shrinking, no explanation phase, a single exception), so a regression is reported fast.
BUG = settings(PROPERTY, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)

F32, F64 = torch.float32, torch.float64
DTYPES = st.sampled_from([F32, F64])
SEEDS = st.integers(0, 2**31 - 1)
BATCH = st.lists(st.integers(1, 3), max_size=2).map(tuple)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _eps(dtype):
    return torch.finfo(dtype).eps


def _tril(shape, d, g, dtype, garbage=False):
    """Lower triangular, diagonal in [0.5, 1.5], off-diagonal N(0, 0.3^2); ``garbage`` fills the
    strict upper triangle with noise (for functions documented to read one triangle only)."""
    lower = (0.3 * torch.randn(*shape, d, d, generator=g, dtype=dtype)).tril(-1)
    out = lower + torch.diag_embed(0.5 + torch.rand(*shape, d, generator=g, dtype=dtype))
    if garbage:
        out = out + torch.randn(*shape, d, d, generator=g, dtype=dtype).triu(1)
    return out


def _log_weights(shape, g, dtype, scale, zero_fraction):
    """Normalised log-weights with a fraction of -inf entries (never a whole row)."""
    lw = (scale * torch.randn(shape, generator=g, dtype=F64)).to(dtype)
    zero = torch.rand(shape, generator=g) < zero_fraction
    keep = torch.randint(shape[-1], shape[:-1] + (1,), generator=g)
    zero.scatter_(-1, keep, False)
    return normalize(lw.masked_fill(zero, -math.inf))[0]


# =================================================================================================
# pyro_smc.ops.weights
# =================================================================================================
@PROPERTY
@given(
    batch=BATCH,
    n=st.integers(1, 40),
    dtype=DTYPES,
    seed=SEEDS,
    scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]),
    offset=st.floats(-1e4, 1e4),
    shift=st.floats(-1e4, 1e4),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_weights_functions(batch, n, dtype, seed, scale, offset, shift, zero_fraction):
    g = _gen(seed)
    shape = batch + (n,)
    lw = (offset + scale * torch.randn(shape, generator=g, dtype=F64)).to(dtype)
    zero = torch.rand(shape, generator=g) < zero_fraction
    zero.scatter_(-1, torch.randint(n, batch + (1,), generator=g), False)
    lw = lw.masked_fill(zero, -math.inf)
    finite = torch.isfinite(lw)
    magnitude = float(lw[finite].abs().max()) + 1.0
    tol = 16 * _eps(dtype) * magnitude

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
    shift_tol = 16 * _eps(dtype) * (magnitude + abs(shift))
    assert (shifted_lw - nlw)[finite].abs().max() <= shift_tol
    assert (shifted_sum.double() - log_sum.double() - shift).abs().max() <= shift_tol


# =================================================================================================
# Resampling schemes (pyro_smc.ops.resample) and resamplers (pyro_smc.resamplers)
# =================================================================================================
SCHEMES = st.sampled_from([resample.systematic, resample.stratified, resample.multinomial])


@PROPERTY
@given(
    batch=BATCH,
    n=st.integers(1, 40),
    dtype=DTYPES,
    seed=SEEDS,
    scheme=SCHEMES,
    scale=st.sampled_from([0.0, 1.0, 5.0, 1e4]),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_index_resampling(batch, n, dtype, seed, scheme, scale, zero_fraction):
    g = _gen(seed)
    lw = _log_weights(batch + (n,), g, dtype, scale, zero_fraction)
    torch.manual_seed(seed)
    idx = scheme(lw)
    assert idx.shape == lw.shape and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < n)).all()
    assert torch.isfinite(lw.gather(-1, idx)).all()  # a zero-weight particle is never an ancestor
    if scheme is not resample.multinomial:
        # Inverse-CDF schemes on sorted points: ancestors are sorted, and systematic resampling
        # gives every particle floor(N w) or ceil(N w) offspring (up to the rounding of N w).
        assert (idx.diff(dim=-1) >= 0).all()
    if scheme is resample.systematic:
        counts = torch.zeros(lw.shape, dtype=F64).scatter_add_(-1, idx, torch.ones(lw.shape, dtype=F64))
        expected = n * lw.double().exp()
        slack = 1e-3 if dtype == F32 else 1e-9
        assert ((counts >= (expected - slack).floor()) & (counts <= (expected + slack).ceil())).all()


@PROPERTY
@given(batch=BATCH, n=st.integers(1, 60), dtype=DTYPES, seed=SEEDS, scheme=SCHEMES)
def test_index_resampling_of_equal_weights(batch, n, dtype, seed, scheme):
    """Equal weights: systematic and stratified keep every particle exactly once."""
    lw = torch.full(batch + (n,), -math.log(n), dtype=dtype)
    torch.manual_seed(seed)
    idx = scheme(lw)
    assert idx.shape == lw.shape and ((idx >= 0) & (idx < n)).all()
    if scheme is not resample.multinomial:
        assert torch.equal(idx, torch.arange(n).expand(lw.shape))


RESAMPLERS = st.sampled_from(["systematic", "stratified", "multinomial", "ot"])


def _make_resampler(kind, epsilon):
    return (
        {"systematic": SystematicResampler, "stratified": StratifiedResampler, "multinomial": MultinomialResampler}[kind]()
        if kind != "ot"
        else OTResampler(epsilon)
    )


@PROPERTY
@given(
    filters=st.sampled_from([(), (2,)]),
    n=st.integers(1, 25),
    dtype=DTYPES,
    seed=SEEDS,
    kind=RESAMPLERS,
    epsilon=st.sampled_from([0.1, 0.5, 1.0]),
    event=st.sampled_from([(), (2,), (2, 3)]),
    scale=st.sampled_from([0.0, 1.0, 5.0]),
    zero_fraction=st.sampled_from([0.0, 0.5]),
)
def test_resamplers(filters, n, dtype, seed, kind, epsilon, event, scale, zero_fraction):
    g = _gen(seed)
    lw = _log_weights(filters + (n,), g, dtype, scale, zero_fraction)
    a = torch.randn(filters + (n,) + event, generator=g, dtype=dtype)
    b = torch.randn(filters + (n, 2), generator=g, dtype=dtype)
    label = torch.arange(n).expand(filters + (n,))
    particles = {"a": a, "b": b, "label": label}
    torch.manual_seed(seed)
    new, new_lw = _make_resampler(kind, epsilon)(particles, lw)
    assert set(new) == set(particles)
    for key, value in particles.items():
        assert new[key].shape == value.shape and new[key].dtype == value.dtype
    assert new_lw.shape == lw.shape and new_lw.dtype == dtype
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    assert ((new["label"] >= 0) & (new["label"] < n)).all()
    if kind != "ot":
        # Every key takes the same ancestor, and no ancestor has zero weight.
        ancestors = new["label"]
        gather = ancestors.reshape(ancestors.shape + (1,) * len(event)).expand(a.shape)
        assert torch.equal(new["a"], a.gather(len(filters), gather))
        assert torch.equal(new["b"], b.gather(len(filters), ancestors.unsqueeze(-1).expand(b.shape)))
        assert torch.isfinite(lw.gather(-1, ancestors)).all()
        return
    # OT: the resampler is the ensemble transform of the concatenated float state.
    assert torch.isfinite(new["a"]).all() and torch.isfinite(new["b"]).all()
    x = torch.cat([a.reshape(filters + (n, -1)), b], -1)
    x_new, plan = ensemble_transform(x, lw, epsilon)
    width = x.shape[-1] - b.shape[-1]
    assert torch.allclose(new["a"].reshape(filters + (n, -1)), x_new[..., :width]) and torch.allclose(new["b"], x_new[..., width:])
    # Each new particle is a convex combination of the old ones ...
    slack = 16 * _eps(dtype) * (1 + float(x.abs().max()))
    assert ((x_new >= x.amin(-2, keepdim=True) - slack) & (x_new <= x.amax(-2, keepdim=True) + slack)).all()
    # ... and the weighted mean is preserved up to the plan's marginal errors (an identity).
    col = (plan.sum(-2) - lw.exp()).abs().sum(-1)
    row = (plan.sum(-1) - 1 / n).abs().sum(-1)
    err = (x_new.mean(-2) - (lw.exp().unsqueeze(-1) * x).sum(-2)).abs().amax(-1)
    assert (err <= (col + row) * x.abs().amax((-1, -2)) + slack * n).all()


# =================================================================================================
# Sinkhorn
# =================================================================================================
@PROPERTY
@given(
    batch=st.integers(1, 3),
    n=st.integers(1, 10),
    m=st.integers(1, 10),
    d=st.integers(1, 3),
    dtype=DTYPES,
    seed=SEEDS,
    epsilon=st.sampled_from([1.0, 0.3, 0.1, 0.03, 0.01]),
    spread=st.sampled_from([0.0, 1.0, 5.0]),
)
def test_sinkhorn_marginals_on_random_problems(batch, n, m, d, dtype, seed, epsilon, spread):
    """Costs normalised to [0, 1] (as the OT resampler normalises them). Rows of the returned plan
    are exact (the loop ends on a row update); columns within the threshold (plus the rounding of
    recomputing the plan). Over-relaxed iterations once broke this bound by up to 66x."""
    g = _gen(seed)
    x = torch.randn(batch, n, d, generator=g, dtype=dtype)
    y = torch.randn(batch, m, d, generator=g, dtype=dtype)
    cost = squared_distances(x, y)
    cost = cost / cost.amax((-1, -2), keepdim=True).clamp_min(1e-3)
    log_a = (spread * torch.randn(batch, n, generator=g, dtype=dtype)).log_softmax(-1)
    log_b = (spread * torch.randn(batch, m, generator=g, dtype=dtype)).log_softmax(-1)
    threshold = 1e-4 if dtype == F32 else 1e-6
    f, gg = sinkhorn(cost, log_a, log_b, epsilon, threshold=threshold, max_iter=20000)
    assert f.shape == (batch, n) and gg.shape == (batch, m) and f.dtype == gg.dtype == dtype
    assert torch.isfinite(f).all() and torch.isfinite(gg).all()
    plan = transport_plan(cost, log_a, log_b, f, gg, epsilon)
    assert torch.isfinite(plan).all() and (plan >= 0).all()
    assert (plan.sum(-1) - log_a.exp()).abs().sum(-1).max() <= 100 * _eps(dtype)
    assert (plan.sum(-2) - log_b.exp()).abs().sum(-1).max() <= threshold + 100 * _eps(dtype)


@PROPERTY
@given(n=st.integers(1, 8), dtype=DTYPES, seed=SEEDS, gap=st.floats(0.01, 50.0), sign=st.sampled_from([1.0, -1.0]))
def test_sinkhorn_rejects_unequal_masses(n, dtype, seed, gap, sign):
    g = _gen(seed)
    cost = torch.rand(2, n, n, generator=g, dtype=dtype)
    log_a = torch.randn(2, n, generator=g, dtype=dtype).log_softmax(-1)
    log_b = torch.randn(2, n, generator=g, dtype=dtype).log_softmax(-1)
    with pytest.raises(ValueError, match="equal total mass"):
        sinkhorn(cost, log_a, log_b + sign * gap, 0.5)


@PROPERTY
@given(epsilon=st.one_of(st.floats(max_value=0.0), st.just(math.nan)), dtype=DTYPES)
def test_sinkhorn_and_ensemble_transform_reject_non_positive_epsilon(epsilon, dtype):
    cost = torch.rand(1, 3, 3, dtype=dtype)
    log_a = torch.full((1, 3), -math.log(3), dtype=dtype)
    with pytest.raises(ValueError, match="epsilon"):
        sinkhorn(cost, log_a, log_a, epsilon)
    with pytest.raises(ValueError, match="epsilon"):
        ensemble_transform(torch.rand(1, 3, 2, dtype=dtype), log_a, epsilon)
    with pytest.raises(ValueError, match="epsilon"):
        OTResampler(epsilon)


# =================================================================================================
# pyro_smc.ops.kronecker against dense torch.kron
# =================================================================================================
def _dense_kron(b, a):
    """``B^T kron A`` in float64 by torch.kron, batch by batch."""
    n, p = a.shape[-1], b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    aa, bb = a.double().expand(batch + (n, n)).reshape(-1, n, n), b.double().expand(batch + (p, p)).reshape(-1, p, p)
    return torch.stack([torch.kron(y.T.contiguous(), x.contiguous()) for x, y in zip(aa, bb)]).reshape(batch + (n * p, n * p))


TRI = st.sampled_from([None, "lower", "upper"])


@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), batch=BATCH, dtype=DTYPES, seed=SEEDS, tri_a=TRI, tri_b=TRI)
def test_kronecker_ops_match_dense_kron(n, p, batch, dtype, seed, tri_a, tri_b):
    g = _gen(seed)

    def factor(size, tri):
        if tri is None:
            clean = torch.randn(*batch, size, size, generator=g, dtype=dtype) / math.sqrt(size) + 2 * torch.eye(size, dtype=dtype)
            return clean, clean
        clean = _tril(batch, size, g, dtype)
        clean = clean if tri == "lower" else clean.transpose(-1, -2)
        # The unused triangle holds garbage: a triangular solve must read only its own triangle.
        noise = torch.randn(*batch, size, size, generator=g, dtype=dtype)
        return clean, clean + (noise.triu(1) if tri == "lower" else noise.tril(-1))

    a, a_dirty = factor(n, tri_a)
    b, b_dirty = factor(p, tri_b)
    x = torch.randn(*batch, n, p, generator=g, dtype=dtype)
    dense = _dense_kron(b, a)
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


@PROPERTY
@given(bad=st.text(max_size=8).filter(lambda s: s not in ("lower", "upper")), which=st.sampled_from(["tri_a", "tri_b"]))
def test_kron_solve_rejects_unknown_triangle(bad, which):
    with pytest.raises(ValueError, match=which):
        kron_solve(torch.eye(2), torch.eye(3), torch.ones(2, 3), **{which: bad})


# =================================================================================================
# MatrixNormal against a dense MultivariateNormal
# =================================================================================================
@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), batch=BATCH, dtype=DTYPES, seed=SEEDS)
def test_matrix_normal_matches_dense_mvn(n, p, batch, dtype, seed):
    g = _gen(seed)
    loc = torch.randn(*batch, n, p, generator=g, dtype=dtype)
    row, col = _tril(batch, n, g, dtype), _tril(batch, p, g, dtype)
    d = MatrixNormal(loc, row, col)
    assert d.batch_shape == batch and d.event_shape == (n, p)
    value = loc + torch.randn(3, *batch, n, p, generator=g, dtype=dtype)
    lp = d.log_prob(value)
    assert lp.shape == (3,) + batch and lp.dtype == dtype and torch.isfinite(lp).all()
    cov = _dense_kron((col @ col.mT).mT, row @ row.mT)  # V kron U (V symmetric)
    mvn = MultivariateNormal(vec(loc).double(), covariance_matrix=cov)
    ref = mvn.log_prob(vec(value).double())
    rtol = 1e-4 if dtype == F32 else 1e-10
    assert (lp.double() - ref).abs().max() <= rtol * (n * p + ref.abs().max())
    assert (d.entropy().double() - mvn.entropy()).abs().max() <= rtol * (n * p + mvn.entropy().abs().max())
    w = d.rsample((2,))
    assert w.shape == (2,) + batch + (n, p) and torch.isfinite(d.log_prob(w)).all()


# An infinite diagonal entry is rejected too: a regression property at the end of the file.
INVALID_SCALES = ["upper", "zero_diagonal", "negative_diagonal", "nan", "wrong_size"]


@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), dtype=DTYPES, seed=SEEDS, which=st.sampled_from(["row", "col"]), kind=st.sampled_from(INVALID_SCALES))
def test_matrix_normal_rejects_invalid_scale_factors(n, p, dtype, seed, which, kind):
    g = _gen(seed)
    size = n if which == "row" else p
    scale = _tril((), size, g, dtype)
    i = int(torch.randint(size, (), generator=g))
    if kind == "upper":
        if size == 1:
            kind = "negative_diagonal"  # no strict upper triangle
        else:
            j = int(torch.randint(1, size, (), generator=g))
            scale[min(i, j - 1), j] = 0.7
    if kind == "zero_diagonal":
        scale[i, i] = 0.0
    elif kind == "negative_diagonal":
        scale[i, i] = -0.5
    elif kind == "nan":
        scale[i, int(torch.randint(i + 1, (), generator=g))] = math.nan
    elif kind == "wrong_size":
        scale = _tril((), size + 1, g, dtype)
    row = scale if which == "row" else _tril((), n, g, dtype)
    col = scale if which == "col" else _tril((), p, g, dtype)
    with pytest.raises(ValueError, match=f"scale_tril_{which}"):
        MatrixNormal(torch.zeros(n, p, dtype=dtype), row, col)


# =================================================================================================
# pyro_smc.ops.gaussian
# =================================================================================================
@PROPERTY
@given(batch=BATCH, d=st.integers(1, 5), dtype=DTYPES, seed=SEEDS, log10_condition=st.floats(0.0, 3.0))
def test_natural_moment_round_trip(batch, d, dtype, seed, log10_condition):
    g = _gen(seed)
    q, _ = torch.linalg.qr(torch.randn(*batch, d, d, generator=g, dtype=F64))
    eigenvalues = 10 ** (log10_condition * (torch.rand(*batch, d, generator=g, dtype=F64) - 0.5))
    cov = ((q * eigenvalues.unsqueeze(-2)) @ q.mT).to(dtype)
    cov = (cov + cov.mT) / 2
    mean = torch.randn(*batch, d, generator=g, dtype=dtype)
    eta, prec = to_natural(mean, cov)
    assert eta.shape == mean.shape and prec.shape == cov.shape and eta.dtype == prec.dtype == dtype
    assert torch.equal(prec, prec.mT)
    condition = 10**log10_condition
    tol = (1e-4 if dtype == F32 else 1e-11) * condition
    eye = torch.eye(d, dtype=F64)
    assert (prec.double() @ cov.double() - eye).abs().max() <= tol * d
    mean2, cov2 = to_moment(eta, prec)
    scale = float(cov.abs().max())
    assert (cov2.double() - cov.double()).abs().max() <= tol * d * scale
    assert (mean2.double() - mean.double()).abs().max() <= tol * d * (1 + float(mean.abs().max()))


@PROPERTY
@given(batch=BATCH, size=st.integers(1, 6), dtype=DTYPES, seed=SEEDS, scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_tril_vector_round_trip(batch, size, dtype, seed, scale):
    g = _gen(seed)
    params = scale * torch.randn(*batch, size * (size + 1) // 2, generator=g, dtype=dtype)
    tril = tril_from_vector(params, size)
    assert tril.shape == batch + (size, size) and tril.dtype == dtype
    assert torch.isfinite(tril).all() and torch.equal(tril, tril.tril())
    assert (tril.diagonal(dim1=-2, dim2=-1) > 0).all()
    tol = 8 * _eps(dtype) * (1 + scale)
    assert (tril_to_vector(tril) - params).abs().max() <= tol
    # And the other way round, from any lower-triangular factor with positive diagonal.
    factor = _tril(batch, size, g, dtype)
    assert (tril_from_vector(tril_to_vector(factor), size) - factor).abs().max() <= 8 * _eps(dtype)


# =================================================================================================
# pyro_smc.regression
# =================================================================================================
@PROPERTY
@given(
    d=st.integers(1, 4),
    k=st.integers(0, 3),
    dtype=DTYPES,
    seed=SEEDS,
    loc=st.sampled_from([0.0, 3.0, 100.0]),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    extra=st.integers(0, 40),
)
def test_quadratic_regressor_is_exact_on_quadratics(d, k, dtype, seed, loc, scale, extra):
    """Targets y = z^T A z + b^T z + c with z = (x - loc) / scale: the quadratic features span them,
    so the least-squares fit reproduces them everywhere (float64 with ridge 0: to rounding; float32
    with the default relative ridge 1e-8: to 1e-3 relative). ``k = 0`` means vector targets (N,)."""
    g = _gen(seed)
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
@given(n=st.integers(2, 30), d=st.integers(1, 4), dtype=DTYPES, seed=SEEDS, kind=st.sampled_from(INVALID_FITS))
def test_quadratic_regressor_rejects_invalid_data(n, d, dtype, seed, kind):
    g = _gen(seed)
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


# =================================================================================================
# Regression properties: one per bug these properties found (each failed before its fix).
# =================================================================================================
@BUG
@given(n=st.integers(1, 10), dtype=DTYPES, seed=SEEDS, bad=st.sampled_from([math.nan, math.inf]))
def test_normalize_rejects_nan_and_plus_inf_weights(n, dtype, seed, bad):
    lw = torch.randn(2, n, generator=_gen(seed), dtype=dtype)
    lw[1, int(torch.randint(n, (), generator=_gen(seed)))] = bad
    with pytest.raises(ValueError, match="log_weights"):
        normalize(lw)


@BUG
@given(scheme=SCHEMES, dtype=DTYPES)
def test_resampling_rejects_scalar_log_weights(scheme, dtype):
    with pytest.raises(ValueError, match="log_weights"):
        scheme(torch.zeros((), dtype=dtype))


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
    g = _gen(seed)
    a = _tril((), n, g, F64)
    a[int(torch.randint(n, (), generator=g)), :] = 0.0  # a zero row: singular
    y = torch.randn(n, p, generator=g, dtype=F64)
    with pytest.raises(ValueError):
        kron_solve(a, torch.eye(p, dtype=F64), y, tri_a="lower")


@BUG
@given(size=st.integers(1, 5), seed=SEEDS, value=st.sampled_from([0.0, -0.5, -2.0]))
def test_tril_to_vector_rejects_a_non_positive_diagonal(size, seed, value):
    g = _gen(seed)
    factor = _tril((), size, g, F64)
    i = int(torch.randint(size, (), generator=g))
    factor[i, i] = value
    with pytest.raises(ValueError, match="diagonal|scale_tril"):
        tril_to_vector(factor)


@BUG
@given(size=st.integers(1, 5), off=st.sampled_from([-1, 1, 2]))
def test_tril_from_vector_rejects_the_wrong_length(size, off):
    length = size * (size + 1) // 2 + off
    if length < 1:
        length = 2
    with pytest.raises(ValueError, match="params|size"):
        tril_from_vector(torch.zeros(length), size)


@BUG
@given(d=st.integers(1, 4), seed=SEEDS, which=st.sampled_from(["to_natural", "to_moment"]), value=st.sampled_from([0.0, -1.0]))
def test_gaussian_conversions_reject_non_positive_definite_matrices(d, seed, which, value):
    g = _gen(seed)
    matrix = torch.eye(d, dtype=F64)
    i = int(torch.randint(d, (), generator=g))
    matrix[i, i] = value
    fn = to_natural if which == "to_natural" else to_moment
    with pytest.raises(ValueError):
        fn(torch.zeros(d, dtype=F64), matrix)


@BUG
@given(n=st.integers(1, 3), p=st.integers(1, 3), dtype=DTYPES, which=st.sampled_from(["row", "col"]))
def test_matrix_normal_rejects_an_infinite_scale(n, p, dtype, which):
    size = n if which == "row" else p
    scale = torch.eye(size, dtype=dtype)
    scale[0, 0] = math.inf
    row = scale if which == "row" else torch.eye(n, dtype=dtype)
    col = scale if which == "col" else torch.eye(p, dtype=dtype)
    with pytest.raises(ValueError, match=f"scale_tril_{which}"):
        MatrixNormal(torch.zeros(n, p, dtype=dtype), row, col)


@BUG
@given(n=st.integers(2, 20), dtype=DTYPES)
def test_quadratic_regressor_rejects_zero_input_columns(n, dtype):
    with pytest.raises(ValueError, match="inputs"):
        QuadraticRegressor().fit(torch.zeros(n, 0, dtype=dtype), torch.zeros(n, dtype=dtype))
