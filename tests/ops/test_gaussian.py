import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops.gaussian import check_psd, damp, divide, is_proper, moment_change, multiply, psd_repair, to_moment, to_natural, tril_from_vector, tril_to_vector
from tests.property_cases import BATCH, BUG, F32, F64, FLOAT_DTYPES, PROPERTY, SEEDS, eps, gen, random_tril


def _random_gaussian(d, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g)
    return torch.randn(d, generator=g), a @ a.T + 0.5 * torch.eye(d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_natural_round_trip(seed):
    m, P = _random_gaussian(4, seed)
    m2, P2 = to_moment(*to_natural(m, P))
    assert torch.allclose(m, m2, atol=1e-10) and torch.allclose(P, P2, atol=1e-10)


def test_product_matches_dense_density_ratio():
    # log N(x|m1,P1) + log N(x|m2,P2) - log N(x|m,P) must be constant in x for the product (m, P).
    (m1, P1), (m2, P2) = _random_gaussian(3, 4), _random_gaussian(3, 5)
    m, P = to_moment(*multiply(to_natural(m1, P1), to_natural(m2, P2)))
    xs = torch.randn(10, 3)
    logp = [torch.distributions.MultivariateNormal(a, b).log_prob(xs) for a, b in ((m1, P1), (m2, P2), (m, P))]
    diff = logp[0] + logp[1] - logp[2]
    assert torch.allclose(diff, diff[0].expand_as(diff), atol=1e-10)


def test_divide_undoes_multiply_and_damping_interpolates():
    a, b = to_natural(*_random_gaussian(3, 6)), to_natural(*_random_gaussian(3, 7))
    back = divide(multiply(a, b), b)
    assert all(torch.allclose(x, y, atol=1e-10) for x, y in zip(back, a))
    assert damp(a, b, 1.0) is b
    half = damp(a, b, 0.5)
    assert torch.allclose(half[1], (a[1] + b[1]) / 2)
    # power: q / q_i^0.5
    assert torch.allclose(divide(a, b, 0.5)[1], a[1] - 0.5 * b[1])


def test_is_proper_and_psd_checks():
    assert bool(is_proper(torch.eye(2)))
    assert not bool(is_proper(torch.diag(torch.tensor([1.0, 0.0]))))
    assert is_proper(torch.stack([torch.eye(2), -torch.eye(2)])).tolist() == [True, False]
    check_psd("P", torch.eye(3))
    check_psd("P", torch.diag(torch.tensor([1.0, 0.0])), strict=False)
    with pytest.raises(ValueError, match="Q must be positive definite"):
        check_psd("Q", torch.diag(torch.tensor([1.0, -1.0])))
    with pytest.raises(ValueError, match="R must be symmetric"):
        check_psd("R", torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="S must be a square"):
        check_psd("S", torch.ones(2, 3))
    with pytest.raises(ValueError, match="S has non-finite"):
        check_psd("S", torch.full((2, 2), float("nan")))
    with pytest.raises(ValueError, match="semi-definite"):
        check_psd("S", torch.diag(torch.tensor([1.0, -1.0])), strict=False)


def test_psd_repair_clips_eigenvalues_only():
    m, P = _random_gaussian(4, 8)
    assert torch.allclose(psd_repair(P), P, atol=1e-10)
    bad = P - 2 * torch.linalg.eigvalsh(P).max() * torch.outer(torch.ones(4), torch.ones(4)) / 4
    fixed = psd_repair(bad, 1e-6)
    assert torch.linalg.eigvalsh(fixed).min() >= 1e-6 - 1e-12


# =================================================================================================
# Random shapes, dtypes and conditioning (hypothesis)
# =================================================================================================
@PROPERTY
@given(batch=BATCH, d=st.integers(1, 5), dtype=FLOAT_DTYPES, seed=SEEDS, log10_condition=st.floats(0.0, 3.0))
def test_natural_moment_round_trip(batch, d, dtype, seed, log10_condition):
    g = gen(seed)
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
@given(batch=BATCH, size=st.integers(1, 6), dtype=FLOAT_DTYPES, seed=SEEDS, scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_tril_vector_round_trip(batch, size, dtype, seed, scale):
    g = gen(seed)
    params = scale * torch.randn(*batch, size * (size + 1) // 2, generator=g, dtype=dtype)
    tril = tril_from_vector(params, size)
    assert tril.shape == batch + (size, size) and tril.dtype == dtype
    assert torch.isfinite(tril).all() and torch.equal(tril, tril.tril())
    assert (tril.diagonal(dim1=-2, dim2=-1) > 0).all()
    tol = 8 * eps(dtype) * (1 + scale)
    assert (tril_to_vector(tril) - params).abs().max() <= tol
    # And the other way round, from any lower-triangular factor with positive diagonal.
    factor = random_tril(batch, size, g, dtype)
    assert (tril_from_vector(tril_to_vector(factor), size) - factor).abs().max() <= 8 * eps(dtype)


# =================================================================================================
# Invalid input: each test failed before its fix
# =================================================================================================
@BUG
@given(size=st.integers(1, 5), seed=SEEDS, value=st.sampled_from([0.0, -0.5, -2.0]))
def test_tril_to_vector_rejects_a_non_positive_diagonal(size, seed, value):
    g = gen(seed)
    factor = random_tril((), size, g, F64)
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
    g = gen(seed)
    matrix = torch.eye(d, dtype=F64)
    i = int(torch.randint(d, (), generator=g))
    matrix[i, i] = value
    fn = to_natural if which == "to_natural" else to_moment
    with pytest.raises(ValueError):
        fn(torch.zeros(d, dtype=F64), matrix)


def test_moment_change_is_in_units_of_the_spread():
    """The change is the same after any rescaling of the state, and names the larger of the
    mean's and the covariance's relative change."""
    g = torch.Generator().manual_seed(0)
    m0, m1 = torch.randn(5, 2, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)
    a = torch.randn(5, 2, 2, generator=g, dtype=torch.float64)
    p0, p1 = a @ a.mT + torch.eye(2), a @ a.mT + 1.1 * torch.eye(2)
    change = moment_change(m1, p1, m0, p0)
    sd = torch.diagonal(p1, dim1=-2, dim2=-1).sqrt()
    expected = max(float(((m1 - m0).abs() / sd).max()), float(((p1 - p0).abs() / (sd[..., None] * sd[..., None, :])).max()))
    assert change == pytest.approx(expected, rel=1e-12)
    for s in (1e-6, 1e6):
        assert moment_change(s * m1, s**2 * p1, s * m0, s**2 * p0) == pytest.approx(change, rel=1e-9)


def test_check_psd_judges_symmetry_relative_to_the_matrix():
    """Before: asymmetry was compared with 1e-6 * max(1, largest entry), so a covariance of
    entries near 1e-6 passed whatever its upper triangle held, and the filters then read it
    neither as its lower triangle nor as its symmetric part. The same matrix scaled up fails
    as it always did; rounding-level asymmetry passes at any scale."""
    bad = torch.tensor([[1e-6, 9e-7], [0.0, 1e-6]], dtype=torch.float64)
    for scale in (1.0, 1e6, 1e-6):
        with pytest.raises(ValueError, match="Q must be symmetric"):
            check_psd("Q", scale * bad)
        good = scale * torch.tensor([[2.0, 0.5], [0.5 * (1 + 1e-9), 1.0]], dtype=torch.float64)
        check_psd("Q", good)
    check_psd("Q", torch.stack([torch.eye(2), 1e-9 * torch.eye(2)]))  # each matrix its own scale
