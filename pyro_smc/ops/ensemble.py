r"""The differentiable ensemble transform: weighted particles to equally weighted ones by OT.

Corenflos et al. (2021) replace resampling by the barycentric projection of the entropic OT
plan from the uniform measure on the particles to the weighted one,

.. math::

    \tilde x_i = \frac{\sum_j P_{ij} x_j}{\sum_j P_{ij}}, \qquad
    C_{ij} = \frac{1}{D} \sum_{d=1}^D \frac{(x_{id} - x_{jd})^2}{\operatorname{var}_d},

with :math:`\operatorname{var}_d` the spread of coordinate ``d`` over the particles, which preserves
the weighted mean (up to the marginal error) and is smooth in the particles and the log-weights.
Measuring each coordinate on its own spread makes ``epsilon`` free of the state's dimension and
of the units of every coordinate (Corenflos et al. divide by the widest coordinate's variance
instead, which left a coordinate 1000 times narrower than another untransported). The spreads
are differentiated with the rest, so the gradient is the derivative of the transform actually
computed and matches its finite differences.

With ``gradient="implicit"`` the whole transform is one fused autograd function: Sinkhorn runs
without autograd, and the backward pass goes from ``d loss / d x_new`` to the gradients of the
particles and log-weights in a handful of passes over the ``N x N`` kernel plus one adjoint
solve (:func:`pyro_smc.ops.sinkhorn.implicit_adjoint`), instead of differentiating the cost,
the plan and the projection operation by operation. Two facts make this cheap:

* the row normalisation makes ``x_new`` invariant to the source potential ``f``, so the adjoint
  has a zero right-hand side in ``f``;
* with :math:`K = P / \sqrt{a b^\top}` the column sums of :math:`P \odot (G x^\top)` needed for the log-weights are
  :math:`x_j \cdot (K^\top G)_j`: one ``N x (D + 1)`` product, no ``N x N`` temporary.

See ``docs/math/smc.md#optimal-transport-resampling`` and ``docs/math/smc.md#gradient-of-the-ensemble-transform``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.ensemble import ensemble_transform
    >>> x = torch.randn(4, 50, 2, dtype=torch.float64, requires_grad=True)   # 4 filters
    >>> log_w = torch.randn(4, 50, dtype=torch.float64).log_softmax(-1).requires_grad_()
    >>> x_new, plan = ensemble_transform(
    ...     x, log_w, epsilon=0.5, threshold=1e-6, max_iter=1000
    ... )
    >>> target = (log_w.exp().unsqueeze(-1) * x).sum(-2)             # weighted mean
    >>> bool(torch.allclose(x_new.mean(-2), target, atol=1e-5))
    True
    >>> x_new.square().sum().backward()                                # exact gradients
    >>> x.grad.shape, log_w.grad.shape
    (torch.Size([4, 50, 2]), torch.Size([4, 50]))
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.ops.labels import class_moments, separate_classes
from pyro_smc.ops.sinkhorn import SinkhornResult, SinkhornSettings, check_unit_mass, implicit_adjoint, transport_plan
from pyro_smc.ops.sinkhorn_kernel import flushing, row_products, zero_mass
from pyro_smc.ops.sinkhorn_solver import solve_with_plan
from pyro_smc.ops.sinkhorn_types import refuse_second_derivative
from pyro_smc.ops.sinkhorn_unrolled import unrolled_solve

__all__ = ["EnsembleResult", "ensemble_transform", "ensemble_solve"]


def _centred(x: Tensor) -> Tensor:
    """The particles ``(..., N, D)`` moved to their mean (a constant to autograd: the cost does not
    depend on it). The expanded quadratic form of the cost subtracts terms of the size of
    ``|x|^2``: a float32 cloud of spread 1 at 10^3 from the origin had cost errors of 0.25 and
    moved particles 0.06 off, at 10^4 errors of 30 and 3, all silently."""
    return x - x.mean(-2, keepdim=True).detach()


def _normalised_cost(x: Tensor, workspace: bool = False) -> Tensor:
    r"""The cost :math:`\lVert x_i - x_j \rVert^2 / D` of standardised, centred particles ``x`` ``(..., N, D)``
    (:func:`_coordinate_scale`, :func:`_centred`): with ``x`` divided by each coordinate's
    spread, the cost :math:`\sum_d (x_{id} - x_{jd})^2 / (D \operatorname{var}_d)` of the original particles.

    The cost is one product of the thin factors of :func:`_cost_factors` and one clamp, both
    over ``(..., N, N)``. With ``workspace`` (the fused forward, where the cost dies with the
    solve) it is written into a buffer kept between calls (:func:`_workspace`).
    """
    n, d = x.shape[-2:]
    left, right = _cost_factors(x, 1 / d)
    out = _workspace(x.shape[:-1] + (n,), x, "cost") if workspace else None
    return torch.matmul(left, right.transpose(-1, -2), out=out).clamp_min_(0)


def _cost_factors(x: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    r"""Thin factors ``(..., N, D + 2)`` of ``scale * ||x_i - x_j||^2``: the expanded quadratic form
    :math:`[x, \lVert x\rVert^2, 1] \, [-2 x, 1, \lVert x\rVert^2]^\top` of
    :func:`~pyro_smc.ops.sinkhorn.squared_distances`, with ``scale`` folded into the right factor."""
    sq = x.square().sum(-1, keepdim=True)
    ones = torch.ones_like(sq)
    return torch.cat([x, sq, ones], -1), torch.cat([-2 * x, ones, sq], -1) * scale


# Per thread, CPU buffers by use and dtype for the fused transform's (B, N, N) temporaries, up
# to this many bytes each (8 x 2000 x 2000 in float64 fits).
_WORKSPACE_MAX_BYTES = 1 << 28
_WORKSPACES = threading.local()


def _workspace(shape: torch.Size, like: Tensor, use: str) -> Tensor | None:
    """A buffer of ``shape`` for ``use`` (``"cost"``, ``"kernel"``) kept between calls (``None``:
    allocate afresh), CPU only.

    A fresh ``(B, N, N)`` tensor is above glibc's mmap threshold, and once freed its pages go
    back to the system: every call faulted them in again, which on this project's benchmark
    machine cost as much as several passes over the tensor (2 ms for the 2.6 MB cost of 32 x 100
    x 100 float64, against 0.6 ms for an exp over it). The cost is dead once the solve returns,
    and a kernel that is not kept for the backward pass (see :class:`_FusedEnsembleTransform`)
    once the forward or backward pass that made it returns, so one buffer per use serves every
    call; CUDA's caching allocator needs none. A thread keeps its buffers, each of the largest
    size it has met (up to ``_WORKSPACE_MAX_BYTES``, 256 MB), for its lifetime. Created outside
    inference mode (as the cached weights of :mod:`pyro_smc.ops.unscented`): an inference
    tensor could not be written by a later call outside it.
    """
    numel = math.prod(shape)
    if like.device.type != "cpu" or numel * like.element_size() > _WORKSPACE_MAX_BYTES:
        return None
    buffers = _WORKSPACES.__dict__.setdefault("buffers", {})
    buffer = buffers.get((use, like.dtype))
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = buffers[(use, like.dtype)] = like.new_empty(numel)
    return buffer[:numel].view(shape)


# The kernel is exp2 of a base-2 exponent (exp2 is several times faster than exp on CPU; see
# pyro_smc.ops.sinkhorn_kernel).
_LOG2E = 1 / math.log(2)
# Symmetric kernels above this many bytes are not saved for the backward pass, which rebuilds
# them (see _FusedEnsembleTransform).
_SAVED_KERNEL_MAX_BYTES = 1 << 23
# The base-2 exponent of a masked column: exp2 of it is zero, and it stays finite in the bmm
# (an infinite entry would meet zeros in the BLAS's padding and give NaN).
_MASKED_EXPONENT = -1e30


def _symmetric_kernel(x: Tensor, f: Tensor, g: Tensor, log_b: Tensor, eps: float, out: Tensor | None, classes: Tensor | None) -> Tensor:
    r"""The adjoint's symmetric kernel :math:`S_{ij} = P_{ij} / \sqrt{a_i b_j}` ``(B, N, N)`` rebuilt from the
    solve's potentials: :math:`S_{ij} = \exp((f_i + g_j - C_{ij}) / \epsilon + (\log a_i + \log b_j) / 2)` with :math:`a_i = 1 / N`.

    The exponent (in base 2) is one product of thin factors, those of the cost
    (:func:`_cost_factors`) with the potentials as two more columns, so ``S`` costs one bmm
    and one ``exp2`` over ``(B, N, N)``, written into ``out`` when given. Columns of zero-mass
    points are zero, as in the solver's kernel, and so are pairs of different ``classes`` (whose
    potentials carry unrelated gauges). ``x`` is the centred particles ``(B, N, D)``, the rest
    flattened alike.
    """
    n, d = x.shape[-2:]
    left, right = _cost_factors(x, (-_LOG2E / eps) / d)
    row = ((f / eps - 0.5 * math.log(n)) * _LOG2E).unsqueeze(-1)
    col = ((g / eps + 0.5 * log_b) * _LOG2E).masked_fill(zero_mass(log_b), _MASKED_EXPONENT).unsqueeze(-1)
    ones = torch.ones_like(row)
    left, right = torch.cat([left, row, ones], -1), torch.cat([right, ones, col], -1)
    kernel = torch.bmm(left, right.transpose(1, 2), out=out).exp2_()
    if classes is not None:
        kernel.masked_fill_(classes.unsqueeze(-1) != classes.unsqueeze(-2), 0)
    return kernel


class _FusedEnsembleTransform(torch.autograd.Function):
    r"""``x_new`` and the plan; exact gradients via the implicit function theorem.

    See ``docs/math/smc.md#gradient-of-the-ensemble-transform``.

    The backward pass needs the symmetric kernel :math:`P / \sqrt{a b^\top}`. Up to
    ``_SAVED_KERNEL_MAX_BYTES`` it is saved; above, only the potentials are, and the backward
    rebuilds it (:func:`_symmetric_kernel`: one bmm and one exp2). A filter keeps every step's
    saved tensors until its backward pass, so saved kernels grow with N^2 times the number of
    resampling steps (8 x 2000 x 2000 in float32 is 128 MB a step); small ones cost less to
    keep than to rebuild (at 32 x 100 the rebuild added about 0.8 ms to a 3 ms backward).

    Its particles come standardised (each coordinate divided by its spread, by
    :func:`ensemble_solve`, under autograd), so the cost is :math:`\lVert x_i - x_j \rVert^2 / D`.
    """

    @staticmethod
    @flushing
    def forward(ctx, x, log_b, settings, want_plan, classes):
        n = x.shape[-2]
        epsilon = settings.epsilon
        with torch.no_grad():
            centre = x.mean(-2, keepdim=True)
            x_c = x - centre
            cost = _normalised_cost(x_c, workspace=True)
            mean_cost = None if classes is None else separate_classes(cost, x_c, classes, x.shape[-1], epsilon)
            log_a = torch.full_like(log_b, -math.log(n))
            # A kernel too large to keep is rebuilt by the backward pass, so the forward's copy
            # dies with the forward and can live in a buffer.
            keep = cost.numel() * cost.element_size() <= _SAVED_KERNEL_MAX_BYTES
            kernel_out = None if keep else _workspace(cost.shape, x, "kernel")
            result, factored = solve_with_plan(cost, log_a, log_b, settings, stacklevel=4, kernel_out=kernel_out, mean_cost=mean_cost)
            # The solver's plan diag(a u) K diag(b v), reused: no exp over (B, N, N). P x and the
            # row sums of P come out of one product with the rows [b v x, b v] (a u cancels in
            # x_new), on the solver's flattened batch.
            # Centred particles, as in the cost: x_new is their convex combination plus the mean.
            shape, dim = x.shape, x.shape[-1]
            bv = (log_b.exp().reshape(-1, n) * factored.v).unsqueeze(1)
            x_rows = x_c.reshape(-1, n, dim).transpose(1, 2)
            moved = row_products(torch.cat([bv * x_rows, bv], 1), factored.kernel.transpose(1, 2))
            x_new = (moved[:, :-1] / moved[:, -1:]).transpose(1, 2).reshape(shape) + centre
            rows = ((factored.u / n) * moved[:, -1]).reshape(shape[:-1] + (1,))  # row sums of P
            factored = factored.unflatten(shape[:-2])
            sqrt_a = math.exp(-0.5 * math.log(n))
            sqrt_b = (log_b / 2).exp()
            # An (N, N) product the caller may not need (OTResampler reads it only for
            # particles it cannot average); an empty tensor stands in for it then.
            plan = x.new_empty(0)
            if keep:
                # P / sqrt(a_i b_j): the symmetric form the adjoint needs, built in place.
                kernel = factored.symmetric_(sqrt_a, sqrt_b)
                if want_plan:
                    plan = kernel * (sqrt_a * sqrt_b).unsqueeze(-2)
            else:
                kernel = x.new_empty(0)  # rebuilt by the backward pass
                if want_plan:
                    plan = torch.mul(factored.kernel, (factored.u / n).unsqueeze(-1)).mul_((log_b.exp() * factored.v).unsqueeze(-2))
        ctx.save_for_backward(x, kernel, log_b, result.f, result.g, rows, x_new, classes)
        ctx.sqrt_a = sqrt_a
        ctx.epsilon = epsilon
        ctx.exact = settings.gradient == "implicit"
        # The fixed point is only threshold-accurate; a tighter adjoint buys nothing.
        ctx.tol = min(1e-2, settings.threshold) * 1e-2
        # The solve's potentials and diagnostics are outputs too, none of them differentiable.
        ctx.mark_non_differentiable(plan, *result)
        return (x_new, plan, *result)

    @staticmethod
    @flushing
    def backward(ctx, grad_x_new, *_not_differentiable):
        refuse_second_derivative(f"OTResampler's transport (the ensemble transform) with gradient={'implicit' if ctx.exact else 'last_step'!r}")
        if grad_x_new is None:
            return None, None, None, None, None
        x, kernel, log_b, f, g, rows, x_new, classes = ctx.saved_tensors
        sqrt_a, eps = ctx.sqrt_a, ctx.epsilon
        # One batch dimension, and thin factors as rows (B, k, N): every product with the kernel
        # is one bmm, and the kernel is only read, never copied.
        shape, (n, dim) = x.shape, x.shape[-2:]
        # Every formula below is invariant under a common translation of x and x_new; they take
        # the centred particles of the forward pass, free of the cancellation a far-off cloud
        # would cause in float32.
        centre = x.mean(-2, keepdim=True)
        x, x_new = x - centre, x_new - centre
        x, x_new, grad_x_new = (t.reshape(-1, n, dim) for t in (x, x_new, grad_x_new))
        log_b, rows = log_b.reshape(-1, n), rows.reshape(-1, n, 1)
        classes = None if classes is None else classes.reshape(-1, n)
        sqrt_b = (log_b / 2).exp()
        if kernel.numel():
            kernel = kernel.reshape(-1, n, n)
        else:
            # Rebuilt into a buffer only when this backward builds no graph (create_graph=False),
            # so that the buffer's contents die with it.
            out = None if torch.is_grad_enabled() else _workspace(x.shape[:-1] + (n,), x, "kernel")
            kernel = _symmetric_kernel(x, f.reshape(-1, n), g.reshape(-1, n), log_b, eps, out, classes)
        # x_new_i = sum_j P_ij x_j / r_i, so d loss / d log P_ij = P_ij (G_i . x_j - c_i) with
        # G_i = grad_i / r_i and c_i = G_i . x_new_i.
        gs = grad_x_new / rows
        c = (gs * x_new).sum(-1)
        kt = row_products(torch.cat([gs, c.unsqueeze(-1)], -1).transpose(1, 2), kernel)  # K^T [G, c], as rows
        kt_g, kt_c = kt[:, :-1], kt[:, -1]
        x_t = x.transpose(1, 2)
        # Column sums of d loss / d log P, i.e. eps * d loss / d g (the row sums vanish).
        col = sqrt_a * sqrt_b * ((x_t * kt_g).sum(1) - kt_c)
        if ctx.exact:
            # alpha = -K beta is not asked for: it comes out of the cost gradient's products.
            beta = implicit_adjoint(kernel, torch.full_like(c, sqrt_a), sqrt_b, None, col / eps, ctx.tol, alpha=False, classes=classes)[1]
        else:
            # gradient="last_step": the potentials are held fixed (no adjoint solve), which is
            # exactly the gradient of one row update f = T_b(g) from the detached g, since the
            # row normalisation removes f. See docs/math/smc.md#gradient-modes.
            beta = torch.zeros_like(col)
        # d loss / d C = -(1/eps) d loss / d log P + K * (alpha_i sqrt(b_j) + sqrt(a) beta_j)
        #              = (sqrt(a) / eps) K * (eps beta_j - sqrt(b_j) (G_i . x_j - d_i)),
        # with d_i = c_i + eps alpha_i / sqrt(a). C_ij = ||x_i - x_j||^2 / D, so
        # d loss / d x_k = (2 / D) ((R_k + S_k) x_k - (H x)_k - (H^T x)_k) with R, S the
        # row and column sums of H = d loss / d C: all from H [x, 1] and H^T [x, 1].
        x1_t = torch.cat([x_t, torch.ones_like(x_t[:, :1])], 1)
        h_x, ht_x, kt_alpha = _cost_gradient_products(kernel, gs, x, c, sqrt_a, eps, sqrt_b, beta, x1_t)
        grad_log_b = col - eps * sqrt_b * kt_alpha
        scale = sqrt_a / eps
        sums = (h_x[:, -1] + ht_x[:, -1]) * scale
        h_x = h_x[:, :-1] * scale
        hs_x = torch.add(h_x, ht_x[:, :-1], alpha=scale)
        # (The coordinates' scales are differentiated by autograd, outside: see ensemble_solve.)
        grad_x = (2 / dim) * (sums.unsqueeze(-1) * x - hs_x.transpose(1, 2))
        grad_x = grad_x + sqrt_a * sqrt_b.unsqueeze(-1) * kt_g.transpose(1, 2)  # through x_j in P x
        return grad_x.reshape(shape), grad_log_b.reshape(shape[:-1]), None, None, None




# Above this many columns ((D + 2) (D + 1) for D-dimensional particles) the cost gradient is
# formed as an (N, N) matrix instead of through its low-rank factors (see
# _cost_gradient_products).
_LOW_RANK_MAX_WIDTH = 20


def _cost_gradient_products(
    kernel: Tensor, gs: Tensor, x: Tensor, c: Tensor, sqrt_a: float, eps: float, sqrt_b: Tensor, beta: Tensor, y_t: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r""":math:`(H y, H^\top y, K^\top \alpha)`: the first two as rows ``(B, q, N)`` for ``y`` given as rows
    ``y_t`` ``(B, q, N)`` whose last row is ones, with :math:`H = K \odot M` (elementwise; the
    factor :math:`\sqrt{a} / \epsilon` left to the caller) and
    :math:`M_{ij} = \epsilon \beta_j + \sqrt{b_j} \, d_i - \sqrt{b_j} \, G_i \cdot x_j`,
    :math:`d = c + \epsilon \alpha / \sqrt{a}` and :math:`\alpha = -K \beta` the adjoint's row part.

    ``M`` has rank ``D + 2``: :math:`M = \sum_r A_r B_r^\top` with :math:`A = [1, d, -G]` and
    :math:`B = [\epsilon \beta, \sqrt{b}, \sqrt{b} \, x]`, so :math:`H y = \sum_r A_r \odot K (B_r \odot y)` and
    :math:`H^\top y = \sum_r B_r \odot K^\top (A_r \odot y)`: two products of the kernel with ``(D + 2) q`` thin
    columns and no ``(N, N)`` temporary. They also carry :math:`\alpha` (the row of
    :math:`K (\epsilon \beta \odot 1)`) and :math:`K^\top \alpha` (one row more), which took two products
    of their own. Small ``D`` only: the explicit ``H`` (an ``(N, N)`` allocation, whose pages
    fault in afresh on each call, and six passes over it) wins when the columns outnumber
    ``_LOW_RANK_MAX_WIDTH``.
    """
    b, q, n = y_t.shape
    b_t = torch.cat([(eps * beta).unsqueeze(1), sqrt_b.unsqueeze(1), sqrt_b.unsqueeze(1) * x.transpose(1, 2)], 1)  # (B, R, N)
    r = b_t.shape[1]

    def left(k_beta: Tensor) -> Tensor:  # A = [1, d, -G] from K beta
        d = c - k_beta / sqrt_a
        return torch.cat([torch.ones_like(d).unsqueeze(1), d.unsqueeze(1), -gs.transpose(1, 2)], 1)

    if r * q > _LOW_RANK_MAX_WIDTH:
        k_beta = torch.bmm(beta.unsqueeze(1), kernel.transpose(1, 2)).squeeze(1)
        a_t = left(eps * k_beta)
        h = torch.bmm(a_t.transpose(1, 2), b_t).mul_(kernel)
        kt_alpha = torch.bmm(k_beta.neg().unsqueeze(1), kernel).squeeze(1)
        return torch.bmm(y_t, h.transpose(1, 2)), torch.bmm(y_t, h), kt_alpha
    k_by = torch.bmm((b_t.unsqueeze(2) * y_t.unsqueeze(1)).reshape(b, r * q, n), kernel.transpose(1, 2))
    eps_k_beta = k_by[:, q - 1]  # B_0 = eps beta times the row of ones: K (eps beta) = -eps alpha
    a_t = left(eps_k_beta)
    rows = torch.cat([(a_t.unsqueeze(2) * y_t.unsqueeze(1)).reshape(b, r * q, n), eps_k_beta.unsqueeze(1)], 1)
    kt_ay = torch.bmm(rows, kernel)
    h_y = (a_t.unsqueeze(2) * k_by.reshape(b, r, q, n)).sum(1)
    ht_y = (b_t.unsqueeze(2) * kt_ay[:, :-1].reshape(b, r, q, n)).sum(1)
    return h_y, ht_y, kt_ay[:, -1] / -eps


class EnsembleResult(NamedTuple):
    """One ensemble transform and the Sinkhorn solve behind it.

    Attributes:
        x_new: transported particles ``(..., N, D)``.
        plan: the plan ``(..., N, N)``, rows summing to ``1/N`` and columns to the weights
            (``None`` when :func:`ensemble_solve` was asked for no plan).
        solve: the :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` of the solve over the batch
            ``(...)``, all of it detached (potentials included).

    Example:
        >>> import torch
        >>> from pyro_smc.ops.ensemble import ensemble_solve
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
        >>> out = ensemble_solve(
        ...     torch.randn(2, 6, 1), torch.zeros(2, 6).log_softmax(-1), SinkhornSettings()
        ... )
        >>> out.x_new.shape, out.solve.converged.shape
        (torch.Size([2, 6, 1]), torch.Size([2]))
    """

    x_new: Tensor
    plan: Tensor | None
    solve: SinkhornResult


def ensemble_solve(x: Tensor, log_weights: Tensor, settings: SinkhornSettings, plan: bool = True, classes: Tensor | None = None) -> EnsembleResult:
    r"""The differentiable ensemble transform under ``settings``, with the solve's diagnostics.

    Solves entropic OT from the uniform measure on the particles to the weighted one with the
    squared-distance cost, each coordinate on its own spread (see the module docstring), and
    moves each particle to its barycentric image
    :math:`\tilde x_i = \sum_j P_{ij} x_j / \sum_j P_{ij}` (the row normalisation keeps every new particle a
    convex combination even before convergence). See ``docs/math/smc.md#optimal-transport-resampling``.

    Args:
        x: particles ``(..., N, D)``.
        log_weights: normalised log-weights ``(..., N)`` (``-inf`` allowed).
        settings: the Sinkhorn settings (:class:`~pyro_smc.ops.sinkhorn.SinkhornSettings`).
        plan: whether to return the plan. With ``False`` the ``"implicit"`` and ``"last_step"``
            modes skip one ``(..., N, N)`` product and allocation, and ``plan`` is ``None``.
        classes: int64 class ids ``(..., N)`` (:func:`~pyro_smc.ops.labels.label_classes`) to
            transport within: the plan is block-diagonal, no particle moves towards one of
            another class, and each class's weights must sum to its share ``n_k / N`` of the
            particles (:func:`~pyro_smc.ops.labels.class_weights` makes them so). ``None``: one
            class. See ``docs/math/smc.md#discrete-labels-and-optimal-transport``.

    Returns:
        An :class:`EnsembleResult` ``(x_new, plan, solve)``. With ``gradient="implicit"`` the
        plan carries no gradient (``x_new`` does, exactly); so with ``"last_step"``, which runs
        the same fused op with the potentials held fixed in the backward pass (no adjoint solve:
        cheaper, but only approximate); ``"unroll"`` differentiates the plan too.

    Raises:
        ValueError: if the weights do not sum to one, ``x`` and ``log_weights`` differ in dtype,
            or ``classes`` is not shaped as the weights.

    Example:
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(3, 10, 2), torch.randn(3, 10).log_softmax(-1)
        >>> out = ensemble_solve(
        ...     x, log_w, SinkhornSettings(threshold=1e-4, max_iter=500, gradient="unroll")
        ... )
        >>> out.solve.converged.tolist(), out.plan.requires_grad
        ([True, True, True], False)
    """
    n = x.shape[-2]
    check_unit_mass(log_weights)  # the source is uniform, of mass one
    if x.dtype != log_weights.dtype:
        raise ValueError(f"ensemble_solve: x ({x.dtype}) and log_weights ({log_weights.dtype}) must have one dtype")
    if classes is not None and classes.shape != log_weights.shape:
        raise ValueError(f"ensemble_solve: classes must be shaped as log_weights {tuple(log_weights.shape)}, got {tuple(classes.shape)}")
    # Each coordinate on its own scale: the transform of x / scale, scaled back, is that of the
    # cost sum_d (x_id - x_jd)^2 / (D var_d), the same for any units of any coordinate.
    scale = _coordinate_scale(x, classes)
    x = x / scale
    if settings.gradient in ("implicit", "last_step"):
        x_new, matrix, *result = _FusedEnsembleTransform.apply(x, log_weights, settings, plan, classes)
        return EnsembleResult(x_new * scale, matrix if plan else None, SinkhornResult(*result))
    x_c = _centred(x)
    cost = _normalised_cost(x_c)
    mean_cost = None if classes is None else separate_classes(cost, x_c, classes, x.shape[-1], settings.epsilon)
    log_a = torch.full_like(log_weights, -math.log(n))
    result = unrolled_solve(cost, log_a, log_weights, settings, mean_cost)
    matrix = transport_plan(cost, log_a, log_weights, result.f, result.g, settings.epsilon)
    x_new = (matrix @ x) / matrix.sum(-1, keepdim=True)
    return EnsembleResult(x_new * scale, matrix if plan else None, result._replace(f=result.f.detach(), g=result.g.detach()))


def _coordinate_scale(x: Tensor, classes: Tensor | None) -> Tensor:
    """The standard deviation of every coordinate over the particles of a filter ``(..., 1, D)``
    (or of each particle's class, ``(..., N, D)``); 1 for a coordinate that does not vary, which
    has nothing to transport. Differentiated with the rest."""
    if classes is not None:
        var = class_moments(x, classes)[1]
    elif x.shape[-2] > 1:
        var = x.var(-2, unbiased=False, keepdim=True)
    else:
        var = torch.zeros_like(x)
    # where() before sqrt(): the square root's derivative at a zero variance would be NaN.
    return torch.where(var > 0, var, torch.ones_like(var)).sqrt()


def ensemble_transform(
    x: Tensor,
    log_weights: Tensor,
    epsilon: float = 0.5,
    scaling: float = 0.75,
    threshold: float = 1e-3,
    max_iter: int = 100,
    gradient: str = "implicit",
) -> tuple[Tensor, Tensor]:
    r"""Differentiable ensemble transform: weighted particles to equally weighted ones.

    :func:`ensemble_solve` with the settings as keywords and without the diagnostics.

    Args:
        x: particles ``(..., N, D)``.
        log_weights: normalised log-weights ``(..., N)`` (``-inf`` allowed).
        epsilon, scaling, threshold, max_iter, gradient: as in
            :func:`pyro_smc.ops.sinkhorn.sinkhorn`.

    Returns:
        ``(x_new, plan)``: transported particles ``(..., N, D)`` and the plan ``(..., N, N)``
        whose rows sum to ``1/N`` and columns to the weights (gradient paths as for
        :func:`ensemble_solve`).

    Raises:
        ValueError: a setting out of range, or weights that do not sum to one.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(3, 10, 2, requires_grad=True)  # 3 filters of 10 particles
        >>> log_w = torch.randn(3, 10).log_softmax(-1)
        >>> x_new, plan = ensemble_transform(x, log_w, threshold=1e-4, max_iter=500)
        >>> x_new.shape, plan.shape
        (torch.Size([3, 10, 2]), torch.Size([3, 10, 10]))
        >>> weighted_mean = (log_w.exp().unsqueeze(-1) * x).sum(-2)
        >>> bool(torch.allclose(x_new.mean(-2), weighted_mean, atol=1e-3))
        True
        >>> x_new.sum().backward()
        >>> x.grad.shape
        torch.Size([3, 10, 2])
    """
    try:
        settings = SinkhornSettings(epsilon, scaling, threshold, max_iter, gradient)
    except ValueError as error:
        raise ValueError(f"ensemble_transform: {error}".replace("sinkhorn: ", "")) from None
    x_new, plan, _ = ensemble_solve(x, log_weights, settings)
    return x_new, plan
