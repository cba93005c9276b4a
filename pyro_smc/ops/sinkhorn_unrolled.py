r"""Sinkhorn for ``gradient="unroll"``: every iteration in the log domain, under autograd.

See ``docs/math/smc.md#gradient-modes``.

Autograd differentiates the returned iterate through every iteration. The kernel-domain loop of
:mod:`pyro_smc.ops.sinkhorn_solver` cannot be unrolled safely (see ``unrolled_solve``),
so this mode runs its own loop on exact c-transforms, each a ``_SoftMin`` that stores only
vectors for the backward pass.

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
    >>> from pyro_smc.ops.sinkhorn_unrolled import unrolled_solve
    >>> cost = torch.rand(2, 5, 5, dtype=torch.float64, requires_grad=True)
    >>> log_w = torch.full((2, 5), -math.log(5), dtype=torch.float64)
    >>> result = unrolled_solve(
    ...     cost,
    ...     log_w,
    ...     log_w,
    ...     SinkhornSettings(0.5, threshold=1e-8, max_iter=1000, gradient="unroll"),
    ... )
    >>> result.f.requires_grad, result.converged.tolist()
    (True, [True, True])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn_kernel import soft_min, soft_min_logits
from pyro_smc.ops.sinkhorn_solver import epsilon_schedule
from pyro_smc.ops.sinkhorn_types import SinkhornResult, SinkhornSettings, warn_unconverged

# unrolled_solve is reached through pyro_smc.ops.sinkhorn.solve (gradient="unroll"), not the API.
__all__: list[str] = []


class _SoftMin(torch.autograd.Function):
    r""":math:`-\epsilon \operatorname{logsumexp}((\mathrm{pot} - C) / \epsilon + \log w)` over the points of ``pot`` (one c-transform).

    Autograd through ``torch.logsumexp`` would store an ``N x M`` tensor per call; this keeps
    only the vectors and recomputes the softmax in the backward pass, so an unrolled loop holds
    one cost matrix plus ``O(N + M)`` per iteration.
    """

    @staticmethod
    def forward(ctx, cost, pot, log_w, eps, rows):
        # rows=True: pot lives on the rows (dim -2) and the result on the columns.
        out = soft_min(cost, pot, log_w, eps, rows)
        ctx.save_for_backward(cost, pot, log_w, out)
        ctx.eps, ctx.rows = eps, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cost, pot, log_w, out = ctx.saved_tensors
        eps, rows = ctx.eps, ctx.rows
        reduce_dim, keep_dim = (-2, -1) if rows else (-1, -2)
        # softmax over the reduced points, times the incoming gradient of each result entry.
        weights = torch.exp(soft_min_logits(cost, pot, log_w, eps, rows) + (out / eps).unsqueeze(reduce_dim))
        weights = weights * grad_out.unsqueeze(reduce_dim)
        grad_cost = weights if ctx.needs_input_grad[0] else None
        grad_pot = -weights.sum(keep_dim)
        grad_log_w = eps * grad_pot if ctx.needs_input_grad[2] else None
        return grad_cost, grad_pot, grad_log_w, None, None


def _c_transforms(cost: Tensor, log_a: Tensor, log_b: Tensor, eps: float) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """The two exact log-domain soft-min maps, ``g(f)`` and ``f(g)``."""

    def g_of(f: Tensor) -> Tensor:
        return _SoftMin.apply(cost, f, log_a, eps, True)

    def f_of(g: Tensor) -> Tensor:
        return _SoftMin.apply(cost, g, log_b, eps, False)

    return g_of, f_of


def unrolled_solve(cost: Tensor, log_a: Tensor, log_b: Tensor, settings: SinkhornSettings, mean_cost: float | None = None) -> SinkhornResult:
    r"""Sinkhorn for ``gradient="unroll"``: every iteration in the log domain, under autograd.

    The fast loop of :func:`pyro_smc.ops.sinkhorn_solver.forward_solve` works on scalings
    ``u = 1 / (K v)``, whose derivative ``-1 / (K v)^2`` overflows (float32: as soon as a row's
    kernel sum falls below 1e-19) and then meets the kernel's zeros as ``inf * 0 = NaN``: sharp
    likelihoods made every unrolled gradient NaN. Log-sum-exp updates differentiate into
    softmaxes, which are bounded, and need no special case for particles whose weight
    underflows. Each iteration costs two ``N x M`` exponentials instead of two mat-vecs, which
    is the price of this (small-problem) mode.

    The column error needs no extra pass: after ``f = f(g)`` the plan's columns sum to
    :math:`b_j \exp((g_j - g(f)_j) / \epsilon)`, and ``g(f)`` is the next iteration's update anyway.

    ``mean_cost`` replaces the cost's mean in the annealing schedule
    (``pyro_smc.ops.sinkhorn_solver.epsilon_schedule``).

    Returns:
        The :class:`SinkhornResult` over the broadcast batch shape; every problem runs the same
        number of iterations, and ``marginal_error`` is the column error of the returned plan
        (its rows are exact).
    """
    epsilon, threshold, max_iter = settings.epsilon, settings.threshold, settings.max_iter
    batch_shape = torch.broadcast_shapes(cost.shape[:-2], log_a.shape[:-1], log_b.shape[:-1])
    log_a = log_a.expand(batch_shape + log_a.shape[-1:])
    log_b = log_b.expand(batch_shape + log_b.shape[-1:])
    f = torch.zeros_like(log_a)
    g = torch.zeros_like(log_b)
    for eps in epsilon_schedule(cost, epsilon, settings.scaling, mean_cost):
        g_of, f_of = _c_transforms(cost, log_a, log_b, eps)
        f, g = (f + f_of(g)) / 2, (g + g_of(f)) / 2
    g_of, f_of = _c_transforms(cost, log_a, log_b, epsilon)
    g = g_of(f)
    iters = 0
    for _ in range(max_iter):
        iters += 1
        f = f_of(g)
        g_next = g_of(f)
        with torch.no_grad():
            err = (log_b.exp() * torch.expm1((g - g_next) / epsilon).abs()).sum(-1)
        if bool((err < threshold).all()):
            break
        g = g_next
    else:
        warn_unconverged(err, threshold, max_iter, stacklevel=4)
    err = err.detach()
    iterations = torch.full(err.shape, iters, dtype=torch.long, device=err.device)
    return SinkhornResult(f, g, err < threshold, iterations, err)
