r"""The unscented transform: moments of :math:`f(x)` for :math:`x \sim \mathcal N(m, P)` from :math:`2d + 1` sigma points.

Sigma points :math:`m` and :math:`m \pm \sqrt{d + \lambda} \, L_i` (:math:`L` the Cholesky factor of :math:`P`,
:math:`\lambda = \alpha^2 (d + \kappa) - d`) with mean weights :math:`W_0 = \lambda / (d + \lambda)`,
:math:`W_i = 1 / (2 (d + \lambda))` and covariance weight :math:`W_0^c = W_0 + 1 - \alpha^2 + \beta`
(Julier and Uhlmann; Sarkka, *Bayesian Filtering and Smoothing*, section 5.5). The transform is
exact for linear ``f``. See ``docs/math/ep.md#unscented-transform``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.unscented import unscented_moments
    >>> m, P = torch.zeros(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    >>> A = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
    >>> mean, cov, cross = unscented_moments(lambda x: x @ A.T, m, P)
    >>> bool(torch.allclose(cov, A @ A.T))
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["sigma_points", "sigma_weights", "unscented_moments", "unscented_transform"]


def sigma_points(mean: Tensor, cov: Tensor, alpha: float = 1.0, beta: float = 0.0, kappa: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sigma points and weights.

    Args:
        mean: ``(..., d)``.
        cov: ``(..., d, d)`` positive definite.
        alpha, beta: spread and prior-knowledge parameters.
        kappa: secondary scaling; ``None`` means ``3 - d`` clipped at 0 (Sarkka's default for
            small ``d``, kept non-negative so the weights stay valid for larger ``d``).

    Returns:
        ``(points (..., 2d+1, d), mean_weights (2d+1,), cov_weights (2d+1,))``.

    Raises:
        RuntimeError: (``torch.linalg.LinAlgError``) if ``cov`` is not positive definite.

    Example:
        >>> points, wm, wc = sigma_points(
        ...     torch.tensor([1.0, -1.0]), torch.diag(torch.tensor([4.0, 1.0]))
        ... )
        >>> points.shape, round(float(wm.sum()), 4)
        (torch.Size([5, 2]), 1.0)
        >>> bool(torch.allclose(wm @ points, torch.tensor([1.0, -1.0])))
        True
    """
    wm, wc, pattern, _ = _weights(mean.shape[-1], float(alpha), float(beta), None if kappa is None else float(kappa), mean.dtype, mean.device)
    points = mean.unsqueeze(-2) + pattern @ torch.linalg.cholesky(cov).transpose(-1, -2)
    return points, wm.clone(), wc.clone()  # the cached weights stay unshared


@functools.lru_cache(maxsize=128)
def _weights(d: int, alpha: float, beta: float, kappa: float | None, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # The weights, the offset pattern sqrt(d + lambda) [0; I; -I] (2d + 1, d) and the covariance
    # weights as a column (2d + 1, 1), built once per setting: constants that callers only read
    # (created outside inference mode, so that autograd may save them). The filters run the
    # transform twice per time step on a 2-d state, where each avoided op is ~1 us of ~60.
    kappa = max(3.0 - d, 0.0) if kappa is None else kappa
    lam = alpha**2 * (d + kappa) - d
    with torch.inference_mode(False), torch.no_grad():
        wm = torch.full((2 * d + 1,), 1.0 / (2 * (d + lam)), dtype=dtype, device=device)
        wm[0] = lam / (d + lam)
        wc = wm.clone()
        wc[0] = wm[0] + 1 - alpha**2 + beta
        eye = torch.eye(d, dtype=dtype, device=device)
        pattern = (d + lam) ** 0.5 * torch.cat([eye.new_zeros(1, d), eye, -eye])
        column = wc.unsqueeze(-1).contiguous()
    return wm, wc, pattern, column


def unscented_moments(
    fn: Callable[[Tensor], Tensor],
    mean: Tensor,
    cov: Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    kappa: float | None = None,
    noise_cov: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean, covariance and input-output covariance of ``fn(x)`` (plus ``noise``), :math:`x \sim \mathcal N(m, P)` (``mean``, ``cov``).

    Args:
        fn: maps a batch of points ``(..., n, d)`` to ``(..., n, e)``.
        mean: ``(..., d)``: a batch of Gaussians is transformed at once.
        cov: ``(..., d, d)``.
        alpha, beta, kappa: as in :func:`sigma_points`.
        noise_cov: ``(e, e)`` covariance of additive noise ``fn(x) + noise`` (``None``: none).

    Returns:
        ``(mean (..., e), cov (..., e, e), cross (..., d, e))`` with ``cross = Cov[x, fn(x)]``;
        ``cov`` is symmetric and includes ``noise_cov``.

    Raises:
        RuntimeError: (``torch.linalg.LinAlgError``) if ``cov`` is not positive definite.

    Example:
        >>> A, b = torch.tensor([[1.0, 2.0], [0.0, 3.0]]), torch.tensor([1.0, 0.0])
        >>> m, P = torch.tensor([1.0, 1.0]), torch.tensor([[2.0, 0.5], [0.5, 1.0]])
        >>> # exact for linear fn
        >>> mean, cov, cross = unscented_moments(lambda x: x @ A.T + b, m, P)
        >>> [
        ...     bool(torch.allclose(u, v, atol=1e-5))
        ...     for u, v in ((mean, A @ m + b), (cov, A @ P @ A.T), (cross, P @ A.T))
        ... ]
        [True, True, True]
    """
    weights = sigma_weights(mean.shape[-1], alpha, beta, kappa, mean.dtype, mean.device)
    return unscented_transform(fn, mean, torch.linalg.cholesky(cov), weights, noise_cov)


def sigma_weights(
    d: int, alpha: float = 1.0, beta: float = 0.0, kappa: float | None = None, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The constants of the transform for a ``d``-dimensional input, built once per setting.

    Args:
        d: the input dimension.
        alpha, beta, kappa: as in :func:`sigma_points`.
        dtype, device: of the constants (default: torch's).

    Returns:
        ``(mean_weights (2d+1,), cov_weights (2d+1,), pattern (2d+1, d), cov_weights (2d+1, 1))``
        with ``pattern = sqrt(d + lambda) [0; I; -I]``; read-only (shared between callers).

    Example:
        >>> wm, wc, pattern, column = sigma_weights(2, dtype=torch.float64)
        >>> pattern.shape, round(float(wm.sum()), 12)
        (torch.Size([5, 2]), 1.0)
    """
    dtype = torch.get_default_dtype() if dtype is None else dtype
    device = torch.device("cpu") if device is None else torch.device(device)
    return _weights(int(d), float(alpha), float(beta), None if kappa is None else float(kappa), dtype, device)


def unscented_transform(
    fn: Callable[[Tensor], Tensor], mean: Tensor, chol: Tensor, weights: tuple[Tensor, Tensor, Tensor, Tensor], noise_cov: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`unscented_moments` from the Cholesky factor ``chol`` of the covariance and the
    transform's constants (so that a caller may factorise with ``torch.linalg.cholesky_ex`` and
    check every step at once, and record the step with :func:`torch.jit.trace`, which must not
    see the constants built).

    Args:
        fn, mean, noise_cov: as in :func:`unscented_moments`.
        chol: ``(..., d, d)`` lower Cholesky factor of the input covariance.
        weights: :func:`sigma_weights` of ``d``, of ``mean``'s dtype and device.

    Returns:
        ``(mean (..., e), cov (..., e, e), cross (..., d, e))`` as :func:`unscented_moments`.

    Example:
        >>> m, P = torch.zeros(2), torch.tensor([[2.0, 0.5], [0.5, 1.0]])
        >>> chol, weights = torch.linalg.cholesky(P), sigma_weights(2)
        >>> mean, cov, cross = unscented_transform(torch.sin, m, chol, weights)
        >>> torch.equal(cov, unscented_moments(torch.sin, m, P)[1])
        True
    """
    wm, _, pattern, column = weights
    # Row i of the pattern picks (a multiple of) one column of L: one product instead of a scale,
    # a negation and a concatenation, and the same numbers (each entry is one product plus zeros).
    dx = pattern @ chol.transpose(-1, -2)
    # An unbatched mean broadcasts as it is: two views fewer per call, the same numbers.
    single = mean.dim() == 1
    values = fn((mean if single else mean.unsqueeze(-2)) + dx)
    f_mean = wm @ values
    dv = values - (f_mean if single else f_mean.unsqueeze(-2))
    weighted = (dv * column).transpose(-1, -2)  # (..., e, 2d + 1)
    f_cov = weighted @ dv
    cross = (weighted @ dx).transpose(-1, -2)
    # (S + S^T) / 2 + noise in one op: halving is exact, so these are the bits of the two-step form.
    cov = (f_cov + f_cov.transpose(-1, -2)) / 2 if noise_cov is None else noise_cov.add(f_cov + f_cov.transpose(-1, -2), alpha=0.5)
    return f_mean, cov, cross
