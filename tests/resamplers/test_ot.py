"""OTResampler (pyro_smc/resamplers/ot.py).

OTResampler reports its Sinkhorn solve in ``resample(...).diagnostics``. The call contract and
its numbers are those of ``ensemble_transform``; the diagnostics add the solve's per-filter
convergence, iterations and marginal error, detached. Then small OT epsilon and bad inputs. The
contract every resampler class shares (random shapes and weights, a dominant weight) is in
tests/resamplers/test_base.py.
"""

import math
import warnings

import pytest
import torch

from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning, SinkhornResult
from pyro_smc.resamplers import OTResampler
from tests.cases import DTYPE_IDS, EPSILONS, ot_threshold, ulp

DTYPES = [torch.float32, torch.float64]
GRADIENTS = ["implicit", "unroll", "last_step"]


def _cloud(batch, n, dtype, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch + (n, 2), generator=g, dtype=dtype)
    log_w = (spread * torch.randn(batch + (n,), generator=g, dtype=dtype)).log_softmax(-1)
    return x, log_w


@pytest.mark.parametrize("gradient", GRADIENTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_diagnostics_hold_per_filter_results_of_the_call(dtype, gradient):
    x, log_w = _cloud((4,), 50, dtype)
    resampler = OTResampler(epsilon=0.5, gradient=gradient, max_iter=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        result = resampler.resample({"x": x}, log_w).diagnostics
    assert isinstance(result, SinkhornResult)
    assert result.converged.shape == result.num_iterations.shape == result.marginal_error.shape == (4,)
    assert result.converged.dtype == torch.bool and bool(result.converged.all())
    assert result.num_iterations.dtype == torch.int64 and bool((result.num_iterations >= 1).all())
    assert result.marginal_error.dtype == dtype and bool((result.marginal_error < resampler.threshold).all())
    assert result.f.shape == result.g.shape == (4, 50)
    assert not any(t.requires_grad for t in result)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_diagnostics_report_a_transport_cut_off_at_max_iter(dtype):
    x, log_w = _cloud((3,), 40, dtype, spread=3.0)
    resampler = OTResampler(epsilon=0.01, scaling=0.0, threshold=1e-6, max_iter=2)
    with pytest.warns(SinkhornConvergenceWarning):
        result = resampler.resample({"x": x}, log_w).diagnostics
    assert result.converged.tolist() == [False, False, False]
    assert result.num_iterations.tolist() == [2, 2, 2]


def test_diagnostics_are_returned_by_each_call_and_follow_the_batch_shape():
    resampler = OTResampler(epsilon=0.5)
    x, log_w = _cloud((2, 3), 20, torch.float64)
    first = resampler.resample({"x": x}, log_w).diagnostics
    assert first.converged.shape == (2, 3) and first.f.shape == (2, 3, 20)
    x, log_w = _cloud((), 20, torch.float64, seed=1)  # one filter, no batch dimension
    second = resampler.resample({"x": x}, log_w).diagnostics
    assert second is not first and second.converged.shape == ()


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
    assert not any(name.startswith("_last") or name.startswith("last") for name in vars(resampler))


# =================================================================================================
# Small OT epsilon, bad inputs
# =================================================================================================
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
    with pytest.raises(ValueError, match="log_weights must sum to one"):
        OTResampler(0.5)({"x": torch.randn(2, 6, 1)}, torch.full((2, 6), bad))


@pytest.mark.parametrize("gradient", GRADIENTS)
@pytest.mark.parametrize("with_label", [False, True], ids=["one_transport", "label_wise"])
def test_the_transport_does_not_depend_on_the_units_of_a_coordinate(gradient, with_label):
    """Rescaling one coordinate (metres to millimetres) rescales the new particles the same way
    and leaves the gradients consistent: each coordinate is measured on its own spread. With one
    scale for all (the widest coordinate's), a coordinate 1000x narrower than another was
    transported as if it were constant."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 40, 3, generator=g, dtype=torch.float64).requires_grad_()
    log_w = (1.5 * torch.randn(4, 40, generator=g, dtype=torch.float64)).log_softmax(-1).requires_grad_()
    units = torch.tensor([1.0, 1e3, 1e-2], dtype=torch.float64)
    label = {"z": torch.randint(2, (4, 40), generator=g)} if with_label else {}
    probe = torch.randn(4, 40, 3, generator=g, dtype=torch.float64)
    outs = []
    for scale in (torch.ones(3, dtype=torch.float64), units):
        resampler = OTResampler(0.3, threshold=1e-10, max_iter=5000, gradient=gradient)
        torch.manual_seed(0)  # the same offspring draw with a label
        new, new_log_w = resampler({"x": x * scale, **label}, log_w)
        value = new["x"] / scale
        gx, gw = torch.autograd.grad((value * probe).sum() + new_log_w.sum(), (x, log_w))
        outs.append((value, gx, gw))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-9)
