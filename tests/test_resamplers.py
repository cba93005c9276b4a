"""OTResampler reports its Sinkhorn solve: ``last_result`` after every call.

The call contract and its numbers are those of ``ensemble_transform``; ``last_result`` adds the
solve's diagnostics (per filter: converged, iterations, marginal error), detached.
"""

import math
import warnings

import pytest
import torch

from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning, SinkhornResult
from pyro_smc.resamplers import OTResampler

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
