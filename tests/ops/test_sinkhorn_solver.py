"""The forward solver's paths: the factored plan it hands to the ensemble transform, compaction by
copies (large batches), and the log-domain absorption when scalings
overflow, in float32 and float64. Oracle: the plan rebuilt from the returned potentials
(``transport_plan``), and the exact marginals."""

import math

import pytest
import torch

import pyro_smc.ops.sinkhorn_solver as solver
from pyro_smc.ops.sinkhorn import SinkhornSettings, squared_distances, transport_plan
from pyro_smc.ops.sinkhorn_kernel import flush_denormals
from tests.cases import DTYPE_IDS, DTYPES


def _problem(dtype, batch=6, n=40, seed=0, spread=3.0, zero_mass=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, 2, generator=g, dtype=dtype)
    cost = squared_distances(x, x)
    cost = cost / cost.mean((-1, -2), keepdim=True)
    log_a = torch.full((batch, n), -math.log(n), dtype=dtype)
    log_b = (spread * torch.randn(batch, n, generator=g, dtype=dtype)).log_softmax(-1)
    if zero_mass:  # points of zero mass, and one of mass below the dtype's range
        log_b[0, :3] = -math.inf
        log_b[1, 5] = -1e4
        log_b = log_b - log_b.logsumexp(-1, keepdim=True)
    return cost, log_a, log_b


def _factored(plan, log_a, log_b):
    kernel, u, v = plan
    return (log_a.exp() * u).unsqueeze(-1) * kernel * (log_b.exp() * v).unsqueeze(-2)


def _count_absorptions(monkeypatch):
    calls = []
    absorb = solver._absorb

    def counting(*args):
        calls.append(args[2])
        return absorb(*args)

    monkeypatch.setattr(solver, "_absorb", counting)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("drop", [False, True], ids=["masks", "copies"])
def test_the_factored_plan_is_the_plan_of_the_returned_potentials(dtype, drop, monkeypatch):
    """Problems converge at different iterations (and, on large batches, leave the working set
    by copies; both sizes forced here); each keeps the plan of its own potentials."""
    monkeypatch.setattr(solver, "_COMPACT_MIN_SIZE", 0 if drop else 1 << 62)
    cost, log_a, log_b = _problem(dtype)
    settings = SinkhornSettings(0.1, threshold=1e-6 if dtype == torch.float64 else 1e-4, max_iter=5000)
    with torch.no_grad():
        result, plan = solver.solve_with_plan(cost, log_a, log_b, settings)
    assert len(set(result.num_iterations.tolist())) > 1 and bool(result.converged.all())
    direct = transport_plan(cost, log_a, log_b, result.f, result.g, 0.1)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert torch.allclose(_factored(plan, log_a, log_b), direct, rtol=1e-4 if dtype == torch.float32 else 1e-9, atol=tol)
    # Exact rows, columns within the threshold; zero-mass columns carry nothing.
    factored = _factored(plan, log_a, log_b)
    assert (factored.sum(-1) - log_a.exp()).abs().sum(-1).max() < 100 * torch.finfo(dtype).eps
    assert (factored.sum(-2) - log_b.exp()).abs().sum(-1).max() < settings.threshold
    assert bool((plan.kernel[0, :, :3] == 0).all()) and bool((plan.kernel[1, :, 5] == 0).all())
    monkeypatch.setattr(solver, "_COMPACT_MIN_SIZE", 1 << 62 if drop else 0)
    with torch.no_grad():
        other, other_plan = solver.solve_with_plan(cost, log_a, log_b, settings)
    # Copies stop each problem at its compaction, masks run every problem to the end: two
    # solutions of the same fixed point, each within the threshold.
    assert torch.equal(result.converged, other.converged)
    other_factored = _factored(other_plan, log_a, log_b)
    assert (other_factored.sum(-2) - log_b.exp()).abs().sum(-1).max() < settings.threshold
    assert (other_factored - factored).abs().sum((-1, -2)).max() < 2 * settings.threshold


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_overflowing_scalings_are_absorbed_and_the_plan_stays_exact(dtype, monkeypatch):
    """At epsilon 0.002 without annealing the kernel exp(-C / eps) underflows for far points: the
    scalings overflow and the loop absorbs them by exact log-domain updates (a column that
    underflows at the start included). The returned plan still has exact rows and columns
    within the threshold."""
    calls = _count_absorptions(monkeypatch)
    cost, log_a, log_b = _problem(dtype, batch=3, n=25, seed=3, spread=1.0, zero_mass=False)
    settings = SinkhornSettings(0.002, scaling=0.0, threshold=1e-3, max_iter=20000)
    with torch.no_grad(), flush_denormals():
        result, plan = solver.solve_with_plan(cost, log_a, log_b, settings)
    assert calls and bool(result.converged.all())
    factored = _factored(plan, log_a, log_b)
    assert torch.isfinite(factored).all()
    assert (factored.sum(-1) - log_a.exp()).abs().sum(-1).max() < 1e-4
    assert (factored.sum(-2) - log_b.exp()).abs().sum(-1).max() < 1e-3
    direct = transport_plan(cost, log_a, log_b, result.f, result.g, 0.002)
    assert (direct - factored).abs().sum((-1, -2)).max() < 1e-3


def test_a_column_that_underflows_at_the_start_is_repaired_by_the_first_absorption(monkeypatch):
    """One target point far from every source (float32, epsilon 0.02: exp(-4 / 0.02) underflows): its kernel column is 0,
    its first scaling infinite, and the first iteration overflows into an absorption."""
    calls = _count_absorptions(monkeypatch)
    x = torch.linspace(0, 1, 8, dtype=torch.float32).unsqueeze(-1)
    y = torch.cat([x[:-1], torch.tensor([[3.0]], dtype=torch.float32)])
    cost = squared_distances(x, y)
    log_a = torch.full((8,), -math.log(8), dtype=torch.float32)
    with torch.no_grad():
        result, plan = solver.solve_with_plan(cost, log_a, log_a, SinkhornSettings(0.02, scaling=0.0, threshold=1e-4, max_iter=5000))
    assert calls[0] is True  # an overflow, at the first iteration
    assert bool(result.converged) and torch.isfinite(result.f).all() and torch.isfinite(result.g).all()
    factored = _factored(plan, log_a.unsqueeze(0), log_a.unsqueeze(0))[0]
    assert torch.allclose(factored.sum(-2), log_a.exp(), atol=1e-4)
    assert float(factored[:, -1].sum()) == pytest.approx(1 / 8, abs=1e-4)


def test_forward_solve_under_autograd_neither_compacts_nor_keeps_a_plan():
    cost, log_a, log_b = _problem(torch.float64, batch=3, zero_mass=False)
    cost.requires_grad_()
    result = solver.forward_solve(cost, log_a, log_b, SinkhornSettings(0.1, threshold=1e-8, max_iter=5000))
    assert result.f.requires_grad and len(set(result.num_iterations.tolist())) == 1
    plan = transport_plan(cost, log_a, log_b, result.f, result.g, 0.1)
    assert (plan.sum(-2) - log_b.exp()).abs().sum(-1).max() < 1e-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_row_products_match_bmm_for_every_row_count(dtype, transposed):
    """``row_products`` pads row counts of 3 modulo 4 with a zero row (a faster BLAS path) and
    drops its product: every count, padded or not, gives ``bmm``'s answer, on a kernel given
    as is or as a transposed view."""
    from pyro_smc.ops.sinkhorn_kernel import row_products

    gen = torch.Generator().manual_seed(0)
    kernel = torch.rand(3, 9, 7, generator=gen, dtype=dtype)
    kernel = kernel.transpose(1, 2) if transposed else kernel
    for q in range(1, 13):
        rows = torch.randn(3, q, kernel.shape[1], generator=gen, dtype=dtype)
        got = row_products(rows, kernel)
        assert got.shape == (3, q, kernel.shape[2])
        # The padded product may sum in another order: rounding of the dtype, no more.
        tol = 1e-5 if dtype == torch.float32 else 1e-13
        torch.testing.assert_close(got, torch.bmm(rows, kernel), rtol=tol, atol=tol)
