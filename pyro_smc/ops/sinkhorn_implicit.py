r"""Sinkhorn for ``gradient="implicit"``: the potentials at the fixed point, differentiated by the
implicit function theorem.

See ``docs/math/smc.md#implicit-differentiation``.

The forward solve (:func:`pyro_smc.ops.sinkhorn_solver.forward_solve`) runs without autograd;
the backward pass solves the adjoint of the fixed-point equations (:func:`implicit_adjoint`), a
symmetric positive semi-definite system, by conjugate gradients with a dense Cholesky fallback.
No iteration is stored. :func:`implicit_adjoint` is also the core of the fused backward pass of
:func:`pyro_smc.ops.ensemble.ensemble_transform`; it is documented on
:mod:`pyro_smc.ops.sinkhorn`, which re-exports it.

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
    >>> from pyro_smc.ops.sinkhorn_implicit import implicit_solve
    >>> cost = torch.rand(2, 5, 5, dtype=torch.float64, requires_grad=True)
    >>> log_w = torch.full((2, 5), -math.log(5), dtype=torch.float64)
    >>> result = implicit_solve(
    ...     cost, log_w, log_w, SinkhornSettings(0.5, threshold=1e-8, max_iter=1000)
    ... )
    >>> result.f.requires_grad, result.converged.requires_grad, result.converged.tolist()
    (True, False, [True, True])
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn_kernel import colsum, flushing, rowsum
from pyro_smc.ops.sinkhorn_solver import solve_with_plan
from pyro_smc.ops.sinkhorn_types import SinkhornConvergenceWarning, SinkhornResult, SinkhornSettings, refuse_second_derivative

# implicit_adjoint is documented on (and re-exported by) pyro_smc.ops.sinkhorn; implicit_solve is
# reached through pyro_smc.ops.sinkhorn.solve.
__all__: list[str] = []

# Above this many target points the adjoint system is solved by conjugate gradients
# instead of a dense factorisation (O(M^2) per iteration instead of O(M^3) once).
_DENSE_SOLVE_MAX = 512
# Conjugate-gradient steps tried before a small adjoint system is handed to the dense solve.
_CG_STEPS_BEFORE_DENSE = 25
# Relative residual of the adjoint solve above which its gradient is reported as unreliable.
_ADJOINT_RESIDUAL_WARN = 1e-2


def _adjoint_solve(kernel: Tensor, sqrt_b: Tensor, rhs: Tensor, tol: float, classes: Tensor | None = None) -> Tensor:
    r"""Solves :math:`(I - K^\top K + \sum_k s_k s_k^\top) x = \mathrm{rhs}` for every problem of the batch.

    :math:`I - K^\top K` is positive semi-definite with a null vector for every block of ``K``: for a
    connected kernel :math:`s = \sqrt{b}` (the gauge ``f + c, g - c`` of the potentials), for a
    block-diagonal one (``classes``, the column classes ``(..., M)`` of a plan that stays
    within classes) :math:`s_k`, :math:`\sqrt{b}` on the columns of class ``k``, each with its own
    gauge. Adding the projections :math:`s_k s_k^\top` (normalised) makes the matrix definite without
    changing the solution on the consistent right-hand sides the backward pass produces.

    Conjugate gradients come first: the system's condition number is ``1 / (1 - sigma_2^2)``
    with ``sigma_2`` the second singular value of ``K``, the same quantity that sets the
    contraction of the Sinkhorn iterations, so problems that converged in a few iterations
    need only a few CG steps (each two batched mat-vecs). Problems still unconverged after
    ``_CG_STEPS_BEFORE_DENSE`` steps (small epsilon) are finished by a dense Cholesky solve when
    they are small enough, by more CG steps otherwise.
    """
    # Flattened to one batch dimension, vectors as rows (B, 1, M): each product with the kernel
    # is then one bmm, and the updates are fused in place (about 20 small ops per step instead
    # of 30; at 32 x 100 a step is two mat-vecs of 35 us and the rest is per-op overhead).
    shape, n, m = rhs.shape, kernel.shape[-2], kernel.shape[-1]
    kernel = kernel.reshape(-1, n, m)
    kernel_t = kernel.transpose(1, 2)
    sqrt_b, rhs = sqrt_b.expand(shape).reshape(-1, 1, m), rhs.reshape(-1, 1, m)
    gauge = _Gauge(sqrt_b, None if classes is None else classes.expand(shape).reshape(-1, 1, m))
    tiny = torch.finfo(rhs.dtype).tiny
    # Below a few ulps the residual is rounding noise; asking for less would never stop.
    tol = max(tol, 30 * torch.finfo(rhs.dtype).eps)

    def matvec(v: Tensor) -> Tensor:
        # baddbmm: the subtraction rides on the second product (35 us of 210 at 32 x 100 float64).
        return gauge.add_projection(torch.baddbmm(v, torch.bmm(v, kernel_t), kernel, alpha=-1), v)

    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = (r * r).sum(-1, keepdim=True)
    stop = tol**2 * rs.clamp_min(tiny)
    max_steps = _CG_STEPS_BEFORE_DENSE if m <= _DENSE_SOLVE_MAX else 10 * m
    # Written as "not above" so that a NaN residual stops its problem: with a forward solve far
    # from its fixed point the system can lose definiteness, and CG then blew up to NaN and ran
    # on to its 10 M steps (ten minutes at 8 x 1000 x 1000). Such a problem is left to the
    # residual check below, which warns.
    converged = ~(rs > stop)
    curvature = None  # the smallest p . A p met, None before the first step
    for _ in range(max_steps):
        if bool(converged.all()):
            break
        ap = matvec(p)
        pap = (p * ap).sum(-1, keepdim=True)
        curvature = pap if curvature is None else torch.minimum(curvature, pap)
        alpha = torch.where(converged, 0.0, rs / pap.clamp_min(tiny))
        x.addcmul_(alpha, p)
        r.addcmul_(alpha, ap, value=-1)
        rs_new = (r * r).sum(-1, keepdim=True)
        converged |= ~(rs_new > stop)
        p = torch.addcmul(r, rs_new / rs.clamp_min(tiny), p)
        rs = rs_new
    # A problem stopped on a NaN residual is not solved: the dense solve takes it too.
    left = ~(rs <= stop).reshape(-1)
    dense = m <= _DENSE_SOLVE_MAX and bool(left.any())
    if dense:
        k = kernel[left]
        eye = torch.eye(m, dtype=kernel.dtype, device=kernel.device)
        mat = eye - k.transpose(-1, -2) @ k + gauge.projection_matrix(left)
        # The matrix is symmetric positive definite: Cholesky is about twice as fast as LU.
        chol, info = torch.linalg.cholesky_ex(mat)
        if bool((info == 0).all()):
            sol = torch.cholesky_solve(rhs[left].transpose(1, 2), chol).transpose(1, 2)
        else:
            sol = torch.linalg.solve(mat, rhs[left].transpose(1, 2)).transpose(1, 2)
        x = x.index_put((left.nonzero().squeeze(-1),), sol)
    # The system is only as well posed as the forward solve was accurate: far from the fixed
    # point K's top singular value leaves 1 and the matrix can lose definiteness. While every
    # curvature p . A p is positive, CG's recurrence residual r is the true residual up to
    # rounding and the problems it stopped on are within tol; otherwise, or after the dense
    # solve, the answer is checked rather than trusted (one more pair of mat-vecs).
    if dense or curvature is None or not float(curvature.min()) > 0:
        residual = (matvec(x) - rhs).norm(dim=-1) / rhs.norm(dim=-1).clamp_min(tiny)
    else:
        residual = r.norm(dim=-1) / rhs.norm(dim=-1).clamp_min(tiny)
    worst = float(residual.max()) if residual.numel() else 0.0
    if not worst < _ADJOINT_RESIDUAL_WARN:
        warnings.warn(
            f"sinkhorn: the implicit-gradient (adjoint) solve left a relative residual of {worst:.3g}; the forward "
            "solve is probably not converged (raise max_iter, lower threshold or raise epsilon), so its gradient is unreliable",
            SinkhornConvergenceWarning,
            stacklevel=2,
        )
    return x.reshape(shape)


class _Gauge:
    """The normalised null vectors :math:`s_k` of the adjoint system, one per block of the kernel,
    for problems flattened to rows ``(B, 1, M)``: ``classes`` ``(B, 1, M)`` (``None``: one block)."""

    def __init__(self, sqrt_b: Tensor, classes: Tensor | None):
        self.classes = classes
        if classes is None:
            self.s = sqrt_b / sqrt_b.norm(dim=-1, keepdim=True)
        else:
            norms = torch.zeros_like(sqrt_b).scatter_add_(-1, classes, sqrt_b.square()).gather(-1, classes)
            self.s = sqrt_b / norms.sqrt().clamp_min(torch.finfo(sqrt_b.dtype).tiny)

    def add_projection(self, out: Tensor, v: Tensor) -> Tensor:
        r""":math:`\mathrm{out} + \sum_k s_k (s_k \cdot v)`."""
        if self.classes is None:
            return torch.addcmul(out, self.s, (self.s * v).sum(-1, keepdim=True))
        dots = torch.zeros_like(v).scatter_add_(-1, self.classes, self.s * v).gather(-1, self.classes)
        return torch.addcmul(out, self.s, dots)

    def projection_matrix(self, rows: Tensor) -> Tensor:
        r""":math:`\sum_k s_k s_k^\top` ``(b, M, M)`` of the problems selected by ``rows``."""
        s = self.s[rows]
        outer = s.transpose(1, 2) * s
        if self.classes is None:
            return outer
        classes = self.classes[rows]
        return outer * (classes.transpose(1, 2) == classes)


def implicit_adjoint(
    kernel: Tensor,
    sqrt_a: Tensor,
    sqrt_b: Tensor,
    grad_f: Tensor | None,
    grad_g: Tensor,
    tol: float,
    alpha: bool = True,
    classes: Tensor | None = None,
) -> tuple[Tensor | None, Tensor]:
    r"""Adjoint variables of the Sinkhorn fixed point (the core of every implicit backward pass).

    With :math:`K_{ij} = P_{ij} / \sqrt{a_i b_j}` the adjoint system of the fixed-point equations reads
    :math:`\begin{pmatrix} I & K \\ K^\top & I \end{pmatrix} \begin{pmatrix} \alpha \\ \beta \end{pmatrix}
    = \begin{pmatrix} \bar f / \sqrt{a} \\ \bar g / \sqrt{b} \end{pmatrix}` (:math:`\bar f, \bar g` the incoming
    ``grad_f``, ``grad_g``); it stays finite
    (``K`` is zero there) for points of zero weight and its spectrum lies in ``[0, 2]``. The
    gradients of the loss with respect to the cost and the log-weights follow from ``alpha``
    and ``beta``:
    :math:`\mathrm{d}C_{ij} = K_{ij} (\alpha_i \sqrt{b_j} + \sqrt{a_i} \beta_j)`, :math:`\mathrm{d}\log a = -\epsilon \sqrt{a} \odot K \beta`,
    :math:`\mathrm{d}\log b = -\epsilon \sqrt{b} \odot K^\top \alpha`.

    Args:
        kernel: ``K``, shape ``(..., N, M)``.
        sqrt_a, sqrt_b: square roots of the marginals, ``(..., N)`` and ``(..., M)``.
        grad_f, grad_g: incoming gradients with respect to the potentials, ``(..., N)`` and
            ``(..., M)``; ``grad_f=None`` stands for zero (one product with ``K`` less).
        tol: relative residual tolerance of the linear solve.
        alpha: whether to form ``alpha`` (one product with ``K``); ``None`` stands for it when
            not (callers that multiply ``K`` by ``beta`` anyway read it off their product).
        classes: for a block-diagonal kernel (a plan that stays within classes), the int64
            class ids ``(..., M)`` of the columns, rows of class ``k`` having no mass outside
            the columns of class ``k``: each block then has its own gauge (see
            ``docs/math/smc.md#discrete-labels-and-optimal-transport``).

    Returns:
        ``(alpha, beta)``, shapes ``(..., N)`` and ``(..., M)`` (``alpha`` ``None`` unless asked
        for). A relative residual above
        ``1e-2`` is warned about (``SinkhornConvergenceWarning``).

    Example:
        >>> import math
        >>> from pyro_smc.ops.sinkhorn import (
        ...     implicit_adjoint,
        ...     sinkhorn,
        ...     squared_distances,
        ...     transport_plan,
        ... )
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> cost, log_a = squared_distances(x, x), torch.full((3,), -math.log(3))
        >>> log_b = torch.tensor([0.5, 0.3, 0.2]).log()
        >>> f, g = sinkhorn(cost, log_a, log_b, epsilon=0.1, threshold=1e-5, max_iter=500)
        >>> sqrt_a, sqrt_b = (log_a / 2).exp(), (log_b / 2).exp()
        >>> K = transport_plan(cost, log_a, log_b, f, g, 0.1) / (sqrt_a[:, None] * sqrt_b)
        >>> grad_g = torch.tensor([1.0, -2.0, 1.0])  # sums to 0: the system is consistent
        >>> alpha, beta = implicit_adjoint(K, sqrt_a, sqrt_b, torch.zeros(3), grad_g, 1e-6)
        >>> bool(
        ...     torch.allclose(K @ beta, -alpha, atol=1e-4)
        ...     and torch.allclose(K.T @ alpha + beta, grad_g / sqrt_b, atol=1e-4)
        ... )
        True
    """
    r_g = torch.where(sqrt_b > 0, grad_g / sqrt_b, torch.zeros_like(grad_g))
    if grad_f is None:  # a zero right-hand side in f (the ensemble transform's): one product less
        beta = _adjoint_solve(kernel, sqrt_b, r_g, tol, classes)
        return (-rowsum(kernel, beta) if alpha else None), beta
    r_f = grad_f / sqrt_a
    beta = _adjoint_solve(kernel, sqrt_b, r_g - colsum(kernel, r_f), tol, classes)
    return (r_f - rowsum(kernel, beta) if alpha else None), beta


class _ImplicitSinkhorn(torch.autograd.Function):
    """Potentials at the fixed point, differentiated by the implicit function theorem; the
    solve's diagnostics are returned as non-differentiable outputs."""

    @staticmethod
    @flushing
    def forward(ctx, cost, log_a, log_b, settings):
        # Without a gradient to propagate (under no_grad, or constant inputs) no plan is kept.
        needed = any(ctx.needs_input_grad[:3])
        with torch.no_grad():
            result, plan = solve_with_plan(cost, log_a, log_b, settings, keep_plan=needed)
            f, g = result.f, result.g
            if needed:
                # The symmetric kernel of the adjoint, K_ij = P_ij / sqrt(a_i b_j), from the
                # solver's factored plan diag(a u) K diag(b v), in place: no exp over (B, N, M)
                # here or in the backward pass.
                half_a, half_b = log_a.expand(f.shape) / 2, log_b.expand(g.shape) / 2
                kernel = plan.unflatten(cost.shape[:-2]).symmetric_(half_a.exp(), half_b.exp())
                ctx.save_for_backward(kernel, half_a, half_b)
        ctx.weight_shapes = (log_a.shape, log_b.shape)
        ctx.epsilon = settings.epsilon
        ctx.tol = min(1e-2, settings.threshold)
        ctx.mark_non_differentiable(result.converged, result.num_iterations, result.marginal_error)
        return f, g, result.converged, result.num_iterations, result.marginal_error

    @staticmethod
    @flushing
    def backward(ctx, grad_f, grad_g, *_diagnostics):
        refuse_second_derivative("the Sinkhorn solve with gradient='implicit'")
        kernel, half_a, half_b = ctx.saved_tensors
        eps = ctx.epsilon
        grad_f = torch.zeros_like(half_a) if grad_f is None else grad_f
        grad_g = torch.zeros_like(half_b) if grad_g is None else grad_g
        # In the variables alpha' = sqrt(a) alpha, beta' = sqrt(b) beta the adjoint system is
        # symmetric positive semi-definite (see implicit_adjoint).
        sqrt_a, sqrt_b = half_a.exp(), half_b.exp()
        alpha, beta = implicit_adjoint(kernel, sqrt_a, sqrt_b, grad_f, grad_g, ctx.tol * 1e-4)
        grad_cost = kernel * (alpha.unsqueeze(-1) * sqrt_b.unsqueeze(-2) + sqrt_a.unsqueeze(-1) * beta.unsqueeze(-2))
        grad_log_a = -eps * sqrt_a * rowsum(kernel, beta)
        grad_log_b = -eps * sqrt_b * colsum(kernel, alpha)
        shape_a, shape_b = ctx.weight_shapes
        return grad_cost, _unbroadcast(grad_log_a, ctx.needs_input_grad[1], shape_a), _unbroadcast(grad_log_b, ctx.needs_input_grad[2], shape_b), None


def _unbroadcast(grad: Tensor, needed: bool, shape: torch.Size) -> Tensor | None:
    """Sums ``grad`` down to ``shape``, the shape of the input it is for (``None`` if not
    ``needed``)."""
    if not needed:
        return None
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


def implicit_solve(cost: Tensor, log_a: Tensor, log_b: Tensor, settings: SinkhornSettings) -> SinkhornResult:
    """The :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` of one solve whose potentials carry the
    exact implicit gradient; the diagnostics are detached. Arguments as for
    :func:`pyro_smc.ops.sinkhorn.solve` (which validates them).

    Example:
        >>> import math, torch
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
        >>> cost = torch.rand(3, 4, 4, requires_grad=True)
        >>> log_w = torch.full((3, 4), -math.log(4))
        >>> result = implicit_solve(cost, log_w, log_w, SinkhornSettings(0.5))
        >>> torch.autograd.grad(result.g.sum(), cost)[0].shape
        torch.Size([3, 4, 4])
    """
    return SinkhornResult(*_ImplicitSinkhorn.apply(cost, log_a, log_b, settings))
