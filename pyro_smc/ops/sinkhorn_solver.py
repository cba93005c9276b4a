r"""The forward Sinkhorn solver: its settings, epsilon scaling, stabilised kernel iterations and
a typed result.

See ``docs/math/smc.md#sinkhorn-in-the-log-domain`` and ``docs/math/smc.md#epsilon-scaling``.

The solver behind :func:`pyro_smc.ops.sinkhorn.sinkhorn` (whose module docstring describes the
algorithm and its gradients), cut into the stages of one solve:

1. ``_anneal``: epsilon scaling, one symmetric averaged log-domain update per level;
2. ``_start``: the log-stabilised kernel at the final epsilon, with the zero-mass masks
   and the log-domain fallback when a row or column of the kernel underflows;
3. ``_iteration``: one over-relaxed column-then-row update of the scalings;
4. ``_read``, ``_too_big`` / ``_absorb``: one host read of the errors per iteration, and the
   log-domain fallback when scalings overflow;
5. ``_check_convergence``: the per-problem stopping rule;
6. ``compact`` / ``finish`` (:mod:`pyro_smc.ops.sinkhorn_finish`): finished problems leave
   the working set of a large batch; potentials and the factored plan are read off the scalings.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn_kernel import (
    colsum,
    complete_zero_mass,
    log_domain_update,
    plain_kernel,
    mask_kernel,
    rowsum,
    stabilised_kernel,
    zero_mass,
)
from pyro_smc.ops.sinkhorn_finish import Finished, PlanKernel, compact, finish
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


def epsilon_schedule(cost: Tensor, epsilon: float, scaling: float, mean_cost: float | None = None) -> list[float]:
    """Annealing levels ``eps0 * scaling^k > epsilon`` (empty if off).

    ``eps0`` is a quarter of the mean cost (``mean_cost`` when given: the label-wise ensemble
    transform passes the mean before :func:`~pyro_smc.ops.labels.separate_classes` made the
    pairs across classes prohibitive). The textbook start, the maximum cost, is set by a few
    outlying pairs. Measured on particle clouds (32 x 100 points, float32, 1e-3 threshold), each
    level costs about three final-phase iterations, and starting at the mean cost bought fewer
    iterations than its levels cost at epsilon = 0.5 (8.6 ms against 3.0 ms without annealing)
    while a start at a quarter of it matched the best schedule at epsilon = 0.1 and 0.02.
    """
    eps0 = (float(cost.detach().mean()) if mean_cost is None else mean_cost) * _ANNEAL_START
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
    kernel = stabilised_kernel(cost, f, g, eps)
    f_new = f - eps * torch.log(rowsum(kernel, b))
    g_new = g - eps * torch.log(colsum(kernel, a))
    return (f + f_new) / 2, (g + g_new) / 2


def _anneal(cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: float, scaling: float, mean_cost: float | None) -> tuple[Tensor, Tensor, bool]:
    """Epsilon scaling down to ``epsilon``: returns ``(f, g, annealed)``, zero potentials and
    ``False`` when the schedule is empty. Non-finite potentials are reset to zero."""
    f = torch.zeros_like(log_a)
    g = torch.zeros_like(log_b)
    schedule = epsilon_schedule(cost, epsilon, scaling, mean_cost)
    for eps in schedule:
        f, g = _annealing_step(cost, log_a.exp(), log_b.exp(), f, g, eps)
    if schedule:
        f = torch.where(torch.isfinite(f), f, torch.zeros_like(f))
        g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
    return f, g, bool(schedule)


# The loop works on row vectors (B, 1, N) so that each product with the kernel is one bmm:
# ``x @ K`` on (B, N) vectors adds an unsqueeze, a squeeze and matmul's dispatch, about 12 us
# of the 47 us of one product at 32 x 100 x 100 (float32, one thread).
def _cols(kernel: Tensor, u: Tensor) -> Tensor:
    r""":math:`K^\top u` as a row vector ``(B, 1, M)`` for ``u`` of shape ``(B, 1, N)``."""
    return torch.bmm(u, kernel)


def _rows(kernel: Tensor, v: Tensor) -> Tensor:
    """``K v`` as a row vector ``(B, 1, N)`` for ``v`` of shape ``(B, 1, M)``."""
    return torch.bmm(v, kernel.transpose(1, 2))


def _pinned(sums: Tensor, pin: Tensor | None) -> Tensor:
    """``sums`` with 1.0 added at zero-mass points (``pin``; ``None`` when there are none): their
    kernel rows/columns are zero, so their scalings ``1 / sums`` are pinned to 1 and their
    log-scalings to 0. The mask goes on the input, not the output: ``where(pinned, 1, 1 / sums)``
    would still send a zero gradient into ``1 / 0``, and ``0 * inf`` made every unrolled gradient
    NaN as soon as one particle's weight underflowed."""
    return sums if pin is None else sums + pin


@dataclass
class _Working:
    r"""The kernel-domain loop's working set: problems still iterating, flattened to ``(B, .)``.

    The plan is :math:`\operatorname{diag}(a u) \, K \operatorname{diag}(b v)` with the kernel
    :math:`K = \exp((f + g - C) / \epsilon)`. The scalings are held by their negated logs
    ``nlu = -log u``, ``nlv = -log v`` (one ``log`` per update instead of a reciprocal, and the
    over-relaxed step is then one ``lerp``), and ``au = a u`` for the next column update.
    Vectors are rows ``(B, 1, N)``; ``a``, ``b`` are zero at zero-mass points, and the pins
    (``None`` when no point of the batch has zero mass) are 1.0 there.
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
    nlu: Tensor
    nlv: Tensor
    nlu_exact: Tensor  # -log of the exact row scaling of the last update (nlu may be over-relaxed)
    au: Tensor
    nlu_prev: Tensor | None = None
    nlv_prev: Tensor | None = None
    omega: Tensor | None = None
    err_prev: Tensor | None = None

    @property
    def u_exact(self) -> Tensor:
        """The exact row scaling of the last update, ``(B, 1, N)``."""
        return torch.exp(-self.nlu_exact)

    @property
    def v(self) -> Tensor:
        """The column scaling, ``(B, 1, M)``."""
        return torch.exp(-self.nlv)

    def select(self, keep: Tensor) -> None:
        """Keeps the problems ``keep`` (indices into the working set)."""
        names = ("cost", "log_a", "log_b", "a", "b", "a_zero", "b_zero", "pin_a", "pin_b", "kernel", "f", "g")
        for name in names + ("nlu", "nlv", "nlu_exact", "au", "omega", "err_prev"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, keep))


def _start(
    cost: Tensor, log_a: Tensor, log_b: Tensor, f: Tensor, g: Tensor, annealed: bool, eps: float, out: Tensor | None = None
) -> _Working:
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
    a, b = a.unsqueeze(1), b.unsqueeze(1)
    pin_a = None if a_zero is None else a_zero.to(cost.dtype).unsqueeze(1)
    pin_b = None if b_zero is None else b_zero.to(cost.dtype).unsqueeze(1)
    # Without annealing the potentials are zero and the kernel is plain exp(-C / eps).
    kernel = stabilised_kernel(cost, f, g, eps, out) if annealed else plain_kernel(cost, eps, out)
    kernel = mask_kernel(kernel, a_zero, b_zero)
    sums = _pinned(_rows(kernel, b), pin_a)
    # Row sums above the smallest normal number, and finite (NaN fails both).
    low, high = torch.stack(torch.aminmax(sums.detach())).tolist()
    if low > torch.finfo(cost.dtype).tiny and high < math.inf:
        nlu = torch.log(sums)
    else:
        f, g, kernel = log_domain_update(cost, f, g, log_a, log_b, eps, a_zero, b_zero)
        nlu = torch.zeros_like(a)
    return _Working(cost, log_a, log_b, a, b, a_zero, b_zero, pin_a, pin_b, kernel, f.unsqueeze(1), g.unsqueeze(1), nlu, torch.zeros_like(b), nlu, a / torch.exp(nlu))


def _iteration(w: _Working, iters: int) -> Tensor:
    r"""One column-then-row update of the scalings (over-relaxed once ``omega`` is known).

    After ``_PLAIN_ITERS`` plain iterations each problem's contraction rate sets its relaxation
    factor. Returns the L1 row-marginal error of ``(u_prev, v)``, shape ``(B, 1)``: the plan's
    error before this iteration's row update.

    In negated logs the over-relaxed scaling ``previous^(1 - omega) * exact^omega`` is
    ``lerp(previous, exact, omega)``: with :math:`\mathrm{nlv} = \log(K^\top a u)` an update is one ``log``,
    one ``lerp`` and ``b v = b / exp(nlv)`` (it was a reciprocal, a ``log``, an ``exp``, a
    division and three products). ``b / exp(nlv)``, not ``exp(log b - nlv)``: an ``exp`` whose
    result underflows takes a slow path on CPU (8x for float32 results below 1e-38), while
    quotients that underflow are flushed for free; and not ``b * exp(-nlv)``, whose negation is
    one more small op (at 32 x 100 each costs about a tenth of a mat-vec).
    """
    w.nlu_prev, w.nlv_prev = w.nlu, w.nlv
    au = w.au
    exact = torch.log(_pinned(_cols(w.kernel, au), w.pin_b))
    nlv = exact if w.omega is None else torch.lerp(w.nlv_prev, exact, w.omega)
    kv = _rows(w.kernel, w.b / torch.exp(nlv))
    err = torch.linalg.vector_norm(torch.addcmul(w.a, au, kv, value=-1), 1, -1)
    w.nlu_exact = torch.log(_pinned(kv, w.pin_a))
    if iters == _PLAIN_ITERS and _MAX_OMEGA > 1:
        w.omega = _relaxation(err.detach() / w.err_prev.detach())
    w.err_prev = err
    w.nlu = w.nlu_exact if w.omega is None else torch.lerp(w.nlu_prev, w.nlu_exact, w.omega)
    w.au = w.a / torch.exp(w.nlu)
    w.nlv = nlv
    return err


def _read(w: _Working, err: Tensor) -> tuple[list[float], bool]:
    """The per-problem errors as floats and whether the last update overflowed, in one host read.

    ``err`` stays finite when ``K v`` underflows, so ``a u`` is checked too: both in one sum (a
    non-finite term makes it non-finite; a sum that overflows from finite terms only costs an
    early absorption)."""
    errors, total = zip(*torch.cat((err, w.au.sum(-1)), -1).tolist())
    return list(errors), not math.isfinite(sum(errors) + sum(total))


def _too_big(w: _Working) -> bool:
    """Whether a scaling has passed ``_BIG`` (its negated log below ``-log(_BIG)``)."""
    return float(torch.minimum(w.nlu.detach().min(), w.nlv.detach().min())) < -math.log(_BIG)


def _absorb(w: _Working, eps: float, overflow: bool) -> None:
    """The log-domain fallback: absorbs the last finite scalings into the potentials and takes
    one exact log-domain column and row update; the kernel is O(1) again afterwards."""
    if overflow:
        w.nlu, w.nlv = w.nlu_prev, w.nlv_prev
    f, g = (w.f - eps * w.nlu).squeeze(1), (w.g - eps * w.nlv).squeeze(1)
    f, g, w.kernel = log_domain_update(w.cost, f, g, w.log_a, w.log_b, eps, w.a_zero, w.b_zero)
    w.f, w.g = f.unsqueeze(1), g.unsqueeze(1)
    w.nlu, w.nlv = torch.zeros_like(w.nlu), torch.zeros_like(w.nlv)
    w.nlu_exact, w.au = w.nlu, w.a


def _check_convergence(
    w: _Working, errors: list[float], threshold: float, acts: Callable[[int], bool]
) -> tuple[list[bool], list[float], int]:
    """The stopping rule: ``(done, error, num_done)`` per problem, as host lists.

    A problem is done when its row error ``err`` is below ``threshold``. Once over-relaxed,
    ``v`` is not the exact column update, so the returned pair ``(u_exact, v)`` can miss the
    column marginal by far more than ``err`` says: its column error is checked too, and
    ``error`` is the larger of the two. That costs one more product with the kernel, so it is
    only taken when the loop ``acts`` on the verdicts of ``num_done`` row-converged problems
    (stops, or drops them, or has reached ``max_iter``): column checks can only lower the
    count, so the loop takes the same path as with a check on every iteration, with about
    three products with the kernel fewer per solve at 32 x 100.
    """
    done = [e < threshold for e in errors]
    num_done = sum(done)
    if w.omega is not None and num_done and acts(num_done):
        bv = w.b * torch.exp(-w.nlv)
        col = torch.addcmul(w.b, bv, _cols(w.kernel, w.a * torch.exp(-w.nlu_exact)), value=-1).abs().sum(-1)
        col_errors = col.detach().reshape(-1).tolist()
        done = [d and c < threshold for d, c in zip(done, col_errors)]
        errors = [max(e, c) if c == c else c for e, c in zip(errors, col_errors)]
        num_done = sum(done)
    return done, errors, num_done


def _tensor(values: list, dtype: torch.dtype, like: Tensor) -> Tensor:
    """A host list as a tensor on ``like``'s device."""
    return torch.tensor(values, dtype=dtype, device=like.device)


def forward_solve(cost: Tensor, log_a: Tensor, log_b: Tensor, settings: SinkhornSettings, stacklevel: int = 3) -> SinkhornResult:
    """Annealed Sinkhorn, run under whatever autograd mode is active (``settings.gradient`` is
    not read: :func:`pyro_smc.ops.sinkhorn.solve` chooses how to differentiate).

    Each annealing level takes one symmetric, averaged log-domain update (Feydy et al.). At the
    final epsilon the iterations run in the kernel domain (two batched mat-vecs each) on a kernel
    into which the current potentials are absorbed; scalings that grow too large are absorbed
    again by an exact log-domain update. The loop runs until every problem's marginal error is
    below ``threshold``. Problems that converge early keep iterating (which only makes them more
    accurate); on batches of at least ``_COMPACT_MIN_SIZE`` kernel entries and under ``no_grad``
    they leave the working set with the results of that iteration once half of it has
    converged (copies of the working set, whose later iterations are then cheaper). On smaller
    batches the copies cost more than the iterations they save, and all problems run to the
    end; each one's ``num_iterations`` is then the iteration from which it met the rule (under
    ``no_grad``). With autograd on no problem leaves, so the graph stays a plain function of
    the inputs. The loop
    ends on a row update: rows of the plan are exact, columns within ``threshold``.

    Args:
        cost: cost matrices ``(..., N, M)``.
        log_a, log_b: log-weights ``(..., N)`` and ``(..., M)``, broadcast to the batch shape of
            ``cost``; of equal mass (not checked here).
        settings: the solve's settings.
        stacklevel: of the convergence warning; the default, 3, attributes it to the caller.

    Returns:
        The :class:`SinkhornResult` over the batch shape of ``cost``; the largest entry of
        ``num_iterations`` is (but for an absorption on the loop's second-to-last iteration)
        the number of iterations the loop ran at the final epsilon.

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
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    settings: SinkhornSettings,
    keep_plan: bool = True,
    stacklevel: int = 3,
    kernel_out: Tensor | None = None,
    mean_cost: float | None = None,
) -> tuple[SinkhornResult, PlanKernel | None]:
    """:func:`forward_solve` that also returns the plan in factored form (:class:`PlanKernel`,
    flattened to one batch dimension ``B``; ``None`` unless ``keep_plan``).

    ``kernel_out``, a buffer with the cost's number of elements, receives the working kernel
    instead of a fresh tensor (outside autograd only); the factored plan's kernel may then be
    that buffer, which the caller must not hand on. ``mean_cost`` replaces the cost's mean in
    the annealing schedule (``epsilon_schedule``).

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
    f, g, annealed = _anneal(cost, log_a, log_b, epsilon, settings.scaling, mean_cost)
    if kernel_out is not None:
        kernel_out = kernel_out.view(cost.shape)
    w = _start(cost, log_a, log_b, f, g, annealed, epsilon, kernel_out)
    masks = (w.a_zero, w.b_zero)  # over the whole batch: the working set's shrink as problems leave
    # Converged problems leave the working set only under no_grad and on large batches (see
    # the docstring); on small ones they keep iterating with the rest.
    leave = not torch.is_grad_enabled() and cost.numel() >= _COMPACT_MIN_SIZE
    out: Finished | None = None
    # Per-problem verdicts and errors travel as host lists: one read per iteration (_read)
    # instead of a reduction, a comparison and a read for each question asked of them.
    done: list[bool] | None = None  # None: the last iteration ended in an absorption
    # Small batches under no_grad: the iteration from which each problem has met the rule.
    met: list[int] | None = None if leave or torch.is_grad_enabled() else [0] * cost.shape[0]
    num_live = cost.shape[0]
    iters = 0
    while iters < max_iter:
        iters += 1
        err = _iteration(w, iters)
        error, overflow = _read(w, err)
        if overflow or (iters % 10 == 0 and _too_big(w)):
            _absorb(w, epsilon, overflow)
            done = None
            continue
        done, error, num_done = _check_convergence(
            w, error, threshold, lambda k, n=num_live, i=iters: k == n or (leave and 2 * k >= n) or i == max_iter
        )
        if met is not None:
            met = [(k or iters) if d else 0 for k, d in zip(met, done)]
        if num_done == num_live:
            break
        if leave and 2 * num_done >= num_live:
            num_live -= num_done
            flags, errors = _tensor(done, torch.bool, err), _tensor(error, err.dtype, err)
            out = compact(w, out, flags, errors, iters, epsilon, keep_plan)
            done, error = [d for d in done if not d], [e for d, e in zip(done, error) if not d]
    else:
        warn_unconverged(err, threshold, max_iter, stacklevel)
    done = _tensor([False] * len(error) if done is None else done, torch.bool, err)
    error = _tensor(error, err.dtype, err)
    result, plan = finish(w, out, done, error, iters, epsilon, keep_plan)
    if met is not None:
        met = _tensor([k or iters for k in met], torch.long, err)
        result = result._replace(num_iterations=torch.where(result.converged, met, iters))
    f, g = result.f, result.g
    if masks[0] is not None or masks[1] is not None:
        f, g = complete_zero_mass(cost, log_a, log_b, f, g, epsilon, masks)
    result = SinkhornResult(
        f.reshape(batch_shape + (n,)),
        g.reshape(batch_shape + (m,)),
        result.converged.reshape(batch_shape),
        result.num_iterations.reshape(batch_shape),
        result.marginal_error.reshape(batch_shape),
    )
    return result, plan
