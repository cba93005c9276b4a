r"""Gaussian approximations for the start of an online filtering step (pure tensor math).

* :func:`laplace_newton`: the Laplace approximation of ``N(x; m, P) g(x)`` by Newton steps on its
  log, with the curvature of ``log g`` clipped to its concave part so that every step has a
  positive-definite precision. For a linear-Gaussian ``g`` the first step is the Kalman update;
  for a heavy-tailed ``g`` far from the data (where ``log g`` is convex) a step is a
  preconditioned gradient step with backtracking instead of a jump.
* :func:`regression_kernel`: the linear-Gaussian regression ``x_prev | x ~ N(W x + b, S)`` of one
  set of paired samples on another (the backward kernel implied by a joint Gaussian).
* :func:`jittered`: a symmetrised covariance with a relative jitter of ``1e-6`` on its diagonal.

See ``docs/math/streaming.md#initialising-a-step``.

Example:
    >>> import torch
    >>> m, P = torch.zeros(1, dtype=torch.float64), torch.eye(1, dtype=torch.float64)
    >>> def log_g(x):                                  # y = 2 observed with noise variance 1
    ...     return -0.5 * (2.0 - x).square().sum()
    >>> loc, cov = laplace_newton(log_g, m, P)
    >>> round(float(loc), 6), round(float(cov), 6)     # the Kalman update
    (1.0, 0.5)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pyro_smc.ops.gaussian import symmetrize

__all__ = ["jittered", "laplace_newton", "regression_kernel"]


def jittered(cov: Tensor) -> Tensor:
    """``(cov + cov^T) / 2`` plus ``1e-6`` times its mean absolute diagonal on the diagonal.

    Args:
        cov: ``(d, d)``.

    Returns:
        ``(d, d)`` symmetric.

    Example:
        >>> out = jittered(torch.tensor([[2.0, 1.0], [0.0, 2.0]]))
        >>> [round(v, 4) for v in out.flatten().tolist()], bool((out.diagonal() > 2.0).all())
        ([2.0, 0.5, 0.5, 2.0], True)
    """
    cov = symmetrize(cov)
    scale = cov.diagonal().abs().mean().clamp_min(torch.finfo(cov.dtype).tiny)
    return cov + 1e-6 * scale * torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)


@torch.enable_grad()
def laplace_newton(log_g: Callable[[Tensor], Tensor], mean: Tensor, cov: Tensor, max_steps: int = 5) -> tuple[Tensor, Tensor]:
    """The Laplace approximation of ``N(x; mean, cov) g(x)`` by clipped Newton steps.

    See ``docs/math/streaming.md#laplace-approximation-by-newton-steps``.

    Args:
        log_g: ``x (d,) -> log g(x)`` (a scalar), twice differentiable.
        mean: prior mean ``(d,)``.
        cov: prior covariance ``(d, d)``, positive definite.
        max_steps: the most Newton steps; it stops earlier once a step is below ``1e-6`` relative.

    Returns:
        ``(loc, cov)``: the mode found and the inverse of the (clipped) negative Hessian there,
        both detached. Where a step's precision is not positive definite or the gradient is not
        finite, the last good iterate is returned.

    Raises:
        RuntimeError: (``torch.linalg.LinAlgError``) if ``cov`` is not positive definite.

    Example:
        >>> def log_g(x):  # Student-t likelihood of y = 1 with 3 degrees of freedom
        ...     return -2.0 * torch.log1p((1.0 - x).square().sum() / 3)
        >>> loc, cov = laplace_newton(log_g, torch.zeros(1), torch.eye(1))
        >>> x = loc.clone().requires_grad_()
        >>> (grad,) = torch.autograd.grad(log_g(x) - 0.5 * x.square().sum(), x)
        >>> loc.shape, cov.shape, abs(float(grad)) < 1e-4  # a mode of the product
        (torch.Size([1]), torch.Size([1, 1]), True)
    """
    prec_prior = torch.cholesky_inverse(torch.linalg.cholesky(cov))

    def objective(x: Tensor) -> Tensor:
        r = x - mean
        return log_g(x) - 0.5 * r @ prec_prior @ r

    x, new_cov = mean.detach().clone(), cov
    for _ in range(max_steps):
        xg = x.clone().requires_grad_(True)
        value = objective(xg)
        (grad,) = torch.autograd.grad(value, xg)
        hess = torch.autograd.functional.hessian(log_g, x)
        # Only the concave part of log g adds precision: convex directions would make it indefinite.
        vals, vecs = torch.linalg.eigh(-0.5 * (hess + hess.T))
        curvature = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.T
        chol, info = torch.linalg.cholesky_ex(prec_prior + curvature)
        if int(info) != 0 or not bool(torch.isfinite(grad).all()):
            break
        new_cov = torch.cholesky_inverse(chol)
        step = new_cov @ grad
        # Backtracking: where the curvature was clipped the full step can overshoot.
        for _ in range(20):
            with torch.no_grad():
                if float(objective(x + step)) >= float(value):
                    break
            step = step / 2
        x = (x + step).detach()
        if float(step.abs().max()) <= 1e-6 * (1 + float(x.abs().max())):
            break
    return x, new_cov.detach()


def regression_kernel(x: Tensor, x_prev: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Least-squares Gaussian regression of ``x_prev`` on ``x`` from paired samples.

    See ``docs/math/streaming.md#initialising-a-step``.

    Args:
        x: ``(n, d)`` samples of the regressor.
        x_prev: ``(n, d)`` the paired samples of the response.

    Returns:
        ``(weight (d, d), bias (d,), cov (d, d))`` with ``x_prev | x ~ N(weight x + bias, cov)``
        under the samples' joint moments: the exact backward kernel when they are jointly Gaussian.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(500, 2)
        >>> x_prev = x @ torch.tensor([[0.5, 0.0], [1.0, 2.0]]).T + torch.tensor([1.0, -1.0])
        >>> weight, bias, cov = regression_kernel(x, x_prev)  # a noiseless linear relation
        >>> [round(v, 3) for v in weight.flatten().tolist() + bias.tolist()]
        [0.5, 0.0, 1.0, 2.0, 1.0, -1.0]
    """
    n = len(x)
    xc, pc = x - x.mean(0), x_prev - x_prev.mean(0)
    s_xx, s_px, s_pp = xc.T @ xc / n, pc.T @ xc / n, pc.T @ pc / n
    weight = torch.linalg.solve(jittered(s_xx), s_px.T).T
    bias = x_prev.mean(0) - weight @ x.mean(0)
    return weight, bias, jittered(s_pp - weight @ s_px.T)
