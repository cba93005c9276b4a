"""The end of a Sinkhorn solve: finished problems leaving the working set, and the result.

See :mod:`pyro_smc.ops.sinkhorn_solver`, whose loop calls these. On large batches, problems
that meet the stopping rule are recorded (potentials, diagnostics and, for callers that reuse
it, the plan in factored form, :class:`PlanKernel`) and leave the loop by copies of the working
set (``compact``), whose later iterations are then cheaper. ``finish`` fills in the problems
still in the working set when the loop ends.

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
    >>> from pyro_smc.ops.sinkhorn_solver import solve_with_plan
    >>> cost = torch.rand(4, 6, 6, dtype=torch.float64)
    >>> log_w = torch.full((4, 6), -math.log(6), dtype=torch.float64)
    >>> result, plan = solve_with_plan(cost, log_w, log_w, SinkhornSettings(0.5))
    >>> isinstance(plan, PlanKernel), plan.kernel.shape, plan.u.shape
    (True, torch.Size([4, 6, 6]), torch.Size([4, 6]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn_types import SinkhornResult

if TYPE_CHECKING:
    from pyro_smc.ops.sinkhorn_solver import _Working as Working

# Shared with the solver, not part of the API.
__all__: list[str] = []


class PlanKernel(NamedTuple):
    r"""The plan of a solve in factored form, :math:`P = \operatorname{diag}(a u) \, K \operatorname{diag}(b v)` with
    the marginals :math:`a, b` (``exp(log_a)``, ``exp(log_b)``): the working kernel ``K`` ``(B, N, M)`` (rows and
    columns of zero-mass points zeroed) and the scalings ``u`` ``(B, N)``, ``v`` ``(B, M)`` of
    the last (exact) row update. Callers that need the plan reuse it instead of rebuilding
    :math:`\exp((f + g - C) / \epsilon)`: a few passes and an exp over ``(B, N, M)``.

    Example:
        >>> import math, torch
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings, transport_plan
        >>> from pyro_smc.ops.sinkhorn_solver import solve_with_plan
        >>> cost = torch.rand(2, 4, 4, dtype=torch.float64)
        >>> log_w = torch.full((2, 4), -math.log(4), dtype=torch.float64)
        >>> result, (K, u, v) = solve_with_plan(cost, log_w, log_w, SinkhornSettings(0.5))
        >>> plan = (log_w.exp() * u).unsqueeze(-1) * K * (log_w.exp() * v).unsqueeze(-2)
        >>> direct = transport_plan(cost, log_w, log_w, result.f, result.g, 0.5)
        >>> torch.allclose(plan, direct)
        True
    """

    kernel: Tensor
    u: Tensor
    v: Tensor

    def unflatten(self, batch: torch.Size) -> PlanKernel:
        """The factors with the batch shape ``batch`` in place of ``B`` (views)."""
        return PlanKernel(
            self.kernel.reshape(batch + self.kernel.shape[1:]), self.u.reshape(batch + self.u.shape[1:]), self.v.reshape(batch + self.v.shape[1:])
        )

    def symmetric_(self, sqrt_a: Tensor | float, sqrt_b: Tensor) -> Tensor:
        r"""The adjoint's symmetric kernel :math:`P_{ij} / \sqrt{a_i b_j} = \sqrt{a_i} u_i K_{ij} \sqrt{b_j} v_j`,
        written over ``kernel`` (and returned): no exp over ``(B, N, M)``."""
        return self.kernel.mul_((sqrt_a * self.u).unsqueeze(-1)).mul_((sqrt_b * self.v).unsqueeze(-2))


@dataclass
class Finished:
    """Potentials, diagnostics and (if kept) the factored plan over the whole batch; rows of
    problems still in the working set (batch indices ``active``) are filled in by ``finish``."""

    active: Tensor
    f: Tensor
    g: Tensor
    converged: Tensor
    num_iterations: Tensor
    marginal_error: Tensor
    plan: PlanKernel | None


def potentials(w: Working, eps: float, rows: Tensor | slice = slice(None)) -> tuple[Tensor, Tensor]:
    """Potentials of the plan ``(u_exact, v)``: the last exact row update, so rows are exact."""
    return (w.f[rows] - eps * w.nlu_exact[rows]).squeeze(1), (w.g[rows] - eps * w.nlv[rows]).squeeze(1)


def record(w: Working, out: Finished, rows: Tensor, at: Tensor | slice, eps: float) -> None:
    """Copies the potentials and (if kept) the factored plan of working-set rows ``at`` to batch
    rows ``rows`` of ``out``; the kernel only when ``out`` does not hold the working kernel."""
    out.f[rows], out.g[rows] = potentials(w, eps, at)
    if out.plan is not None:
        if out.plan.kernel is not w.kernel:
            out.plan.kernel[rows] = w.kernel[at]
        out.plan.u[rows], out.plan.v[rows] = w.u_exact[at].squeeze(1), w.v[at].squeeze(1)


def compact(w: Working, out: Finished | None, done: Tensor, error: Tensor, iters: int, eps: float, keep_plan: bool) -> Finished:
    """Moves the finished problems' potentials, diagnostics and (``keep_plan``) factored plans
    to ``out`` and drops them from the working set (copies of its cost and kernel). The first
    compaction keeps the whole working kernel, which holds every finished problem's kernel."""
    finished, keep = done.nonzero().squeeze(-1), (~done).nonzero().squeeze(-1)
    if out is None:
        f, g = potentials(w, eps)
        iterations = torch.full(done.shape, iters, dtype=torch.long, device=done.device)
        plan = PlanKernel(w.kernel, w.u_exact.squeeze(1), w.v.squeeze(1)) if keep_plan else None
        active = torch.arange(done.shape[0], device=done.device)
        out = Finished(active, f, g, done.clone(), iterations, error.clone(), plan)
    rows = out.active[finished]
    record(w, out, rows, finished, eps)
    out.converged[rows] = True
    out.num_iterations[rows] = iters
    out.marginal_error[rows] = error[finished]
    out.active = out.active[keep]
    w.select(keep)
    return out


def finish(w: Working, out: Finished | None, done: Tensor, error: Tensor, iters: int, eps: float, keep_plan: bool) -> tuple[SinkhornResult, PlanKernel | None]:
    """The result over the whole flattened batch and (``keep_plan``) the factored plan."""
    if out is None:
        f, g = potentials(w, eps)
        plan = PlanKernel(w.kernel, w.u_exact.squeeze(1), w.v.squeeze(1)) if keep_plan else None
        return SinkhornResult(f, g, done, torch.full(done.shape, iters, dtype=torch.long, device=done.device), error), plan
    record(w, out, out.active, slice(None), eps)
    out.converged[out.active] = done
    out.num_iterations[out.active] = iters
    out.marginal_error[out.active] = error
    return SinkhornResult(out.f, out.g, out.converged, out.num_iterations, out.marginal_error), out.plan
