import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributions import MultivariateNormal, kl_divergence

import pyro_smc.distributions as pd
from pyro_smc.distributions import MatrixNormal
from pyro_smc.ops.kronecker import vec
from tests.property_cases import BATCH, BUG, F32, F64, FLOAT_DTYPES, PROPERTY, SEEDS, dense_kron, gen, random_tril
from tests.tolerances import EXACT_ATOL, EXACT_RTOL, MC_SIGMAS

SHAPES = [(1, 1), (3, 2), (2, 4)]
BATCHES = [(), (2,)]


def _vec(w):
    return w.transpose(-1, -2).reshape(*w.shape[:-2], w.shape[-1] * w.shape[-2])


def _tril(batch, d, g):
    lower = torch.randn(*batch, d, d, generator=g).tril(-1) * 0.5
    return lower + torch.diag_embed(torch.rand(*batch, d, generator=g) + 0.5)


def _random_mn(n, p, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return MatrixNormal(torch.randn(*batch, n, p, generator=g), _tril(batch, n, g), _tril(batch, p, g))


def _dense(d):
    """The same law as a MultivariateNormal on column-major vec(W), covariance kron(V, U), via torch.kron."""
    n, p = d.event_shape
    batch = d.batch_shape
    us = d.row_covariance.reshape(-1, n, n)
    vs = d.column_covariance.reshape(-1, p, p)
    cov = torch.stack([torch.kron(v, u) for u, v in zip(us, vs)]).reshape(*batch, n * p, n * p)
    return MultivariateNormal(_vec(d.loc), covariance_matrix=cov)


def _close(a, b, factor=100):
    return torch.allclose(a, b, rtol=EXACT_RTOL * factor, atol=EXACT_ATOL * factor)


def test_all_names_resolve():
    assert pd.__all__ == ["MatrixNormal"]
    assert pd.MatrixNormal is MatrixNormal


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n,p", SHAPES)
def test_log_prob_and_entropy_match_dense_mvn(n, p, batch):
    d = _random_mn(n, p, batch, seed=n + 10 * p)
    assert d.batch_shape == batch and d.event_shape == (n, p)
    mvn = _dense(d)
    w = d.sample((5,))
    assert w.shape == (5, *batch, n, p)
    assert _close(d.log_prob(w), mvn.log_prob(_vec(w)))
    assert _close(d.entropy(), mvn.entropy())
    assert _close(_vec(d.variance), mvn.variance)
    assert torch.equal(d.mean, d.loc)


def test_batch_broadcasting_and_expand():
    g = torch.Generator().manual_seed(1)
    loc, lr, lc = torch.randn(3, 1, 4, 2, generator=g), _tril((5,), 4, g), _tril((), 2, g)
    d = MatrixNormal(loc, lr, lc)
    assert d.batch_shape == (3, 5)
    w = d.sample()
    ref = MatrixNormal(loc[:, 0][1], lr[2], lc).log_prob(w[1, 2])
    assert _close(d.log_prob(w)[1, 2], ref)
    e = _random_mn(4, 2).expand((6,))
    assert e.batch_shape == (6,) and e.sample((2,)).shape == (2, 6, 4, 2)
    assert _close(e.log_prob(w[0, 0]), _random_mn(4, 2).log_prob(w[0, 0]).expand(6))


@pytest.mark.parametrize("n,p", [(3, 2), (2, 3)])
def test_sample_moments_within_mc_error_bars(n, p):
    d = _random_mn(n, p, seed=5)
    mvn = _dense(d)
    num = 20000
    x = _vec(d.sample((num,)))  # (num, np)
    # mean of each coordinate
    mean_err = (x.mean(0) - mvn.mean).abs()
    assert (mean_err < MC_SIGMAS * x.std(0) / num**0.5).all()
    # each covariance entry is the mean of z_i z_j with z centred at the true mean
    z = x - mvn.mean
    prods = z.unsqueeze(-1) * z.unsqueeze(-2)
    cov_err = (prods.mean(0) - mvn.covariance_matrix).abs()
    assert (cov_err < MC_SIGMAS * prods.std(0) / num**0.5).all()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("n,p", SHAPES)
def test_kl_matrix_normal_matches_dense_and_monte_carlo(n, p, batch):
    q, r = _random_mn(n, p, batch, seed=1), _random_mn(n, p, batch, seed=2)
    kl = kl_divergence(q, r)
    assert kl.shape == batch
    assert _close(kl, kl_divergence(_dense(q), _dense(r)))
    assert _close(kl_divergence(q, q), torch.zeros(batch), factor=1e4)
    num = 4000
    w = q.sample((num,))
    est = q.log_prob(w) - r.log_prob(w)
    assert ((est.mean(0) - kl).abs() < MC_SIGMAS * est.std(0) / num**0.5).all()


@pytest.mark.parametrize("prior_kind", ["isotropic", "elementwise", "batched"])
def test_kl_to_independent_normal_matches_dense_and_monte_carlo(prior_kind):
    n, p = 3, 2
    g = torch.Generator().manual_seed(4)
    if prior_kind == "isotropic":
        q = _random_mn(n, p, seed=3)
        prior = dist.Normal(0.0, 1.0).expand([n, p]).to_event(2)
    elif prior_kind == "elementwise":
        q = _random_mn(n, p, seed=3)
        prior = dist.Normal(torch.randn(n, p, generator=g), torch.rand(n, p, generator=g) + 0.5).to_event(2)
    else:  # batch (2,), scale broadcast along rows, Independent nested
        q = _random_mn(n, p, (2,), seed=3)
        prior = torch.distributions.Independent(
            torch.distributions.Independent(dist.Normal(torch.randn(2, n, p, generator=g), torch.rand(p, generator=g) + 0.5), 1), 1
        )
    kl = kl_divergence(q, prior)
    assert kl.shape == q.batch_shape
    loc, scale = prior.base_dist.mean, prior.base_dist.stddev
    dense_prior = MultivariateNormal(_vec(loc), covariance_matrix=torch.diag_embed(_vec(scale.pow(2).expand_as(loc))))
    assert _close(kl, kl_divergence(_dense(q), dense_prior))
    num = 4000
    w = q.sample((num,))
    est = q.log_prob(w) - prior.log_prob(w)
    assert ((est.mean(0) - kl).abs() < MC_SIGMAS * est.std(0) / num**0.5).all()


def test_kl_to_other_independent_is_not_implemented():
    q = _random_mn(2, 2)
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Laplace(0.0, 1.0).expand([2, 2]).to_event(2))
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Normal(0.0, 1.0).expand([2, 2, 2]).to_event(3))


def test_gradients_reach_every_parameter():
    g = torch.Generator().manual_seed(7)
    loc, lr, lc = torch.randn(3, 2, generator=g), _tril((), 3, g), _tril((), 2, g)
    w = torch.randn(3, 2, generator=g)
    params = [t.clone().requires_grad_(True) for t in (loc, lr, lc, w)]
    assert torch.autograd.gradcheck(lambda m, a, b, x: MatrixNormal(m, a.tril(), b.tril()).log_prob(x), params)
    # rsample is a reparametrised path: gradients flow to loc and both scale_trils
    m, a, b = (t.clone().requires_grad_(True) for t in (loc, lr, lc))
    MatrixNormal(m, a, b).rsample((4,)).pow(2).sum().backward()
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in (m, a, b))
    assert MatrixNormal.has_rsample


@pytest.mark.parametrize(
    "args,name",
    [
        ((torch.zeros(3), torch.eye(3), torch.eye(1)), "loc"),
        ((torch.zeros(3, 2), torch.eye(2), torch.eye(2)), "scale_tril_row"),
        ((torch.zeros(3, 2), torch.ones(3, 2), torch.eye(2)), "scale_tril_row"),
        ((torch.zeros(3, 2), torch.eye(3), torch.eye(3)), "scale_tril_col"),
        ((torch.zeros(2, 3, 2), torch.eye(3).expand(4, 3, 3), torch.eye(2)), "broadcast"),
    ],
)
def test_bad_shapes_raise_value_error_naming_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        MatrixNormal(*args)


def test_validate_args_rejects_non_cholesky_scale():
    with pytest.raises(ValueError, match="scale_tril_row"):
        MatrixNormal(torch.zeros(2, 2), -torch.eye(2), torch.eye(2), validate_args=True)


def test_float32():
    d = _random_mn(3, 2, (2,), seed=9)
    d32 = MatrixNormal(d.loc.float(), d.scale_tril_row.float(), d.scale_tril_col.float())
    prior32 = dist.Normal(torch.zeros(3, 2, dtype=torch.float32), 1.0).to_event(2)
    prior64 = dist.Normal(torch.zeros(3, 2), 1.0).to_event(2)
    w = d32.rsample((3,))
    assert w.dtype == torch.float32
    for a, b in [
        (d32.log_prob(w), d.log_prob(w.double())),
        (d32.entropy(), d.entropy()),
        (kl_divergence(d32, prior32), kl_divergence(d, prior64)),
        (kl_divergence(d32, d32), kl_divergence(d, d)),
    ]:
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4)


def _model():
    pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))


def _guide():
    loc = pyro.param("loc", torch.full((3, 2), 0.3))
    lr = pyro.param("lr", torch.eye(3) * 0.7, constraint=dist.constraints.lower_cholesky)
    lc = pyro.param("lc", torch.eye(2) * 1.2 + 0.1 * torch.ones(2, 2).tril(-1), constraint=dist.constraints.lower_cholesky)
    pyro.sample("w", MatrixNormal(loc, lr, lc))


def test_trace_mean_field_elbo_uses_analytic_kl():
    # With no observations the ELBO is -KL(q || p); TraceMeanField_ELBO returns it exactly (no sampling
    # noise), which is only possible through the registered closed form.
    loss = pyro.infer.TraceMeanField_ELBO().loss(_model, _guide)
    q = MatrixNormal(pyro.param("loc"), pyro.param("lr"), pyro.param("lc"))
    kl = float(kl_divergence(q, dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2)).detach())
    assert loss == pytest.approx(kl, rel=1e-10)
    assert loss == pyro.infer.TraceMeanField_ELBO().loss(_model, _guide)
    # Trace_ELBO's Monte Carlo estimate of the same loss agrees within error bars.
    num = 2000
    w = q.sample((num,))
    est = (q.log_prob(w) - dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2).log_prob(w)).detach()
    mc = pyro.infer.Trace_ELBO(num_particles=num, vectorize_particles=True, max_plate_nesting=0).loss(_model, _guide)
    assert abs(mc - loss) < MC_SIGMAS * float(est.std()) / num**0.5


def test_svi_step_runs_with_trace_mean_field_elbo():
    svi = pyro.infer.SVI(_model, _guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.TraceMeanField_ELBO())
    losses = [svi.step() for _ in range(20)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_log_prob_of_own_sample_is_exact_when_ill_conditioned():
    """Scoring a draw reuses its noise (no triangular solve), as the ELBO's guide term needs: with
    unit off-diagonals over 0.1 diagonals the float32 solve of a 20 x 24 sample returns -inf."""
    torch.manual_seed(0)
    n, p = 20, 24

    def ill(k):
        return torch.tril(torch.randn(k, k), -1) + 0.1 * torch.eye(k)

    d = MatrixNormal(torch.zeros(n, p), ill(n), ill(p))
    torch.manual_seed(1)
    w = d.rsample((3,))
    torch.manual_seed(1)
    eps = torch.randn(3, n, p).double()
    logdet = p * d.scale_tril_row.double().diagonal().log().sum() + n * d.scale_tril_col.double().diagonal().log().sum()
    exact = -0.5 * eps.square().sum((-2, -1)) - logdet - 0.5 * n * p * math.log(2 * math.pi)
    torch.testing.assert_close(d.log_prob(w).double(), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("sample_shape", [(), (4,)])
def test_log_prob_of_own_sample_has_the_gradients_of_the_density(sample_shape):
    """Before: scoring one's own draw from its noise gave a log density that did not depend on the
    draw, so its gradient in the value was silently zero (-1.82 where the truth is -0.46 for the
    path derivative of ``log p - log q``). Now the gradient in the value, and the total gradients
    in the mean and both scale factors, equal those of the density solved afresh (the draw as
    another tensor object, same graph), in float64 to rounding."""
    loc = torch.randn(2, 3, 2, generator=gen(2), dtype=F64).requires_grad_()
    row = random_tril((), 3, gen(3), F64).requires_grad_()
    col = random_tril((), 2, gen(4), F64).requires_grad_()
    d = MatrixNormal(loc, row, col)
    w = d.rsample(sample_shape)
    weights = torch.randn(w.shape[:-2], generator=gen(5), dtype=F64)
    own = (weights * d.log_prob(w)).sum()
    solved = (weights * d.log_prob(w + 0)).sum()  # not the remembered draw: the triangular solves
    assert _close(own, solved)
    for a, b in zip(torch.autograd.grad(own, (w, loc, row, col), retain_graph=True), torch.autograd.grad(solved, (w, loc, row, col))):
        assert _close(a, b)
    assert torch.autograd.grad((weights * d.log_prob(w)).sum(), w)[0].abs().max() > 0.1


@pytest.mark.parametrize("changed", ["draw", "loc", "scale_tril_col"])
def test_log_prob_of_a_draw_changed_in_place_is_recomputed(changed):
    """The remembered noise of the last draw holds only while neither the draw nor a parameter
    has changed: after ``w.add_(10)`` (or an optimiser's in-place step on ``loc``) it used to score
    the stale noise (-7.4 against the exact -203.8, no warning)."""
    d = _random_mn(3, 4, (), seed=0)
    w = d.rsample()
    with torch.no_grad():
        {"draw": w, "loc": d.loc, "scale_tril_col": d.scale_tril_col.diagonal()}[changed].add_(10.0 if changed == "draw" else 1.0)
    assert _close(d.log_prob(w), _dense(d).log_prob(_vec(w)))


# =================================================================================================
# Random shapes and dtypes against a dense MultivariateNormal (hypothesis)
# =================================================================================================
@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), batch=BATCH, dtype=FLOAT_DTYPES, seed=SEEDS)
def test_matrix_normal_matches_dense_mvn(n, p, batch, dtype, seed):
    g = gen(seed)
    loc = torch.randn(*batch, n, p, generator=g, dtype=dtype)
    row, col = random_tril(batch, n, g, dtype), random_tril(batch, p, g, dtype)
    d = MatrixNormal(loc, row, col)
    assert d.batch_shape == batch and d.event_shape == (n, p)
    value = loc + torch.randn(3, *batch, n, p, generator=g, dtype=dtype)
    lp = d.log_prob(value)
    assert lp.shape == (3,) + batch and lp.dtype == dtype and torch.isfinite(lp).all()
    cov = dense_kron((col @ col.mT).mT, row @ row.mT)  # V kron U (V symmetric)
    mvn = MultivariateNormal(vec(loc).double(), covariance_matrix=cov)
    ref = mvn.log_prob(vec(value).double())
    rtol = 1e-4 if dtype == F32 else 1e-10
    assert (lp.double() - ref).abs().max() <= rtol * (n * p + ref.abs().max())
    assert (d.entropy().double() - mvn.entropy()).abs().max() <= rtol * (n * p + mvn.entropy().abs().max())
    w = d.rsample((2,))
    assert w.shape == (2,) + batch + (n, p) and torch.isfinite(d.log_prob(w)).all()


# =================================================================================================
# Invalid scale factors
# =================================================================================================
INVALID_SCALES = ["upper", "zero_diagonal", "negative_diagonal", "nan", "wrong_size"]


@PROPERTY
@given(n=st.integers(1, 4), p=st.integers(1, 4), dtype=FLOAT_DTYPES, seed=SEEDS, which=st.sampled_from(["row", "col"]), kind=st.sampled_from(INVALID_SCALES))
def test_matrix_normal_rejects_invalid_scale_factors(n, p, dtype, seed, which, kind):
    g = gen(seed)
    size = n if which == "row" else p
    scale = random_tril((), size, g, dtype)
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
        scale = random_tril((), size + 1, g, dtype)
    row = scale if which == "row" else random_tril((), n, g, dtype)
    col = scale if which == "col" else random_tril((), p, g, dtype)
    with pytest.raises(ValueError, match=f"scale_tril_{which}"):
        MatrixNormal(torch.zeros(n, p, dtype=dtype), row, col)


@BUG
@given(n=st.integers(1, 3), p=st.integers(1, 3), dtype=FLOAT_DTYPES, which=st.sampled_from(["row", "col"]))
def test_matrix_normal_rejects_an_infinite_scale(n, p, dtype, which):
    size = n if which == "row" else p
    scale = torch.eye(size, dtype=dtype)
    scale[0, 0] = math.inf
    row = scale if which == "row" else torch.eye(n, dtype=dtype)
    col = scale if which == "col" else torch.eye(p, dtype=dtype)
    with pytest.raises(ValueError, match=f"scale_tril_{which}"):
        MatrixNormal(torch.zeros(n, p, dtype=dtype), row, col)


# =================================================================================================
# Inputs found by the property suite (issue 26); each failed before its fix
# =================================================================================================
def test_scale_trils_must_be_tensors():
    # Before: AttributeError: 'list' object has no attribute 'dim'.
    with pytest.raises(ValueError, match="scale_tril_row"):
        MatrixNormal(torch.zeros(2, 2), [[1.0, 0.0], [0.0, 1.0]], torch.eye(2))
    with pytest.raises(ValueError, match="scale_tril_col"):
        MatrixNormal(torch.zeros(2, 2), torch.eye(2), 1.0)


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", ["loc", "scale_tril_row", "scale_tril_col"])
def test_parameters_must_be_float32_or_float64(dtype, which):
    # Before: a long loc built a distribution whose rsample raised NotImplementedError, a bool loc
    # failed in log_prob, float16 log_prob raised "triangular_solve_cpu not implemented for 'Half'".
    args = {"loc": torch.zeros(3, 2), "scale_tril_row": torch.eye(3), "scale_tril_col": torch.eye(2)}
    args[which] = args[which].to(dtype)
    with pytest.raises(ValueError, match=which):
        MatrixNormal(**args)


@pytest.mark.parametrize("which", ["loc", "scale_tril_row", "scale_tril_col"])
def test_mixed_float_dtypes_are_promoted(which):
    # Before: log_prob promoted to float64 but rsample raised "expected m1 and m2 to have the same
    # dtype". Now every argument is promoted, as torch's broadcast_all does for Normal.
    args = {"loc": torch.zeros(3, 2, dtype=F32), "scale_tril_row": torch.eye(3, dtype=F32), "scale_tril_col": torch.eye(2, dtype=F32)}
    args[which] = 0.5 * args[which].double() if which != "loc" else args[which].double() + 1.0
    d = MatrixNormal(**args)
    w = d.rsample((2,))
    assert w.dtype == F64 and d.log_prob(w).dtype == F64 and d.entropy().dtype == F64
    reference = MatrixNormal(*(args[k].double() for k in ("loc", "scale_tril_row", "scale_tril_col")))
    torch.testing.assert_close(d.log_prob(w), reference.log_prob(w))
    # A value of another float dtype is promoted too (it was before).
    torch.testing.assert_close(reference.log_prob(w.float()), reference.log_prob(w.float().double()))


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_loc_must_be_finite(value):
    # Before: accepted (torch's `real` constraint only rejects NaN); every log_prob was -inf or NaN.
    loc = torch.zeros(3, 2)
    loc[1, 0] = value
    with pytest.raises(ValueError, match="loc"):
        MatrixNormal(loc, torch.eye(3), torch.eye(2))


@pytest.mark.parametrize("shape", [(0, 2), (2, 0), (0, 0), (0, 3, 2)])
def test_empty_shapes_are_errors_naming_loc(shape):
    # Before: IndexError "min(): Expected reduction dim 0 to have non-zero size" or RuntimeError
    # "cannot reshape tensor of 0 elements" from torch's constraint checks.
    n, p = shape[-2:]
    with pytest.raises(ValueError, match="loc"):
        MatrixNormal(torch.zeros(shape), torch.eye(n), torch.eye(p))
