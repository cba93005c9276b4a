"""The resampler classes of pyro_smc.resamplers.

OTResampler reports its Sinkhorn solve: ``last_result`` after every call. The call contract and
its numbers are those of ``ensemble_transform``; ``last_result`` adds the solve's diagnostics (per
filter: converged, iterations, marginal error), detached. Then every class on random shapes and
weights (hypothesis; settings and strategies in tests/property_cases.py), a dominant weight, small
OT epsilon and bad inputs.
"""

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning, SinkhornResult
from pyro_smc.ops.weights import normalize
from pyro_smc.resamplers import MultinomialResampler, OTResampler, StratifiedResampler, SystematicResampler
from tests.cases import DTYPE_IDS, EPSILONS, ot_threshold, ulp
from tests.property_cases import FLOAT_DTYPES, PROPERTY, SEEDS, eps, gen, random_log_weights

DTYPES = [torch.float32, torch.float64]
GRADIENTS = ["implicit", "unroll", "last_step"]


def _cloud(batch, n, dtype, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch + (n, 2), generator=g, dtype=dtype)
    log_w = (spread * torch.randn(batch + (n,), generator=g, dtype=dtype)).log_softmax(-1)
    return x, log_w


@pytest.mark.parametrize("gradient", GRADIENTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_last_result_holds_per_filter_diagnostics_of_the_last_call(dtype, gradient):
    x, log_w = _cloud((4,), 50, dtype)
    resampler = OTResampler(epsilon=0.5, gradient=gradient, max_iter=1000)
    assert resampler.last_result is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        resampler({"x": x}, log_w)
    result = resampler.last_result
    assert isinstance(result, SinkhornResult)
    assert result.converged.shape == result.num_iterations.shape == result.marginal_error.shape == (4,)
    assert result.converged.dtype == torch.bool and bool(result.converged.all())
    assert result.num_iterations.dtype == torch.int64 and bool((result.num_iterations >= 1).all())
    assert result.marginal_error.dtype == dtype and bool((result.marginal_error < resampler.threshold).all())
    assert result.f.shape == result.g.shape == (4, 50)
    assert not any(t.requires_grad for t in result)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_last_result_reports_a_transport_cut_off_at_max_iter(dtype):
    x, log_w = _cloud((3,), 40, dtype, spread=3.0)
    resampler = OTResampler(epsilon=0.01, scaling=0.0, threshold=1e-6, max_iter=2)
    with pytest.warns(SinkhornConvergenceWarning):
        resampler({"x": x}, log_w)
    assert resampler.last_result.converged.tolist() == [False, False, False]
    assert resampler.last_result.num_iterations.tolist() == [2, 2, 2]


def test_last_result_is_replaced_by_each_call_and_follows_the_batch_shape():
    resampler = OTResampler(epsilon=0.5)
    x, log_w = _cloud((2, 3), 20, torch.float64)
    resampler({"x": x}, log_w)
    first = resampler.last_result
    assert first.converged.shape == (2, 3) and first.f.shape == (2, 3, 20)
    x, log_w = _cloud((), 20, torch.float64, seed=1)  # one filter, no batch dimension
    resampler({"x": x}, log_w)
    assert resampler.last_result is not first and resampler.last_result.converged.shape == ()


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_reporting_leaves_the_outputs_and_gradients_unchanged(gradient):
    x, log_w = _cloud((3,), 30, torch.float64, seed=2, spread=2.0)
    x.requires_grad_()
    log_w.requires_grad_()
    new, new_log_w = OTResampler(epsilon=0.3, threshold=1e-5, max_iter=500, gradient=gradient)({"x": x}, log_w)
    x_new, _ = ensemble_transform(x, log_w, 0.3, 0.75, 1e-5, 500, gradient)
    assert torch.equal(new["x"], x_new)
    assert torch.equal(new_log_w, torch.full_like(log_w, -math.log(30)))
    weights = torch.randn(30, 2, dtype=torch.float64)
    grads = torch.autograd.grad((new["x"] * weights).sum(), (x, log_w))
    expected = torch.autograd.grad((x_new * weights).sum(), (x, log_w))
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


def test_repr_shows_the_settings_not_the_diagnostics():
    resampler = OTResampler(epsilon=0.5)
    x, log_w = _cloud((2,), 10, torch.float64)
    resampler({"x": x}, log_w)
    assert "last_result" not in repr(resampler) and "epsilon=0.5" in repr(resampler)


# =================================================================================================
# The resampler classes: random shapes and weights (hypothesis), a dominant weight, small OT epsilon, bad inputs
# =================================================================================================
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
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    kind=RESAMPLERS,
    epsilon=st.sampled_from([0.1, 0.5, 1.0]),
    event=st.sampled_from([(), (2,), (2, 3)]),
    scale=st.sampled_from([0.0, 1.0, 5.0]),
    zero_fraction=st.sampled_from([0.0, 0.5]),
)
def test_resamplers(filters, n, dtype, seed, kind, epsilon, event, scale, zero_fraction):
    g = gen(seed)
    lw = random_log_weights(filters + (n,), g, dtype, scale, zero_fraction)
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
    slack = 16 * eps(dtype) * (1 + float(x.abs().max()))
    assert ((x_new >= x.amin(-2, keepdim=True) - slack) & (x_new <= x.amax(-2, keepdim=True) + slack)).all()
    # ... and the weighted mean is preserved up to the plan's marginal errors (an identity).
    col = (plan.sum(-2) - lw.exp()).abs().sum(-1)
    row = (plan.sum(-1) - 1 / n).abs().sum(-1)
    err = (x_new.mean(-2) - (lw.exp().unsqueeze(-1) * x).sum(-2)).abs().amax(-1)
    assert (err <= (col + row) * x.abs().amax((-1, -2)) + slack * n).all()


INDEX_RESAMPLERS = [SystematicResampler, StratifiedResampler, MultinomialResampler]


@pytest.mark.parametrize("resampler", INDEX_RESAMPLERS + [OTResampler], ids=lambda r: r.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_resampler_classes_with_a_dominant_weight(dtype, resampler):
    n, k = 16, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, 2, generator=g, dtype=dtype)
    lw = normalize(torch.full((3, n), -1e4, dtype=dtype).index_fill_(-1, torch.tensor([k]), 0.0))[0]
    new, new_lw = resampler()({"x": x, "label": torch.arange(n).expand(3, n)}, lw)
    assert new["x"].dtype == dtype and torch.isfinite(new["x"]).all()
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    # Every particle becomes particle k (the OT map moves the whole mass onto it as well).
    assert torch.allclose(new["x"], x[:, k : k + 1].expand(3, n, 2), atol=10 * ulp(dtype, 1.0) * float(x.abs().max()))
    assert (new["label"] == k).all()


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ot_resampler_small_epsilon_preserves_the_weighted_mean(dtype, epsilon):
    """The barycentric map moves every particle to a convex combination of the particles, and the
    equally weighted mean of the result is the weighted mean of the input (to the marginal error
    of the plan, at most 30 * threshold * max|x|, plus rounding)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, 2, generator=g, dtype=dtype)
    x[0, 0] = 8.0  # an outlier: the normalised cost of most pairs is then tiny
    lw = (2 * torch.randn(4, 64, generator=g, dtype=dtype)).log_softmax(-1)
    threshold = ot_threshold(dtype)
    new, new_lw = OTResampler(epsilon, threshold=threshold, max_iter=20000)({"x": x}, lw)
    assert new["x"].dtype == dtype and torch.isfinite(new["x"]).all()
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(64)))
    target = (lw.exp().unsqueeze(-1) * x).sum(-2)
    scale = float(x.abs().max())
    assert (new["x"].mean(-2) - target).abs().max() <= (30 * threshold + 200 * torch.finfo(dtype).eps) * scale
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    slack = 10 * ulp(dtype, scale)
    assert ((new["x"] >= lo - slack) & (new["x"] <= hi + slack)).all()


@pytest.mark.parametrize("bad", [-math.inf, math.nan], ids=["all_-inf", "nan"])
def test_ot_resampler_rejects_invalid_log_weights(bad):
    with pytest.raises(ValueError, match="log_a and log_b"):
        OTResampler(0.5)({"x": torch.randn(2, 6, 1)}, torch.full((2, 6), bad))


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.5)], ids=["systematic", "ot"])
def test_resampler_rejects_particles_of_the_wrong_length(resampler):
    with pytest.raises(ValueError, match="x"):
        resampler({"x": torch.randn(3, 2)}, torch.full((4,), -math.log(4)))
