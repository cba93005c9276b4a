r"""The differentiable ensemble transform: weighted particles to equally weighted ones by OT.

Corenflos et al. (2021) replace resampling by the barycentric projection of the entropic OT
plan from the uniform measure on the particles to the weighted one,

.. math::

    \tilde x_i = \frac{\sum_j P_{ij} x_j}{\sum_j P_{ij}}, \qquad
    C_{ij} = \frac{\lVert x_i - x_j \rVert^2}{\delta^2}, \qquad
    \delta = \sqrt{D} \max_k \operatorname{std}_i(x_{ik}),

which preserves the weighted mean (up to the marginal error) and is smooth in the particles and
the log-weights. ``delta`` makes ``epsilon`` free of the state's scale and dimension; it is
differentiated with the rest (Corenflos et al. detach it), so the gradient is the derivative of
the transform actually computed and matches its finite differences.

With ``gradient="implicit"`` the whole transform is one fused autograd function: Sinkhorn runs
without autograd, and the backward pass goes from ``d loss / d x_new`` to the gradients of the
particles and log-weights in a handful of passes over the ``N x N`` kernel plus one adjoint
solve (:func:`pyro_smc.ops.sinkhorn.implicit_adjoint`), instead of differentiating the cost,
the plan and the projection operation by operation. Two facts make this cheap:

* the row normalisation makes ``x_new`` invariant to the source potential ``f``, so the adjoint
  has a zero right-hand side in ``f``;
* with ``K = P / sqrt(a b^T)`` the column sums of ``P * (G x^T)`` needed for the log-weights are
  ``x_j . (K^T G)_j``: one ``N x (D + 1)`` product, no ``N x N`` temporary.

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
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.ops.sinkhorn import SinkhornResult, SinkhornSettings, check_equal_mass, implicit_adjoint, solve, squared_distances, transport_plan
from pyro_smc.ops.sinkhorn_kernel import colsum, flushing, thin_matmul
from pyro_smc.ops.sinkhorn_solver import forward_solve

__all__ = ["EnsembleResult", "ensemble_transform", "ensemble_solve"]


def _normalised_cost(x: Tensor) -> tuple[Tensor, Tensor]:
    """Returns the cost ``||x_i - x_j||^2 / delta^2`` and ``delta^2 = D max_k var_i(x_ik)``.

    ``delta`` is part of the function: it is differentiated like the rest (under autograd here,
    by hand in the fused backward), so the gradient is that of the computed transform and
    matches its finite differences. A degenerate cloud (all particles equal) has nothing to
    transport; its scale is set to 1, a constant, to avoid 0/0.
    """
    n, d = x.shape[-2:]
    if n > 1:
        scale2 = d * x.var(dim=-2, unbiased=False).amax(-1)
    else:
        scale2 = x.new_zeros(x.shape[:-2])
    scale2 = torch.where(scale2 > 0, scale2, torch.ones_like(scale2))
    return squared_distances(x, x).div_(scale2[..., None, None]), scale2


def _scale_gradient(x: Tensor, grad_scale2: Tensor) -> Tensor:
    """``d loss / d x`` through ``delta^2 = D var_k*(x)``, ``k*`` the widest coordinate (zero for
    degenerate clouds, whose scale is the constant 1)."""
    n, d = x.shape[-2:]
    centred = x - x.mean(-2, keepdim=True)
    var = centred.square().mean(-2)
    widest = var.argmax(-1, keepdim=True)  # (...,1)
    live = (d * var.gather(-1, widest)).squeeze(-1) > 0
    grad = torch.zeros_like(x)
    column = (2 * d / n) * centred.gather(-1, widest.unsqueeze(-2).expand(x.shape[:-1] + (1,)))
    grad.scatter_(-1, widest.unsqueeze(-2).expand(x.shape[:-1] + (1,)), column * torch.where(live, grad_scale2, torch.zeros_like(grad_scale2))[..., None, None])
    return grad


class _FusedEnsembleTransform(torch.autograd.Function):
    """``x_new`` and the plan; exact gradients via the implicit function theorem.

    See ``docs/math/smc.md#gradient-of-the-ensemble-transform``.
    """

    @staticmethod
    @flushing
    def forward(ctx, x, log_b, settings, want_plan):
        n = x.shape[-2]
        epsilon = settings.epsilon
        with torch.no_grad():
            cost, scale2 = _normalised_cost(x)
            log_a = torch.full_like(log_b, -math.log(n))
            result = forward_solve(cost, log_a, log_b, settings, stacklevel=4)
            f, g = result.f, result.g
            # K_ij = P_ij / sqrt(a_i b_j): the symmetric form the adjoint needs; P x and the
            # row sums of P come out of one product with [sqrt(b) x, sqrt(b)].
            sqrt_a = math.exp(-0.5 * math.log(n))
            sqrt_b = (log_b / 2).exp()
            kernel = (
                cost.neg_().add_(f.unsqueeze(-1) + 0.5 * epsilon * math.log(1.0 / n)).add_((g + 0.5 * epsilon * log_b).unsqueeze(-2)).div_(epsilon)
            ).exp_()
            moved = thin_matmul(kernel, torch.cat([sqrt_b.unsqueeze(-1) * x, sqrt_b.unsqueeze(-1)], -1))
            x_new = moved[..., :-1] / moved[..., -1:]
            rows = sqrt_a * moved[..., -1:]  # row sums of P
            # An (N, N) product the caller may not need (OTResampler reads it only for
            # particles it cannot average); an empty tensor stands in for it then.
            plan = kernel * (sqrt_a * sqrt_b).unsqueeze(-2) if want_plan else x.new_empty(0)
        ctx.save_for_backward(x, kernel, sqrt_b, rows, x_new, scale2)
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
        x, kernel, sqrt_b, rows, x_new, scale2 = ctx.saved_tensors
        sqrt_a, eps = ctx.sqrt_a, ctx.epsilon
        if grad_x_new is None:
            return None, None, None, None
        # x_new_i = sum_j P_ij x_j / r_i, so d loss / d log P_ij = P_ij (G_i . x_j - c_i) with
        # G_i = grad_i / r_i and c_i = G_i . x_new_i.
        gs = grad_x_new / rows
        c = (gs * x_new).sum(-1)
        kt = thin_matmul(kernel, torch.cat([gs, c.unsqueeze(-1)], -1), transpose=True)  # K^T [G, c]
        kt_g, kt_c = kt[..., :-1], kt[..., -1]
        # Column sums of d loss / d log P, i.e. eps * d loss / d g (the row sums vanish).
        col = sqrt_a * sqrt_b * ((x * kt_g).sum(-1) - kt_c)
        if ctx.exact:
            alpha, beta = implicit_adjoint(kernel, torch.full_like(c, sqrt_a), sqrt_b, torch.zeros_like(c), col / eps, ctx.tol)
        else:
            # gradient="last_step": the potentials are held fixed (no adjoint solve), which is
            # exactly the gradient of one row update f = T_b(g) from the detached g, since the
            # row normalisation removes f. See docs/math/smc.md#gradient-modes.
            alpha, beta = torch.zeros_like(c), torch.zeros_like(col)
        grad_log_b = col - eps * sqrt_b * colsum(kernel, alpha)
        # d loss / d C = -(1/eps) d loss / d log P + K * (alpha_i sqrt(b_j) + sqrt(a) beta_j)
        #              = (sqrt(a) / eps) K * (eps beta_j - sqrt(b_j) (G_i . x_j - d_i)),
        # with d_i = c_i + eps alpha_i / sqrt(a).
        d = c + eps * alpha / sqrt_a
        grad_cost = gs @ x.transpose(-1, -2)
        grad_cost.sub_(d.unsqueeze(-1)).mul_(-sqrt_b.unsqueeze(-2)).add_((eps * beta).unsqueeze(-2)).mul_(kernel)
        grad_cost.mul_(sqrt_a / eps)
        # C_ij = ||x_i - x_j||^2 / delta^2: d loss / d x_k = (2 / delta^2) ((R_k + S_k) x_k
        # - (H x)_k - (H^T x)_k) with R, S the row and column sums of H = d loss / d C.
        x1 = torch.cat([x, torch.ones_like(x[..., :1])], -1)
        h_x = thin_matmul(grad_cost, x1)
        ht_x = thin_matmul(grad_cost, x1, transpose=True)
        sums = (h_x[..., -1] + ht_x[..., -1]).unsqueeze(-1)
        grad_x = (2 / scale2)[..., None, None] * (sums * x - h_x[..., :-1] - ht_x[..., :-1])
        # Through the scale: d loss / d delta^2 = -sum_ij H_ij ||x_i - x_j||^2 / delta^4, where
        # sum_ij H_ij ||x_i - x_j||^2 = sum_i (R_i + S_i) |x_i|^2 - 2 sum_i x_i . (H x)_i.
        spread = (sums.squeeze(-1) * x.square().sum(-1) - 2 * (x * h_x[..., :-1]).sum(-1)).sum(-1)
        grad_x = grad_x + _scale_gradient(x, -spread / scale2.square())
        grad_x = grad_x + sqrt_a * sqrt_b.unsqueeze(-1) * kt_g  # through x_j in P x
        return grad_x, grad_log_b, None, None


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


def ensemble_solve(x: Tensor, log_weights: Tensor, settings: SinkhornSettings, plan: bool = True) -> EnsembleResult:
    r"""The differentiable ensemble transform under ``settings``, with the solve's diagnostics.

    Solves entropic OT from the uniform measure on the particles to the weighted one with the
    scale-normalised squared-distance cost and moves each particle to its barycentric image
    ``x~_i = sum_j P_ij x_j / sum_j P_ij`` (the row normalisation keeps every new particle a
    convex combination even before convergence). See ``docs/math/smc.md#optimal-transport-resampling``.

    Args:
        x: particles ``(..., N, D)``.
        log_weights: normalised log-weights ``(..., N)`` (``-inf`` allowed).
        settings: the Sinkhorn settings (:class:`~pyro_smc.ops.sinkhorn.SinkhornSettings`).
        plan: whether to return the plan. With ``False`` the ``"implicit"`` and ``"last_step"``
            modes skip one ``(..., N, N)`` product and allocation, and ``plan`` is ``None``.

    Returns:
        An :class:`EnsembleResult` ``(x_new, plan, solve)``. With ``gradient="implicit"`` the
        plan carries no gradient (``x_new`` does, exactly); so with ``"last_step"``, which runs
        the same fused op with the potentials held fixed in the backward pass (no adjoint solve:
        cheaper, but only approximate); ``"unroll"`` differentiates the plan too.

    Raises:
        ValueError: if the weights do not sum to one.

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
    log_a = torch.full_like(log_weights, -math.log(n))
    check_equal_mass(log_a, log_weights)
    if settings.gradient in ("implicit", "last_step"):
        x_new, matrix, *result = _FusedEnsembleTransform.apply(x, log_weights, settings, plan)
        return EnsembleResult(x_new, matrix if plan else None, SinkhornResult(*result))
    cost, _ = _normalised_cost(x)
    result = solve(cost, log_a, log_weights, settings)
    matrix = transport_plan(cost, log_a, log_weights, result.f, result.g, settings.epsilon)
    x_new = (matrix @ x) / matrix.sum(-1, keepdim=True)
    return EnsembleResult(x_new, matrix if plan else None, result._replace(f=result.f.detach(), g=result.g.detach()))


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
