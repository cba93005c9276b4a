r"""Batched log-domain entropic optimal transport (Sinkhorn) with exact implicit gradients.

See ``docs/math/smc.md#entropy-regularised-optimal-transport`` and
``docs/math/smc.md#implicit-differentiation`` and ``docs/math/smc.md#gradient-modes``.

Between a source measure ``a`` on points ``x_i`` and a target ``b`` on ``y_j`` with cost
``C_ij``, entropy-regularised OT solves

.. math::

    P^* = \arg\min_{P \in U(a, b)} \langle P, C \rangle + \varepsilon \, \mathrm{KL}(P \,\|\, a b^T).

Its dual potentials ``f, g`` are the fixed point of the soft-min maps

.. math::

    f_i = -\varepsilon \log \sum_j b_j e^{(g_j - C_{ij})/\varepsilon}, \qquad
    g_j = -\varepsilon \log \sum_i a_i e^{(f_i - C_{ij})/\varepsilon},

and the plan is ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``. When ``epsilon`` is small
against the cost, it is annealed geometrically down to ``epsilon`` with the symmetric, averaged
updates of Feydy et al. (2019). At ``epsilon`` the iterations run on a log-stabilised kernel
(two batched mat-vecs each; potentials absorbed, with an exact log-domain update, whenever the
scalings grow or overflow) and are over-relaxed: after three plain iterations each problem
measures its contraction rate and switches to the SOR factor it implies (Thibault et al. 2017),
which halved the iteration count at epsilon 0.1 and cut it 2-4x at 0.02 in the benchmarks. The
batch runs until the L1 error of every problem's marginals is below ``threshold``.

Gradients (``gradient=``):

* ``"implicit"`` (default): exact. The loop runs without autograd; the backward pass solves the
  adjoint of the fixed-point equations, a symmetric positive semi-definite system
  ``[[diag(a), P], [P^T, diag(b)]] [alpha; beta] = [df; dg]`` (one dense solve, or conjugate
  gradients for large problems). No iteration is stored.
* ``"unroll"``: autograd through every iteration, run in the log domain; exact for the iterate
  it returns; memory ``O(B N M)`` for the cost plus ``O(iterations * B * (N + M))``, time about
  twice the implicit mode's and more (an ``N x M`` exponential per half-iteration).
* ``"last_step"``: the loop runs without autograd and one differentiable update is taken from the
  converged, detached potentials. No adjoint solve, but only approximate: relative errors of
  0.3 to 0.6 in the ensemble transform's gradients at epsilon 0.5 (``benchmarks/bench_ot_cost.py``).

What keeps the gradients well posed (each found as a failure on sharp likelihoods, where most
particles' weights are near zero):

* the adjoint's null direction (the gauge ``f + c, g - c``) is removed by a rank-one term, so the
  system is definite on the right-hand sides the backward pass produces;
* points whose mass underflows to zero (``log b`` below about -104 in float32, -745 in float64)
  have their scalings pinned during the iterations and then receive their true potentials, the
  c-transforms of the others: a stale potential enters every log-space kernel through the
  still-finite ``log b`` and made float32 gradients of 1e13 and more;
* the unrolled loop works in the log domain (the kernel-domain scalings ``1 / (K v)`` have a
  derivative that overflows once a row sum underflows, and ``inf * 0`` made it NaN);
* the solver warns (:class:`SinkhornConvergenceWarning`) when a problem ends at ``max_iter``
  above ``threshold``, and the adjoint solve checks its own residual before its answer is used.

How each solve ended is not lost: :func:`sinkhorn_solve` returns a :class:`SinkhornResult`, the
potentials (with the gradient path of the chosen mode) and per-problem detached diagnostics
(``converged``, ``num_iterations``, ``marginal_error``); :func:`sinkhorn` returns the potentials
alone. Callers of ops built on the solver read its results with :func:`record_results`.

The pieces live in their own modules, in the spirit of OTT-JAX's problem / solver / output
split: :mod:`~pyro_smc.ops.sinkhorn_kernel` (stabilised-kernel building blocks),
:mod:`~pyro_smc.ops.sinkhorn_solver` (the forward solver, its stages and the result type) and
:mod:`~pyro_smc.ops.sinkhorn_unrolled` (the ``"unroll"`` mode). This module holds the entry
points and the implicit differentiation, and re-exports the helpers other modules import.

The differentiable ensemble transform (Corenflos et al., 2021) built on it is
:func:`pyro_smc.ops.ensemble.ensemble_transform`.

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import sinkhorn, sinkhorn_solve, squared_distances, transport_plan
    >>> x = torch.randn(3, 5, 2, dtype=torch.float64)           # 3 problems, 5 points each
    >>> cost = squared_distances(x, x)
    >>> log_a = torch.full((3, 5), -math.log(5), dtype=torch.float64)
    >>> log_b = torch.randn(3, 5, dtype=torch.float64).log_softmax(-1)
    >>> f, g = sinkhorn(cost, log_a, log_b, epsilon=0.1, threshold=1e-9, max_iter=2000)
    >>> plan = transport_plan(cost, log_a, log_b, f, g, 0.1)
    >>> torch.allclose(plan.sum(-2), log_b.exp(), atol=1e-8)
    True
    >>> result = sinkhorn_solve(cost, log_a, log_b, epsilon=0.1, threshold=1e-9, max_iter=2000)
    >>> result.converged.tolist(), bool(torch.equal(result.f, f))
    ([True, True, True], True)

References:
    Cuturi (2013). Sinkhorn distances. Thibault, Chizat, Dossal, Papadakis (2017). Overrelaxed
    Sinkhorn-Knopp algorithm for regularized optimal transport. Feydy et al. (2019).
    Interpolating between optimal transport and MMD using Sinkhorn divergences. Corenflos, Thornton, Deligiannidis, Doucet
    (2021). Differentiable particle filtering via entropy-regularized optimal transport.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

# The forward solver's names, re-exported: fused ops and tests import them from here.
from pyro_smc.ops.sinkhorn_kernel import (  # noqa: F401
    _colsum,
    _complete_zero_mass,
    _flushing,
    _log_domain_update,
    _log_kernel,
    _mask_kernel,
    _pinned_reciprocal,
    _rowsum,
    _soft_min,
    _soft_min_logits,
    _thin_matmul,
    _zero_mass,
)
from pyro_smc.ops.sinkhorn_solver import (  # noqa: F401
    _ANNEAL_START,
    _BIG,
    _MAX_OMEGA,
    _PLAIN_ITERS,
    SinkhornConvergenceWarning,
    SinkhornResult,
    _epsilon_schedule,
    _relaxation,
    _solve,
    _solve_loop,
    _warn_unconverged,
    record_results,
)
from pyro_smc.ops.sinkhorn_unrolled import _c_transforms, _SoftMin, _unrolled_log_loop  # noqa: F401

__all__ = [
    "GRADIENT_MODES",
    "SinkhornConvergenceWarning",
    "SinkhornResult",
    "squared_distances",
    "sinkhorn",
    "sinkhorn_solve",
    "record_results",
    "transport_plan",
    "check_equal_mass",
    "implicit_adjoint",
]

#: The ``gradient=`` modes of :func:`sinkhorn` and :class:`~pyro_smc.resamplers.OTResampler`.
GRADIENT_MODES = ("implicit", "unroll", "last_step")

# Above this many target points the adjoint system is solved by conjugate gradients
# instead of a dense factorisation (O(M^2) per iteration instead of O(M^3) once).
_DENSE_SOLVE_MAX = 512
# Conjugate-gradient steps tried before a small adjoint system is handed to the dense solve.
_CG_STEPS_BEFORE_DENSE = 25
# Relative residual of the adjoint solve above which its gradient is reported as unreliable.
_ADJOINT_RESIDUAL_WARN = 1e-2


def squared_distances(x: Tensor, y: Tensor) -> Tensor:
    """Pairwise squared Euclidean distances, differentiable everywhere.

    ``torch.cdist(x, y) ** 2`` has an infinite derivative at zero distance (the diagonal when
    ``x is y``); the expanded quadratic form does not.

    Args:
        x: points ``(..., N, D)``.
        y: points ``(..., M, D)``.

    Returns:
        ``||x_i - y_j||^2``, shape ``(..., N, M)``, clamped at zero.

    Example:
        >>> squared_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([[0.0, 0.0]])).tolist()
        [[0.0], [25.0]]
    """
    xx = (x * x).sum(-1).unsqueeze(-1)
    yy = (y * y).sum(-1).unsqueeze(-2)
    if x.dim() == 3 and y.dim() == 3:
        # One fused pass instead of three (about 3x faster for 32 x 100 x 100).
        return torch.baddbmm(xx + yy, x, y.transpose(-1, -2), alpha=-2).clamp_min(0)
    return (xx + yy - 2 * x @ y.transpose(-1, -2)).clamp_min(0)


def _adjoint_solve(kernel: Tensor, sqrt_b: Tensor, rhs: Tensor, tol: float) -> Tensor:
    """Solves ``(I - K^T K + s s^T) x = rhs`` for every problem of the batch.

    ``I - K^T K`` is positive semi-definite with null vector ``s = sqrt(b)`` (the gauge
    ``f + c, g - c`` of the potentials); adding ``s s^T`` makes it definite without changing the
    solution on the consistent right-hand sides the backward pass produces.

    Conjugate gradients come first: the system's condition number is ``1 / (1 - sigma_2^2)``
    with ``sigma_2`` the second singular value of ``K``, the same quantity that sets the
    contraction of the Sinkhorn iterations, so problems that converged in a few iterations
    need only a few CG steps (each two batched mat-vecs). Problems still unconverged after
    ``_CG_STEPS_BEFORE_DENSE`` steps (small epsilon) are finished by a dense Cholesky solve when
    they are small enough, by more CG steps otherwise.
    """
    s = sqrt_b / sqrt_b.norm(dim=-1, keepdim=True)
    m = kernel.shape[-1]
    tiny = torch.finfo(rhs.dtype).tiny
    # Below a few ulps the residual is rounding noise; asking for less would never stop.
    tol = max(tol, 30 * torch.finfo(rhs.dtype).eps)

    def matvec(v: Tensor) -> Tensor:
        return v - _colsum(kernel, _rowsum(kernel, v)) + s * (s * v).sum(-1, keepdim=True)

    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = (r * r).sum(-1, keepdim=True)
    stop = tol**2 * rs.clamp_min(tiny)
    max_steps = _CG_STEPS_BEFORE_DENSE if m <= _DENSE_SOLVE_MAX else 10 * m
    converged = rs <= stop
    for _ in range(max_steps):
        if bool(converged.all()):
            break
        ap = matvec(p)
        alpha = rs / (p * ap).sum(-1, keepdim=True).clamp_min(tiny)
        alpha = torch.where(converged, torch.zeros_like(alpha), alpha)
        x = x + alpha * p
        r = r - alpha * ap
        rs_new = (r * r).sum(-1, keepdim=True)
        converged = converged | (rs_new <= stop)
        p = r + (rs_new / rs.clamp_min(tiny)) * p
        rs = rs_new
    left = ~converged.squeeze(-1)
    if m <= _DENSE_SOLVE_MAX and bool(left.any()):
        k, sl = kernel[left], s[left]
        eye = torch.eye(m, dtype=kernel.dtype, device=kernel.device)
        mat = eye - k.transpose(-1, -2) @ k + sl.unsqueeze(-1) * sl.unsqueeze(-2)
        # The matrix is symmetric positive definite: Cholesky is about twice as fast as LU.
        chol, info = torch.linalg.cholesky_ex(mat)
        if bool((info == 0).all()):
            sol = torch.cholesky_solve(rhs[left].unsqueeze(-1), chol).squeeze(-1)
        else:
            sol = torch.linalg.solve(mat, rhs[left].unsqueeze(-1)).squeeze(-1)
        x = x.index_put((left.nonzero().squeeze(-1),), sol)
    # The system is only as well posed as the forward solve was accurate: far from the fixed
    # point K's top singular value leaves 1 and the matrix can lose definiteness. Check the
    # answer rather than trust it (one more pair of mat-vecs).
    residual = (matvec(x) - rhs).norm(dim=-1) / rhs.norm(dim=-1).clamp_min(tiny)
    worst = float(residual.max()) if residual.numel() else 0.0
    if not worst < _ADJOINT_RESIDUAL_WARN:
        warnings.warn(
            f"sinkhorn: the implicit-gradient (adjoint) solve left a relative residual of {worst:.3g}; the forward "
            "solve is probably not converged (raise max_iter, lower threshold or raise epsilon), so its gradient is unreliable",
            SinkhornConvergenceWarning,
            stacklevel=2,
        )
    return x


def implicit_adjoint(kernel: Tensor, sqrt_a: Tensor, sqrt_b: Tensor, grad_f: Tensor, grad_g: Tensor, tol: float) -> tuple[Tensor, Tensor]:
    """Adjoint variables of the Sinkhorn fixed point (the core of every implicit backward pass).

    With ``K_ij = P_ij / sqrt(a_i b_j)`` the adjoint system of the fixed-point equations reads
    ``[[I, K], [K^T, I]] [alpha; beta] = [grad_f / sqrt(a); grad_g / sqrt(b)]``; it stays finite
    (``K`` is zero there) for points of zero weight and its spectrum lies in ``[0, 2]``. The
    gradients of the loss with respect to the cost and the log-weights follow from ``alpha``
    and ``beta``:
    ``dC = K * (alpha_i sqrt(b_j) + sqrt(a_i) beta_j)``, ``d log a = -eps sqrt(a) K beta``,
    ``d log b = -eps sqrt(b) K^T alpha``.

    Args:
        kernel: ``K``, shape ``(..., N, M)``.
        sqrt_a, sqrt_b: square roots of the marginals, ``(..., N)`` and ``(..., M)``.
        grad_f, grad_g: incoming gradients with respect to the potentials, ``(..., N)`` and
            ``(..., M)``.
        tol: relative residual tolerance of the linear solve.

    Returns:
        ``(alpha, beta)``, shapes ``(..., N)`` and ``(..., M)``. A relative residual above
        ``1e-2`` is warned about (``SinkhornConvergenceWarning``).

    Example:
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> cost, log_a = squared_distances(x, x), torch.full((3,), -math.log(3))
        >>> log_b = torch.tensor([0.5, 0.3, 0.2]).log()
        >>> f, g = sinkhorn(cost, log_a, log_b, epsilon=0.1, threshold=1e-5, max_iter=500)
        >>> sqrt_a, sqrt_b = (log_a / 2).exp(), (log_b / 2).exp()
        >>> K = transport_plan(cost, log_a, log_b, f, g, 0.1) / (sqrt_a[:, None] * sqrt_b)
        >>> grad_g = torch.tensor([1.0, -2.0, 1.0])  # sums to 0: the system is consistent
        >>> alpha, beta = implicit_adjoint(K, sqrt_a, sqrt_b, torch.zeros(3), grad_g, 1e-6)
        >>> bool(torch.allclose(K @ beta, -alpha, atol=1e-4) and torch.allclose(K.T @ alpha + beta, grad_g / sqrt_b, atol=1e-4))
        True
    """
    r_f = grad_f / sqrt_a
    r_g = torch.where(sqrt_b > 0, grad_g / sqrt_b, torch.zeros_like(grad_g))
    beta = _adjoint_solve(kernel, sqrt_b, r_g - _colsum(kernel, r_f), tol)
    return r_f - _rowsum(kernel, beta), beta


class _ImplicitSinkhorn(torch.autograd.Function):
    """Potentials at the fixed point, differentiated by the implicit function theorem."""

    @staticmethod
    @_flushing
    def forward(ctx, cost, log_a, log_b, epsilon, scaling, threshold, max_iter, report):
        # report: a list that receives the solve's SinkhornResult (outputs stay f and g).
        with torch.no_grad():
            result, _ = _solve(cost, log_a, log_b, epsilon, scaling, threshold, max_iter)
        report.append(result)
        f, g = result.f, result.g
        ctx.save_for_backward(cost, log_a, log_b, f, g)
        ctx.epsilon = epsilon
        ctx.tol = min(1e-2, threshold)
        return f, g

    @staticmethod
    @_flushing
    def backward(ctx, grad_f, grad_g):
        cost, log_a, log_b, f, g = ctx.saved_tensors
        eps = ctx.epsilon
        log_a = log_a.expand(f.shape)
        log_b = log_b.expand(g.shape)
        grad_f = torch.zeros_like(f) if grad_f is None else grad_f
        grad_g = torch.zeros_like(g) if grad_g is None else grad_g
        # In the variables alpha' = sqrt(a) alpha, beta' = sqrt(b) beta the adjoint system is
        # symmetric positive semi-definite (see implicit_adjoint).
        half_a, half_b = log_a / 2, log_b / 2
        kernel = torch.exp(half_a.unsqueeze(-1) + half_b.unsqueeze(-2) + (f.unsqueeze(-1) + g.unsqueeze(-2) - cost) / eps)
        sqrt_a, sqrt_b = half_a.exp(), half_b.exp()
        alpha, beta = implicit_adjoint(kernel, sqrt_a, sqrt_b, grad_f, grad_g, ctx.tol * 1e-4)
        grad_cost = kernel * (alpha.unsqueeze(-1) * sqrt_b.unsqueeze(-2) + sqrt_a.unsqueeze(-1) * beta.unsqueeze(-2))
        grad_log_a = -eps * sqrt_a * _rowsum(kernel, beta)
        grad_log_b = -eps * sqrt_b * _colsum(kernel, alpha)
        return grad_cost, _unbroadcast(grad_log_a, ctx, 1), _unbroadcast(grad_log_b, ctx, 2), None, None, None, None, None


def _unbroadcast(grad: Tensor, ctx, index: int) -> Tensor | None:
    """Sums ``grad`` down to the shape of saved input ``index`` (``None`` if not needed)."""
    if not ctx.needs_input_grad[index]:
        return None
    shape = ctx.saved_tensors[index].shape
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


def _check_arguments(cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: float, max_iter: int, gradient: str) -> float:
    """Validates the arguments of :func:`sinkhorn_solve`; returns ``epsilon`` as a float."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"sinkhorn: epsilon must be finite and > 0, got {epsilon}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"sinkhorn: max_iter must be an int >= 1, got {max_iter!r}")
    if cost.dim() < 2 or log_a.shape[-1:] != cost.shape[-2:-1] or log_b.shape[-1:] != cost.shape[-1:]:
        raise ValueError(
            f"sinkhorn: cost (..., N, M) = {tuple(cost.shape)} needs log_a (..., N) and log_b (..., M), got {tuple(log_a.shape)} and {tuple(log_b.shape)}"
        )
    if gradient not in GRADIENT_MODES:
        raise ValueError(f"sinkhorn: gradient must be one of {GRADIENT_MODES}, got {gradient!r}")
    check_equal_mass(log_a, log_b)
    return float(epsilon)


def sinkhorn_solve(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: float,
    scaling: float = 0.75,
    threshold: float = 1e-3,
    max_iter: int = 100,
    gradient: str = "implicit",
) -> SinkhornResult:
    """Solves a batch of entropic OT problems and reports how each solve ended.

    The potentials are those of :func:`sinkhorn` with the same arguments, bit for bit and with
    the same gradient path; the diagnostics are detached.

    Args:
        cost, log_a, log_b, epsilon, scaling, threshold, max_iter, gradient: as in
            :func:`sinkhorn`.

    Returns:
        A :class:`SinkhornResult` ``(f, g, converged, num_iterations, marginal_error)``: the
        potentials ``(..., N)`` and ``(..., M)``, and per problem (shape ``(...)``, the batch)
        whether it met ``threshold`` within ``max_iter``, the iterations it ran at the final
        ``epsilon``, and the L1 marginal error last measured.

    Example:
        >>> import math, torch
        >>> x = torch.randn(2, 30, 2, dtype=torch.float64)
        >>> cost = squared_distances(x, x)
        >>> log_a = torch.full((2, 30), -math.log(30), dtype=torch.float64)
        >>> log_b = torch.randn(2, 30, dtype=torch.float64).mul(3).log_softmax(-1)
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", SinkhornConvergenceWarning)
        ...     hard = sinkhorn_solve(cost, log_a, log_b, 0.01, scaling=0.0, threshold=1e-6, max_iter=2)
        >>> hard.converged.tolist(), hard.num_iterations.tolist()
        ([False, False], [2, 2])
    """
    epsilon = _check_arguments(cost, log_a, log_b, epsilon, max_iter, gradient)
    if gradient == "implicit":
        report: list[SinkhornResult] = []
        f, g = _ImplicitSinkhorn.apply(cost, log_a, log_b, epsilon, scaling, threshold, max_iter, report)
        return report[0]._replace(f=f, g=g)
    if gradient == "unroll":
        return _unrolled_log_loop(cost, log_a, log_b, epsilon, scaling, threshold, max_iter)
    with torch.no_grad():
        result, _ = _solve(cost, log_a, log_b, epsilon, scaling, threshold, max_iter, stacklevel=4)
    # One differentiable row update from the detached g: the plan's rows are exact and its
    # derivatives are those of a row-softmax, which is what makes this mode approximate.
    return result._replace(f=_soft_min(cost, result.g, log_b, epsilon, rows=False))


def sinkhorn(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: float,
    scaling: float = 0.75,
    threshold: float = 1e-3,
    max_iter: int = 100,
    gradient: str = "implicit",
) -> tuple[Tensor, Tensor]:
    """Dual potentials of entropy-regularised OT for a batch of problems.

    Args:
        cost: cost matrices ``C``, shape ``(..., N, M)``.
        log_a: log source weights (summing to one), shape ``(..., N)``.
        log_b: log target weights (summing to one; ``-inf`` allowed), shape ``(..., M)``.
        epsilon: regularisation strength, ``> 0``, in the units of ``cost``.
        scaling: epsilon annealing factor in ``(0, 1)``. Annealing starts at a quarter of the
            mean cost, so it only runs when ``epsilon`` is below that. Use 0 to switch it off.
        threshold: each problem stops when the L1 error of both marginals is below this.
        max_iter: maximum number of iterations at the final ``epsilon``.
        gradient: ``"implicit"``, ``"unroll"`` or ``"last_step"`` (see the module docstring).

    Returns:
        ``(f, g)``, potentials of shapes ``(..., N)`` and ``(..., M)``. Whether the solve
        converged is only warned about here; :func:`sinkhorn_solve` returns it.

    Raises:
        ValueError: on a bad ``epsilon``, ``max_iter`` or ``gradient``, mismatched shapes, or
            measures of unequal mass.

    Example:
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> cost, log_a = squared_distances(x, x), torch.full((3,), -math.log(3))
        >>> log_b = torch.tensor([0.5, 0.3, 0.2]).log()
        >>> f, g = sinkhorn(cost, log_a, log_b, epsilon=0.1, threshold=1e-5, max_iter=500)
        >>> plan = transport_plan(cost, log_a, log_b, f, g, 0.1)
        >>> f.shape, bool(torch.allclose(plan.sum(-2), log_b.exp(), atol=1e-4))
        (torch.Size([3]), True)
    """
    f, g, *_ = sinkhorn_solve(cost, log_a, log_b, epsilon, scaling, threshold, max_iter, gradient)
    return f, g


def check_equal_mass(log_a: Tensor, log_b: Tensor) -> None:
    """Checks that two log-measures have the same total mass (to 1e-3 in log space).

    Args:
        log_a: ``(..., N)`` log-weights.
        log_b: ``(..., M)`` log-weights; batch dims broadcast with ``log_a``'s.

    Returns:
        ``None``.

    Raises:
        ValueError: if the log total masses differ by ``1e-3`` or more in any problem.

    Example:
        >>> check_equal_mass(torch.full((4,), 0.25).log(), torch.tensor([0.5, 0.5]).log())
        >>> check_equal_mass(torch.zeros(2), torch.zeros(3))
        Traceback (most recent call last):
            ...
        ValueError: sinkhorn: log_a and log_b must have equal total mass (log-mass gap 0.405)
    """
    mass_gap = (torch.logsumexp(log_a.detach(), -1) - torch.logsumexp(log_b.detach(), -1)).abs().max()
    if not float(mass_gap) < 1e-3:
        raise ValueError(f"sinkhorn: log_a and log_b must have equal total mass (log-mass gap {float(mass_gap):.3g})")


def transport_plan(cost: Tensor, log_a: Tensor, log_b: Tensor, f: Tensor, g: Tensor, epsilon: float) -> Tensor:
    """The plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` from the dual potentials.

    Args:
        cost: ``(..., N, M)``.
        log_a: ``(..., N)`` log source weights.
        log_b: ``(..., M)`` log target weights.
        f: ``(..., N)`` source potentials, e.g. from :func:`sinkhorn`.
        g: ``(..., M)`` target potentials.
        epsilon: the regularisation the potentials were computed at.

    Returns:
        ``(..., N, M)``: the plan, with marginals ``a`` and ``b`` up to the solver's error.

    Example:
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> cost, log_a = squared_distances(x, x), torch.full((3,), -math.log(3))
        >>> log_b = torch.tensor([0.5, 0.3, 0.2]).log()
        >>> f, g = sinkhorn(cost, log_a, log_b, epsilon=0.1, threshold=1e-5, max_iter=500)
        >>> plan = transport_plan(cost, log_a, log_b, f, g, 0.1)
        >>> [round(v, 3) for v in plan.sum(-1).tolist()], plan.shape
        ([0.333, 0.333, 0.333], torch.Size([3, 3]))
    """
    return torch.exp(log_a.unsqueeze(-1) + log_b.unsqueeze(-2) + (f.unsqueeze(-1) + g.unsqueeze(-2) - cost) / epsilon)
