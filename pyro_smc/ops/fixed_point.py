r"""Gradients of a fixed point by implicit differentiation.

See ``docs/math/ep.md#the-gradient-of-the-ep-evidence``.

An iteration ``theta <- F(theta, phi)`` that has converged to ``theta* = F(theta*, phi)`` defines
``theta*(phi)`` implicitly. Differentiating the fixed-point equation gives
:math:`d\theta^* / d\phi = (I - F_\theta)^{-1} F_\phi`, so a loss ``l(theta*)`` with gradient ``g`` at
``theta*`` has :math:`dl / d\phi = \lambda^\top F_\phi` where the adjoint ``lambda`` solves
:math:`\lambda = g + F_\theta^\top \lambda`. That equation is itself a fixed-point iteration of
vector-Jacobian products through one evaluation of ``F``, and it converges at the rate of the
forward iteration (the same Jacobian ``F_theta``, transposed). Nothing of the forward iterations
is stored: the memory is that of one evaluation of ``F``, however many iterations found
``theta*``.

The plain adjoint iteration needs ``F_theta`` to contract at ``theta*``. An iteration that
converged only thanks to damping that changed along the way (the parallel EP schedule adapts its
damping) can stop at a fixed point where the map evaluated with one fixed damping does not
contract, although ``I - F_theta`` is invertible and the gradient exists. When the plain
iteration fails, the adjoint equation :math:`(I - F_\theta^\top) \lambda = g` is solved by GMRES instead,
from the same vector-Jacobian products: it needs only ``I - F_theta`` invertible.

:func:`implicit_fixed_point` evaluates ``z = F(theta*)`` once with the graph, from a detached copy
``u`` of ``theta*``, and registers a hook on ``z`` that replaces the incoming gradient ``g`` by
the adjoint ``lambda``; autograd then carries ``lambda`` through the graph of ``z`` to ``phi``
(:math:`\lambda^\top F_\phi`). Anything computed from ``z`` downstream is differentiated as a function of
``theta*(phi)``.

Example:
    The fixed point of ``theta = 0.5 theta + phi`` is ``2 phi``:

    >>> import torch
    >>> from pyro_smc.ops.fixed_point import implicit_fixed_point
    >>> phi = torch.tensor(3.0, requires_grad=True)
    >>> theta = torch.tensor(6.0)                     # found by iterating without a graph
    >>> z = implicit_fixed_point(lambda u: 0.5 * u + phi, theta, tol=1e-10, max_iter=100)
    >>> (z ** 2).backward()                           # d(theta*^2)/dphi = 2 theta* * 2
    >>> phi.grad
    tensor(24.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["depends_on_other_leaves", "implicit_fixed_point"]


def depends_on_other_leaves(z: Tensor, u: Tensor) -> bool:
    """Whether the autograd graph of ``z`` reaches a leaf that requires grad other than ``u``.

    This tells a fixed point that depends on parameters (whose gradient is wanted) from one that
    depends on its own starting value only (nothing to differentiate).

    Example:
        >>> import torch
        >>> u, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        >>> depends_on_other_leaves(2 * u, u), depends_on_other_leaves(u * w, u)
        (False, True)
    """
    if z.grad_fn is None:
        return z.requires_grad and z is not u
    stack, seen = [z.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and leaf is not u:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def implicit_fixed_point(
    fn: Callable[[Tensor], Tensor],
    theta: Tensor,
    tol: float,
    max_iter: int,
    error: str | Callable[[], str | None] | None = None,
) -> Tensor:
    """``z = fn(theta)`` whose backward pass differentiates the fixed point ``theta = fn(theta)``
    implicitly.

    Args:
        fn: one evaluation of the iteration, ``(n,) -> (n,)``; closes over the parameters.
        theta: ``(n,)`` the converged fixed point (detached inside).
        tol: the adjoint iteration stops when the distance left to ``lambda``, estimated from
            the last step and the contraction rate of the last two (largest entry of each),
            is at most ``tol * max(1, max |lambda|)``.
        max_iter: most adjoint iterations; if they do not reach ``tol`` the backward pass raises.
        error: if not ``None``, the backward pass raises ``RuntimeError(error)`` instead of
            differentiating (``theta`` is known not to be a fixed point); a callable is asked at
            backward time (``None``: no error).

    Returns:
        ``z`` ``(n,)``, equal to ``fn(theta)``. It carries the implicit gradient when ``fn``
        depends on a tensor that requires grad, and is detached otherwise.

    Raises:
        RuntimeError: in the backward pass, when ``error`` is given or the adjoint iteration does
            not converge in ``max_iter`` steps (``fn`` does not contract at ``theta``).

    Example:
        The adjoint iteration's answer equals the closed form ``(1 - a)^{-1}``:

        >>> import torch
        >>> a = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
        >>> theta = torch.tensor(10.0, dtype=torch.float64)      # theta = a theta + 1
        >>> z = implicit_fixed_point(lambda u: a * u + 1, theta, tol=1e-12, max_iter=1000)
        >>> z.backward()  # d theta* / da = theta* / (1 - a)
        >>> round(a.grad.item(), 6)
        100.0
    """
    # First without a graph on theta: if no parameter requires grad there is no graph at all.
    # Building one on theta alone only to drop it killed the process once it was deep (EP's
    # sequential sweep at T = 1000: freeing it overflowed the C stack).
    probe = fn(theta.detach())
    if not probe.requires_grad:
        return probe
    del probe
    u = theta.detach().requires_grad_()
    z = fn(u)
    if not depends_on_other_leaves(z, u):
        return z.detach()

    inside = []  # the hook also fires on the adjoint's own backward passes from z: let those through

    def adjoint(g: Tensor) -> Tensor | None:
        if inside:
            return None
        message = error() if callable(error) else error
        if message is not None:
            raise RuntimeError(message)
        def vjp(v: Tensor) -> Tensor:
            inside.append(True)
            try:
                return torch.autograd.grad(z, u, v, retain_graph=True)[0]
            finally:
                inside.pop()

        lam, first, previous = g, None, None
        for _ in range(max_iter):
            new = g + vjp(lam)
            step = float((new - lam).abs().max()) if new.numel() else 0.0
            lam = new
            if _remaining(step, previous) <= tol * max(1.0, float(lam.abs().max()) if lam.numel() else 0.0):
                return lam
            first = step if first is None else first
            previous = step
            if not step < 1e6 * first:  # diverging (or not finite): no use going on
                break
        flat = _gmres(lambda v: v - vjp(v.reshape(g.shape)).reshape(-1), g.reshape(-1), tol, min(max_iter, g.numel()))
        if flat is not None:
            return flat.reshape(g.shape)
        raise RuntimeError(
            f"implicit differentiation: the adjoint iteration did not converge in {max_iter} steps "
            f"(last change {step:.3g}), and GMRES did not either: I - dF/dtheta is (nearly) singular "
            "at this point, so the fixed point is not a differentiable function of the parameters"
        )

    z.register_hook(adjoint)
    return z


def _remaining(step: float, previous: float | None) -> float:
    """The distance left to the adjoint's fixed point after a step of size ``step``, estimated
    from the contraction rate ``step / previous`` as ``step / (1 - rate)`` (a geometric tail).
    The step alone understates it by ``1 / (1 - rate)``: 100x for a map damped to contract by
    0.99 per step, which used to stop the iteration with the gradient 7% off. No estimate before
    the second step, or while the steps do not shrink (``inf``); a zero step is exact."""
    if step == 0.0:
        return 0.0
    if previous is None or not step < previous:
        return float("inf")
    return step / (1.0 - step / previous)


def _gmres(matvec: Callable[[Tensor], Tensor], b: Tensor, tol: float, max_dim: int) -> Tensor | None:
    """``x`` with ``|matvec(x) - b| <= tol |b|`` from the Krylov space of ``matvec`` and ``b``
    (GMRES without restarts, modified Gram-Schmidt); ``None`` if ``max_dim`` steps do not get
    there. ``b`` is a flat vector."""
    beta = float(b.norm())
    if beta == 0.0:
        return torch.zeros_like(b)
    basis = [b / beta]
    hessenberg = b.new_zeros(max_dim + 1, max_dim)
    for k in range(max_dim):
        w = matvec(basis[k])
        for i in range(k + 1):
            hessenberg[i, k] = torch.dot(basis[i], w)
            w = w - hessenberg[i, k] * basis[i]
        hessenberg[k + 1, k] = w.norm()
        h = hessenberg[: k + 2, : k + 1]
        rhs = b.new_zeros(k + 2, 1)
        rhs[0] = beta
        y = torch.linalg.lstsq(h, rhs).solution
        if float((rhs - h @ y).norm()) <= tol * beta:
            return torch.stack(basis[: k + 1], -1) @ y.squeeze(-1)
        if float(hessenberg[k + 1, k]) <= 1e-14 * beta:  # the Krylov space is exhausted
            return None
        basis.append(w / hessenberg[k + 1, k])
    return None
