r"""The forward Sinkhorn solver: its settings, epsilon scaling, stabilised kernel iterations and
a typed result.

See ``docs/math/smc.md#sinkhorn-in-the-log-domain`` and ``docs/math/smc.md#epsilon-scaling``.

The solver behind :func:`pyro_smc.ops.sinkhorn.sinkhorn` (whose module docstring describes the
algorithm and its gradients), cut into the stages of one solve:

1. ``_anneal``: epsilon scaling, one symmetric averaged log-domain update per level;
2. ``_start``: the log-stabilised kernel at the final epsilon, with the zero-mass masks
   and the log-domain fallback when a row or column of the kernel underflows;
3. ``_iteration``: one over-relaxed column-then-row update of the scalings;
4. ``_needs_absorption`` / ``_absorb``: the log-domain fallback when scalings overflow;
5. ``_check_convergence``: the per-problem stopping rule;
6. ``compact`` / ``freeze`` / ``finish`` (:mod:`pyro_smc.ops.sinkhorn_finish`): finished
   problems leave the working set; potentials and the factored plan are read off the scalings.

:func:`forward_solve` runs them under whatever autograd mode is active and returns a
:class:`SinkhornResult`: the potentials and, as detached per-problem diagnostics, whether each
problem met the stopping rule, after how many iterations and with what marginal error. Its
settings travel as one :class:`~pyro_smc.ops.sinkhorn.SinkhornSettings` (the types live in
:mod:`pyro_smc.ops.sinkhorn_types`; :mod:`pyro_smc.ops.sinkhorn` re-exports and documents them).

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
    >>> from pyro_smc.ops.sinkhorn_solver import forward_solve
    >>> cost = torch.rand(3, 6, 6, dtype=torch.float64)         # 3 problems, 6 x 6 points
    >>> log_w = torch.full((3, 6), -math.log(6), dtype=torch.float64)
    >>> result = forward_solve(
    ...     cost, log_w, log_w, SinkhornSettings(0.5, threshold=1e-6, max_iter=1000)
    ... )
    >>> result.converged.shape, bool(result.converged.all())
    (torch.Size([3]), True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn_kernel import (
    colsum,
    complete_zero_mass,
    log_domain_update,
    log_kernel,
    mask_kernel,
    rowsum,
    zero_mass,
)
from pyro_smc.ops.sinkhorn_finish import Finished, PlanKernel, compact, finish, freeze
from pyro_smc.ops.sinkhorn_types import SinkhornResult, SinkhornSettings, warn_unconverged

__all__ = ["forward_solve", "solve_with_plan", "PlanKernel"]


# Annealing starts at this fraction of the mean cost (see epsilon_schedule).
_ANNEAL_START = 0.25
# Scalings outside [1/_BIG, _BIG] are absorbed into the potentials and the kernel rebuilt, so
# the fast kernel-domain iterations never overflow (the log-stabilised Sinkhorn of Schmitzer).
_BIG = 1e15
# Over-relaxation: plain iterations used to estimate each problem's contraction rate, and the
# largest relaxation factor allowed.
_PLAIN_ITERS = 3
_MAX_OMEGA = 1.8
# Problems leave the working set as they converge only on batches of at least this many kernel
# entries (see forward_solve).
_COMPACT_MIN_SIZE = 1 << 20


def epsilon_schedule(cost: Tensor, epsilon: float, scaling: float) -> list[float]:
    """Annealing levels ``eps0 * scaling^k > epsilon`` (empty if off).

    ``eps0`` is a quarter of the mean cost. The textbook start, the maximum cost, is set by a few
    outlying pairs. Measured on particle clouds (32 x 100 points, float32, 1e-3 threshold), each
    level costs about three final-phase iterations, and starting at the mean cost bought fewer
    iterations than its levels cost at epsilon = 0.5 (8.6 ms against 3.0 ms without annealing)
    while a start at a quarter of it matched the best schedule at epsilon = 0.1 and 0.02.
    """
    eps0 = float(cost.detach().mean()) * _ANNEAL_START
    if not math.isfinite(eps0):
        raise ValueError("sinkhorn: the cost matrix has non-finite entries")
    if eps0 <= epsilon or not 0 < scaling < 1:
        return []
    steps = int(math.ceil(math.log(epsilon / eps0) / math.log(scaling)))
    return [eps0 * scaling**k for k in range(steps) if eps0 * scaling**k > epsilon]


def _relaxation(rate: Tensor) -> Tensor:
    r"""Per-problem over-relaxation factor from the observed contraction rate of plain Sinkhorn.

    Near the fixed point Sinkhorn is a linear iteration contracting by ``rate`` per step; the
    classical SOR choice :math:`\omega = 2 / (1 + \sqrt{1 - \mathrm{rate}})` (Thibault et al. 2017, Lehmann
    et al. 2021) makes it contract by about ``omega - 1`` instead. The early rate underestimates
    the asymptotic one, which errs towards the safe side (smaller omega).
    """
    rate = torch.nan_to_num(rate, nan=0.0, posinf=0.99).clamp(0, 0.99)
    return (2 / (1 + (1 - rate).sqrt())).clamp(1, _MAX_OMEGA).unsqueeze(-1)


def _annealing_step(cost: Tensor, a: Tensor, b: Tensor, f: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """One epsilon-scaling level: the symmetric, averaged update of Feydy et al. (2019).

    With the previous potentials absorbed the kernel is O(1) near its row/column maxima, so one
    kernel-domain update per level is safe; ``log`` of an underflowed sum gives ``-inf``, which
    ``_anneal`` resets and the log-domain update of ``_start`` repairs.
    """
    kernel = log_kernel(cost, f, g, eps).exp_()
    f_new = f - eps * torch.log(rowsum(kernel, b))
    g_new = g - eps * torch.log(colsum(kernel, a))
    return (f + f_new) / 2, (g + g_new) / 2


def _anneal(cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: float, scaling: float) -> tuple[Tensor, Tensor, bool]:
    """Epsilon scaling down to ``epsilon``: returns ``(f, g, annealed)``, zero potentials and
    ``False`` when the schedule is empty. Non-finite potentials are reset to zero."""
    f = torch.zeros_like(log_a)
    g = torch.zeros_like(log_b)
    schedule = epsilon_schedule(cost, epsilon, scaling)
    for eps in schedule:
        f, g = _annealing_step(cost, log_a.exp(), log_b.exp(), f, g, eps)
    if schedule:
        f = torch.where(torch.isfinite(f), f, torch.zeros_like(f))
        g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
    return f, g, bool(schedule)


def _relaxed(previous: Tensor, exact: Tensor, omega: Tensor) -> Tensor:
    """The over-relaxed scaling ``previous^(1 - omega) * exact^omega`` (a step of ``omega`` in log
    space), written as ``previous * exp(omega * log(exact / previous))``: one ``log`` and one
    ``exp`` instead of two ``pow``, which cost five times an ``exp`` each (19 against 55 us per
    update at 32 x 100, float32, one thread)."""
    return previous * torch.exp(omega * torch.log(exact / previous))


# The loop works on row vectors (B, 1, N) so that each product with the kernel is one bmm:
# ``x @ K`` on (B, N) vectors adds an unsqueeze, a squeeze and matmul's dispatch, about 12 us
# of the 47 us of one product at 32 x 100 x 100 (float32, one thread).
def _cols(kernel: Tensor, u: Tensor) -> Tensor:
    r""":math:`K^\top u` as a row vector ``(B, 1, M)`` for ``u`` of shape ``(B, 1, N)``."""
    return torch.bmm(u, kernel)


def _rows(kernel: Tensor, v: Tensor) -> Tensor:
    """``K v`` as a row vector ``(B, 1, N)`` for ``v`` of shape ``(B, 1, M)``."""
    return torch.bmm(v, kernel.transpose(1, 2))


def _reciprocal(sums: Tensor, pin: Tensor | None) -> Tensor:
    """``1 / sums`` with the scalings of zero-mass points pinned to 1: their kernel rows/columns
    are zero, so ``pin`` (1.0 there, 0.0 elsewhere) is added to the sums: one op instead of a
    ``where``. The mask goes on the input, not the output: ``where(pinned, 1, 1 / sums)`` would
    still send a zero gradient into ``1 / 0``, and ``0 * inf`` made every unrolled gradient NaN
    as soon as one particle's weight underflowed. ``torch.reciprocal``, not ``1 / sums``: the
    reflected division is a reciprocal and a product (2.2 against 7.9 us at 32 x 100, one
    thread)."""
    return torch.reciprocal(sums if pin is None else sums + pin)


@dataclass
class _Working:
    r"""The kernel-domain loop's working set: problems still iterating, flattened to ``(B, .)``.

    The plan is :math:`\operatorname{diag}(a u) \, K \operatorname{diag}(b v)` with the kernel :math:`K = \exp((f + g - C) / \epsilon)`. Vectors
    are rows ``(B, 1, N)``; ``a``, ``b`` are zero at zero-mass points, and the pins (``None``
    when no point of the batch has zero mass) are 1.0 there.
    """

    cost: Tensor
    log_a: Tensor
    log_b: Tensor
    a: Tensor
    b: Tensor
    a_zero: Tensor | None
    b_zero: Tensor | None
    pin_a: Tensor | None
    pin_b: Tensor | None
    kernel: Tensor
    f: Tensor
    g: Tensor
    u: Tensor
    v: Tensor
    u_exact: Tensor  # the exact row scaling of the last update (u itself may be over-relaxed)
    u_prev: Tensor | None = None
    v_prev: Tensor | None = None
    omega: Tensor | None = None
    err_prev: Tensor | None = None

    def select(self, keep: Tensor) -> None:
        """Keeps the problems ``keep`` (indices into the working set)."""
        for name in ("cost", "log_a", "log_b", "a", "b", "a_zero", "b_zero", "pin_a", "pin_b", "kernel", "f", "g", "u", "v", "u_exact", "omega", "err_prev"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, keep))


def _start(cost: Tensor, log_a: Tensor, log_b: Tensor, f: Tensor, g: Tensor, annealed: bool, eps: float) -> _Working:
    """The working set at the final ``eps``: kernel with ``f, g`` absorbed and first scalings.

    Particles of zero weight have no marginal to match; their scalings are pinned to 1 and their
    kernel rows/columns to 0 so that ``0 * inf`` never turns an error or a potential into NaN.
    When a row of the kernel underflows (to zero, or to denormals that keep only a few bits) the
    first column and row updates are taken in the log domain instead; a column that underflows
    makes the first iteration overflow, which the loop repairs the same way (see ``_absorb``).
    """
    a_zero, b_zero = zero_mass(log_a), zero_mass(log_b)
    any_a, any_b = torch.stack((a_zero.any(), b_zero.any())).tolist()
    a_zero, b_zero = (a_zero if any_a else None), (b_zero if any_b else None)
    a = log_a.exp() if a_zero is None else log_a.exp().masked_fill_(a_zero, 0.0)
    b = log_b.exp() if b_zero is None else log_b.exp().masked_fill_(b_zero, 0.0)
    pin_a = None if a_zero is None else a_zero.to(cost.dtype).unsqueeze(1)
    pin_b = None if b_zero is None else b_zero.to(cost.dtype).unsqueeze(1)
    a, b = a.unsqueeze(1), b.unsqueeze(1)
    # Without annealing the potentials are zero and the kernel is plain exp(-C / eps).
    kernel = log_kernel(cost, f, g, eps).exp_() if annealed else torch.mul(cost, -1.0 / eps).exp_()
    kernel = mask_kernel(kernel, a_zero, b_zero)
    u = _reciprocal(_rows(kernel, b), pin_a)
    # Row sums above the smallest normal number, and finite: 0 < u < 1 / tiny (NaN fails both).
    low, high = torch.aminmax(u.detach())
    low, high = float(low), float(high)
    if not (low > 0 and high < 1 / torch.finfo(cost.dtype).tiny):
        f, g, kernel = log_domain_update(cost, f, g, log_a, log_b, eps, a_zero, b_zero)
        u = torch.ones_like(a)
    return _Working(cost, log_a, log_b, a, b, a_zero, b_zero, pin_a, pin_b, kernel, f.unsqueeze(1), g.unsqueeze(1), u, torch.ones_like(b), u)


def _iteration(w: _Working, iters: int) -> Tensor:
    """One column-then-row update of the scalings (over-relaxed once ``omega`` is known).

    After ``_PLAIN_ITERS`` plain iterations each problem's contraction rate sets its relaxation
    factor. Returns the L1 row-marginal error of ``(u_prev, v)``, shape ``(B, 1)``: the plan's
    error before this iteration's row update.
    """
    w.u_prev, w.v_prev = w.u, w.v
    au = w.a * w.u
    v = _reciprocal(_cols(w.kernel, au), w.pin_b)
    if w.omega is not None:
        v = _relaxed(w.v_prev, v, w.omega)
    kv = _rows(w.kernel, w.b * v)
    err = (au * kv - w.a).abs().sum(-1)
    w.u_exact = _reciprocal(kv, w.pin_a)
    if iters == _PLAIN_ITERS and _MAX_OMEGA > 1:
        w.omega = _relaxation(err.detach() / w.err_prev.detach())
    w.err_prev = err
    w.u = w.u_exact if w.omega is None else _relaxed(w.u_prev, w.u_exact, w.omega)
    w.v = v
    return err


def _needs_absorption(w: _Working, err: Tensor, iters: int) -> tuple[bool, bool]:
    """``(overflow, absorb)``: whether the last update overflowed, and whether the scalings must
    be absorbed into the potentials (on overflow, or every tenth iteration once they pass
    ``_BIG``). ``err`` stays finite when ``K v`` underflows, so ``u`` is checked too; both in
    one sum and one read (a non-finite term makes it non-finite; a sum that overflows from
    finite terms only costs an early absorption)."""
    overflow = not math.isfinite(float((err.detach().sum() + w.u.detach().sum())))
    return overflow, overflow or (iters % 10 == 0 and float(torch.maximum(w.u.detach().abs().max(), w.v.detach().abs().max())) > _BIG)


def _absorb(w: _Working, eps: float, overflow: bool) -> None:
    """The log-domain fallback: absorbs the last finite scalings into the potentials and takes
    one exact log-domain column and row update; the kernel is O(1) again afterwards."""
    if overflow:
        w.u, w.v = w.u_prev, w.v_prev
    f, g = (w.f + eps * torch.log(w.u)).squeeze(1), (w.g + eps * torch.log(w.v)).squeeze(1)
    f, g, w.kernel = log_domain_update(w.cost, f, g, w.log_a, w.log_b, eps, w.a_zero, w.b_zero)
    w.f, w.g = f.unsqueeze(1), g.unsqueeze(1)
    w.u, w.v = torch.ones_like(w.u), torch.ones_like(w.v)
    w.u_exact = w.u


def _check_convergence(w: _Working, err: Tensor, threshold: float, live: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """The stopping rule: ``(done, error, num_done)``, ``done`` and ``error`` ``(B,)``, ``error``
    detached; ``done`` only among the ``live`` problems (all when ``None``).

    A problem is done when its row error ``err`` is below ``threshold``. Once over-relaxed,
    ``v`` is not the exact column update, so the returned pair ``(u_exact, v)`` can miss the
    column marginal by far more than ``err`` says: its column error is checked too, and
    ``error`` is the larger of the two.
    """
    done, error = (err < threshold).squeeze(-1), err.detach().squeeze(-1)
    if live is not None:
        done &= live
    num_done = int(done.sum())
    if w.omega is not None and num_done:
        col_err = (w.v * _cols(w.kernel, w.a * w.u_exact) * w.b - w.b).abs().sum(-1).squeeze(-1)
        done &= col_err < threshold
        error = torch.maximum(error, col_err.detach())
        num_done = int(done.sum())
    return done, error, num_done


def forward_solve(cost: Tensor, log_a: Tensor, log_b: Tensor, settings: SinkhornSettings, stacklevel: int = 3) -> SinkhornResult:
    """Annealed Sinkhorn, run under whatever autograd mode is active (``settings.gradient`` is
    not read: :func:`pyro_smc.ops.sinkhorn.solve` chooses how to differentiate).

    Each annealing level takes one symmetric, averaged log-domain update (Feydy et al.). At the
    final epsilon the iterations run in the kernel domain (two batched mat-vecs each) on a kernel
    into which the current potentials are absorbed; scalings that grow too large are absorbed
    again by an exact log-domain update. The loop runs until every problem's marginal error is
    below ``threshold``; problems that converge early keep iterating (which only makes them more
    accurate) until, under ``no_grad``, half of the working set has converged, and then leave it
    with the results of that iteration: on batches of at least ``_COMPACT_MIN_SIZE`` kernel
    entries by copies of the working set, whose later iterations are then cheaper; on smaller
    ones by masks, since copying the cost and the kernel there costs more than the iterations
    it saves. With autograd on no problem leaves, so the graph stays a plain function of the
    inputs. The loop ends on a row update: rows of the plan are exact, columns within
    ``threshold``.

    Args:
        cost: cost matrices ``(..., N, M)``.
        log_a, log_b: log-weights ``(..., N)`` and ``(..., M)``, broadcast to the batch shape of
            ``cost``; of equal mass (not checked here).
        settings: the solve's settings.
        stacklevel: of the convergence warning; the default, 3, attributes it to the caller.

    Returns:
        The :class:`SinkhornResult` over the batch shape of ``cost``; the largest entry of
        ``num_iterations`` is the number of iterations the loop ran at the final epsilon.

    Example:
        >>> import math, torch
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
        >>> cost = torch.rand(2, 5, 5, dtype=torch.float64)
        >>> log_w = torch.full((2, 5), -math.log(5), dtype=torch.float64)
        >>> forward_solve(
        ...     cost, log_w, log_w, SinkhornSettings(0.5, threshold=1e-8, max_iter=500)
        ... ).converged.tolist()
        [True, True]
    """
    return solve_with_plan(cost, log_a, log_b, settings, keep_plan=False, stacklevel=stacklevel + 1)[0]


def solve_with_plan(
    cost: Tensor, log_a: Tensor, log_b: Tensor, settings: SinkhornSettings, keep_plan: bool = True, stacklevel: int = 3
) -> tuple[SinkhornResult, PlanKernel | None]:
    """:func:`forward_solve` that also returns the plan in factored form (:class:`PlanKernel`,
    flattened to one batch dimension ``B``; ``None`` unless ``keep_plan``).

    Example:
        >>> import math, torch
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings, transport_plan
        >>> cost = torch.rand(2, 5, 5, dtype=torch.float64)
        >>> log_w = torch.full((2, 5), -math.log(5), dtype=torch.float64)
        >>> result, (kernel, u, v) = solve_with_plan(cost, log_w, log_w, SinkhornSettings(0.5))
        >>> plan = (log_w.exp() * u).unsqueeze(-1) * kernel * (log_w.exp() * v).unsqueeze(-2)
        >>> direct = transport_plan(cost, log_w, log_w, result.f, result.g, 0.5)
        >>> bool(torch.allclose(plan, direct))
        True
    """
    epsilon, threshold, max_iter = settings.epsilon, settings.threshold, settings.max_iter
    batch_shape = cost.shape[:-2]
    n, m = cost.shape[-2:]
    cost = cost.reshape(-1, n, m)
    log_a = log_a.expand(batch_shape + (n,)).reshape(-1, n)
    log_b = log_b.expand(batch_shape + (m,)).reshape(-1, m)
    f, g, annealed = _anneal(cost, log_a, log_b, epsilon, settings.scaling)
    w = _start(cost, log_a, log_b, f, g, annealed, epsilon)
    pinned = w.a_zero is not None or w.b_zero is not None
    # Converged problems leave the working set under no_grad (see the docstring); they are
    # dropped from it (copies of cost and kernel) only on large batches.
    leave = not torch.is_grad_enabled()
    drop = cost.numel() >= _COMPACT_MIN_SIZE
    out: Finished | None = None
    done: Tensor | None = None  # None: the last iteration ended in an absorption
    num_live = cost.shape[0]
    iters = 0
    while iters < max_iter:
        iters += 1
        err = _iteration(w, iters)
        overflow, absorb = _needs_absorption(w, err, iters)
        if absorb:
            _absorb(w, epsilon, overflow)
            done, error = None, err.detach().squeeze(-1)
            continue
        done, error, num_done = _check_convergence(w, err, threshold, None if out is None else out.live)
        if num_done == num_live:
            break
        if leave and 2 * num_done >= num_live:
            num_live -= num_done
            if drop:
                out = compact(w, out, done, error, iters, epsilon, keep_plan)
                keep = ~done
                done, error = done[keep], error[keep]
            else:
                out = freeze(w, out, done, error, iters, epsilon, keep_plan)
    else:
        warn_unconverged(err if out is None or out.live is None else err[out.live], threshold, max_iter, stacklevel)
    if done is None:
        done = torch.zeros(error.shape, dtype=torch.bool, device=error.device)
    result, plan = finish(w, out, done, error, iters, epsilon, keep_plan)
    f, g = result.f, result.g
    if pinned:
        f, g = complete_zero_mass(cost, log_a, log_b, f, g, epsilon)
    result = SinkhornResult(
        f.reshape(batch_shape + (n,)),
        g.reshape(batch_shape + (m,)),
        result.converged.reshape(batch_shape),
        result.num_iterations.reshape(batch_shape),
        result.marginal_error.reshape(batch_shape),
    )
    return result, plan
