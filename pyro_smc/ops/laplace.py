r"""Gaussian approximations for the start of an online filtering step (pure tensor math).

* :func:`laplace_newton`: the Laplace approximation of ``N(x; m, P) g(x)`` by Newton steps on its
  log, with the curvature of ``log g`` clipped to its concave part so that every step has a
  positive-definite precision. For a linear-Gaussian ``g`` the first step is the Kalman update;
  for a heavy-tailed ``g`` far from the data (where ``log g`` is convex) a step is a
  preconditioned gradient step with backtracking instead of a jump.
* :func:`posterior_scale_tril`: the Cholesky factor of :math:`(P^{-1} + H)^{-1}` by two QR
  factorisations, accurate where :math:`H` dwarfs :math:`P^{-1}` (a precise observation in float32).
* :func:`regression_kernel`: the linear-Gaussian regression :math:`x_{\mathrm{prev}} \mid x \sim \mathcal N(W x + b, S)` of one
  set of paired samples on another (the backward kernel implied by a joint Gaussian), its
  residual covariance from the residuals themselves (no cancellation).
* :func:`jittered`: a symmetrised covariance with a relative jitter of ``1e-6`` on its diagonal.

See ``docs/math/streaming.md#initialising-a-step``.

Example:
    >>> import torch
    >>> m, P = torch.zeros(1, dtype=torch.float64), torch.eye(1, dtype=torch.float64)
    >>> def log_g(x):  # y = 2 observed with noise variance 1
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

__all__ = ["gram_scale_tril", "jittered", "laplace_newton", "posterior_scale_tril", "regression_kernel"]


def gram_scale_tril(a: Tensor) -> Tensor:
    r"""The lower-triangular factor :math:`L` with a non-negative diagonal and
    :math:`L L^\top = A^\top A`, from the QR factorisation of :math:`A` (never forming
    :math:`A^\top A`, whose condition number is the square of :math:`A`'s).

    QR leaves the signs of :math:`R`'s rows free; flipping the rows with a negative diagonal
    gives the Cholesky factor's sign convention.

    Args:
        a: ``(n, d)`` with ``n >= d``.

    Returns:
        ``(d, d)`` lower triangular.

    Example:
        >>> a = torch.tensor([[3.0, 0.0], [4.0, 5.0]], dtype=torch.float64)
        >>> L = gram_scale_tril(a)
        >>> torch.allclose(L @ L.T, a.T @ a), bool((L.diagonal() > 0).all())
        (True, True)
    """
    R = torch.linalg.qr(a, mode="r").R
    return R.T * torch.where(R.diagonal() < 0, -1.0, 1.0).to(R)


def jittered(cov: Tensor) -> Tensor:
    r""":math:`(\Sigma + \Sigma^\top) / 2` (:math:`\Sigma` = ``cov``) plus ``1e-6`` times its mean absolute diagonal on the diagonal.

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


def posterior_scale_tril(prior_tril: Tensor, curvature: Tensor) -> Tensor:
    r"""The lower Cholesky factor of :math:`(P^{-1} + H)^{-1}`, never forming either matrix.

    With :math:`P = L L^\top` and :math:`H = V \operatorname{diag}(h) V^\top` (:math:`h \ge 0`), :math:`(P^{-1} + H)^{-1} = L (I + B B^\top)^{-1} L^\top`
    for :math:`B = L^\top V \operatorname{diag}(h)^{1/2}`; the QR factorisation :math:`[I; B^\top] = Q R` gives :math:`R^\top R = I + B B^\top`
    with :math:`R`'s singular values at least 1, so the factor :math:`L R^{-1}` (made triangular by a
    second QR) is accurate even where :math:`H` is ``1e8`` times :math:`P^{-1}`, which the dense inverse of
    :math:`P^{-1} + H` is not in float32 (it comes out indefinite).

    Args:
        prior_tril: ``L`` ``(d, d)``, lower triangular with a positive diagonal.
        curvature: ``H`` ``(d, d)``, symmetric positive semi-definite.

    Returns:
        ``(d, d)`` lower triangular with a positive diagonal.

    Example:
        >>> L = torch.eye(2, dtype=torch.float64)
        >>> S = posterior_scale_tril(
        ...     L, torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
        ... )
        >>> [round(v, 6) for v in (S @ S.T).diagonal().tolist()]        # 1 / (1 + h)
        [0.5, 0.25]
    """
    d = prior_tril.shape[-1]
    vals, vecs = torch.linalg.eigh(symmetrize(curvature))
    B = prior_tril.T @ (vecs * vals.clamp_min(0).sqrt())
    eye = torch.eye(d, dtype=prior_tril.dtype, device=prior_tril.device)
    R = torch.linalg.qr(torch.cat([eye, B.T], dim=0), mode="r").R
    factor_t = torch.linalg.solve_triangular(R.T, prior_tril.T, upper=False)  # (L R^{-1})^T
    return gram_scale_tril(factor_t)  # L R^{-1} (L R^{-1})^T = factor_t^T factor_t


@torch.enable_grad()
def laplace_newton(
    log_g: Callable[[Tensor], Tensor], mean: Tensor, cov: Tensor, max_steps: int = 5, *, return_scale_tril: bool = False
) -> tuple[Tensor, Tensor]:
    """The Laplace approximation of ``N(x; mean, cov) g(x)`` by clipped Newton steps.

    See ``docs/math/streaming.md#laplace-approximation-by-newton-steps``.

    Args:
        log_g: ``x (d,) -> log g(x)`` (a scalar), twice differentiable.
        mean: prior mean ``(d,)``.
        cov: prior covariance ``(d, d)``, positive definite.
        max_steps: the most Newton steps; it stops earlier once a step is below ``1e-6`` relative.
        return_scale_tril: return the covariance's lower Cholesky factor instead of the
            covariance (exact to rounding even where the posterior is far narrower than the prior
            in some directions; see :func:`posterior_scale_tril`).

    Returns:
        ``(loc, cov)``: the mode found and the inverse of the (clipped) negative Hessian there
        (or its Cholesky factor), both detached. Where the gradient is not finite, the last good
        iterate is returned.

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
    prior_tril = torch.linalg.cholesky(cov)

    def objective(x: Tensor) -> Tensor:
        z = torch.linalg.solve_triangular(prior_tril, (x - mean).unsqueeze(-1), upper=False).squeeze(-1)
        return log_g(x) - 0.5 * z.square().sum()

    x, tril = mean.detach().clone(), prior_tril
    for _ in range(max_steps):
        xg = x.clone().requires_grad_(True)
        value = objective(xg)
        (grad,) = torch.autograd.grad(value, xg)
        hess = torch.autograd.functional.hessian(log_g, x)
        if not (bool(torch.isfinite(grad).all()) and bool(torch.isfinite(hess).all())):
            break
        # Only the concave part of log g adds precision: convex directions would make it indefinite.
        new_tril = posterior_scale_tril(prior_tril, -hess)
        if not bool(torch.isfinite(new_tril).all()):
            break
        tril = new_tril
        step = tril @ (tril.T @ grad)
        # Backtracking: where the curvature was clipped the full step can overshoot.
        for _ in range(20):
            with torch.no_grad():
                if float(objective(x + step)) >= float(value):
                    break
            step = step / 2
        x = (x + step).detach()
        if float(step.abs().max()) <= 1e-6 * (1 + float(x.abs().max())):
            break
    tril = tril.detach()
    return x, tril if return_scale_tril else tril @ tril.T


def regression_kernel(x: Tensor, x_prev: Tensor, *, return_scale_tril: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    r"""Least-squares Gaussian regression of ``x_prev`` on ``x`` from paired samples.

    See ``docs/math/streaming.md#initialising-a-step``.

    The residual covariance is the Gram matrix of the residuals :math:`x_{\mathrm{prev}} - W x - b` (not the
    Schur complement :math:`S_{pp} - W S_{px}^\top`, which loses to cancellation every direction in which
    ``x_prev`` is far narrower than in others), factorised by QR; its diagonal is floored at ten
    rounding errors of each coordinate's spread, which keeps it positive definite when ``x_prev``
    is an exact linear function of ``x``.

    Args:
        x: ``(n, d)`` samples of the regressor.
        x_prev: ``(n, d)`` the paired samples of the response.
        return_scale_tril: return the residual covariance's lower Cholesky factor instead.

    Returns:
        ``(weight (d, d), bias (d,), cov (d, d))`` with :math:`x_{\mathrm{prev}} \mid x \sim \mathcal N(W x + b, S)` (``weight``, ``bias``, ``cov``)
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
    s_xx, s_px = xc.T @ xc / n, pc.T @ xc / n
    weight = torch.linalg.solve(jittered(s_xx), s_px.T).T
    bias = x_prev.mean(0) - weight @ x.mean(0)
    residuals = (pc - xc @ weight.T) / n**0.5
    tril = gram_scale_tril(residuals)
    floor = 10 * torch.finfo(x_prev.dtype).eps * pc.abs().amax(0).clamp_min(torch.finfo(x_prev.dtype).tiny)
    tril = tril.tril(-1) + torch.diag_embed(torch.maximum(tril.diagonal(), floor))
    return weight, bias, tril if return_scale_tril else tril @ tril.T
