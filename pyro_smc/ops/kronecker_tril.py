r"""Gaussian terms of a Kronecker covariance :math:`V \otimes U` given by its lower Cholesky factors.

A matrix normal :math:`W = M + A E B` (:math:`E` i.i.d. standard normal) has
:math:`\operatorname{vec}(W) \sim \mathcal N(\operatorname{vec}(M), (B^\top B) \otimes (A A^\top))`; in the lower-Cholesky parametrisation used by
:class:`pyro_smc.distributions.MatrixNormal`, :math:`W = M + L_{\mathrm{row}} E L_{\mathrm{col}}^\top` and
:math:`\operatorname{Cov}(\operatorname{vec} W) = (L_{\mathrm{col}} L_{\mathrm{col}}^\top) \otimes (L_{\mathrm{row}} L_{\mathrm{row}}^\top) = V \otimes U`. The ``kron_tril_*`` helpers here
give its log-determinant, Mahalanobis norm, trace of a ratio (for KL divergences), variances and
entropy from ``L_row`` and ``L_col`` alone, by the column-major ``vec`` and the Kronecker algebra
of :mod:`pyro_smc.ops.kronecker`.

All functions broadcast over leading batch dims and promote mixed float dtypes to a common one (as
torch's elementwise ops do). Pure torch: no Pyro import.
See ``docs/math/kronecker.md#kronecker-identities`` and ``docs/math/kronecker.md#matrix-normal-distribution``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.kronecker import vec
    >>> from pyro_smc.ops.kronecker_tril import kron_tril_mahalanobis
    >>> L_row, L_col, X = torch.eye(3), 2 * torch.eye(2), torch.ones(3, 2)
    >>> float(kron_tril_mahalanobis(L_row, L_col, X)), float(vec(X).pow(2).sum() / 4)
    (1.5, 1.5)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_smc.ops.kronecker import _check_batch, _check_kron, _check_nonsingular_triangle, _kron_logdet, _kron_solve

_TRIL_NAMES = ("scale_tril_row", "scale_tril_col")

__all__ = [
    "kron_tril_entropy",
    "kron_tril_logdet",
    "kron_tril_mahalanobis",
    "kron_tril_trace",
    "kron_tril_variance",
]


def kron_tril_logdet(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    r""":math:`\log \det (V \otimes U)^{1/2} = p \sum \log \operatorname{diag} L_{\mathrm{row}} + n \sum \log \operatorname{diag} L_{\mathrm{col}}` (positive diagonals).

    Args:
        scale_tril_row: ``L_row`` ``(..., n, n)``, lower triangular, :math:`U = L_{\mathrm{row}} L_{\mathrm{row}}^\top`.
        scale_tril_col: ``L_col`` ``(..., p, p)``, lower triangular, :math:`V = L_{\mathrm{col}} L_{\mathrm{col}}^\top`.

    Returns:
        ``(...)``: half the log-determinant of the ``np x np`` covariance.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0, 0.0], [0.2, 0.5, 0.0], [0.1, 0.4, 1.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> bool(
        ...     torch.isclose(
        ...         kron_tril_logdet(L_row, L_col), 0.5 * torch.logdet(cov), atol=1e-5
        ...     )
        ... )
        True
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_logdet", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    return _kron_logdet(scale_tril_row, scale_tril_col, True)


def kron_tril_mahalanobis(scale_tril_row: Tensor, scale_tril_col: Tensor, x: Tensor) -> Tensor:
    r""":math:`\operatorname{vec}(X)^\top (V \otimes U)^{-1} \operatorname{vec}(X) = \lVert L_{\mathrm{row}}^{-1} X L_{\mathrm{col}}^{-\top} \rVert_F^2` by two triangular solves.

    Args:
        scale_tril_row: ``(..., n, n)`` lower triangular.
        scale_tril_col: ``(..., p, p)`` lower triangular.
        x: ``(..., n, p)``.

    Returns:
        ``(...)``: the squared Mahalanobis norm.

    Example:
        >>> from pyro_smc.ops.kronecker import vec
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0], [0.2, 0.5]])
        >>> X = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> dense = vec(X) @ torch.linalg.solve(cov, vec(X))
        >>> bool(torch.isclose(kron_tril_mahalanobis(L_row, L_col, X), dense, rtol=1e-4))
        True
    """
    names = (*_TRIL_NAMES, "x")
    z = _kron_solve("kron_tril_mahalanobis", scale_tril_row, scale_tril_col.transpose(-1, -2), x, "lower", "upper", names)
    return z.pow(2).sum((-1, -2))


def kron_tril_trace(scale_tril_row_p: Tensor, scale_tril_col_p: Tensor, scale_tril_row_q: Tensor, scale_tril_col_q: Tensor) -> Tensor:
    r""":math:`\operatorname{tr}((V_p \otimes U_p)^{-1} (V_q \otimes U_q)) = \lVert L_{\mathrm{row},p}^{-1} L_{\mathrm{row},q} \rVert_F^2 \, \lVert L_{\mathrm{col},p}^{-1} L_{\mathrm{col},q} \rVert_F^2`.

    See ``docs/math/kronecker.md#kronecker-identities`` and ``docs/math/kronecker.md#kl-divergences``.

    Args:
        scale_tril_row_p: ``(..., n, n)`` lower triangular (the inverted covariance's row factor).
        scale_tril_col_p: ``(..., p, p)`` lower triangular.
        scale_tril_row_q: ``(..., n, n)`` lower triangular.
        scale_tril_col_q: ``(..., p, p)`` lower triangular.

    Returns:
        ``(...)``: the trace.

    Raises:
        ValueError: non-square or mismatched factors, or a ``p`` factor with a zero on its diagonal.

    Example:
        >>> Lr_p, Lc_p = torch.tensor([[2.0, 0.0], [0.3, 1.0]]), torch.tensor([[1.5]])
        >>> Lr_q, Lc_q = torch.tensor([[1.0, 0.0], [0.5, 0.7]]), torch.tensor([[0.5]])
        >>> cov_p = torch.kron(Lc_p @ Lc_p.T, Lr_p @ Lr_p.T)
        >>> cov_q = torch.kron(Lc_q @ Lc_q.T, Lr_q @ Lr_q.T)
        >>> dense = torch.trace(torch.linalg.solve(cov_p, cov_q))
        >>> bool(torch.isclose(kron_tril_trace(Lr_p, Lc_p, Lr_q, Lc_q), dense, rtol=1e-4))
        True
    """
    op = "kron_tril_trace"
    named = (("scale_tril_row_p", scale_tril_row_p), ("scale_tril_col_p", scale_tril_col_p))
    named += (("scale_tril_row_q", scale_tril_row_q), ("scale_tril_col_q", scale_tril_col_q))
    scale_tril_row_p, scale_tril_col_p, scale_tril_row_q, scale_tril_col_q = _check_batch(op, named)
    for name, m in named:
        if m.shape[-1] != m.shape[-2]:
            raise ValueError(f"{op}: {name} must be square (..., k, k), got shape {tuple(m.shape)}")
    for (name_p, p_), (name_q, q_) in ((named[0], named[2]), (named[1], named[3])):
        if q_.shape[-1] != p_.shape[-1]:
            raise ValueError(f"{op}: {name_q} must have the size {p_.shape[-1]} of {name_p}, got shape {tuple(q_.shape)}")
        _check_nonsingular_triangle(op, name_p, p_)
    tr_u = torch.linalg.solve_triangular(scale_tril_row_p, scale_tril_row_q, upper=False).pow(2).sum((-1, -2))
    tr_v = torch.linalg.solve_triangular(scale_tril_col_p, scale_tril_col_q, upper=False).pow(2).sum((-1, -2))
    return tr_u * tr_v


def kron_tril_variance(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    r"""The diagonal of :math:`V \otimes U` as an ``(n, p)`` matrix: :math:`\operatorname{diag}(U) \operatorname{diag}(V)^\top`.

    Args:
        scale_tril_row: ``(..., n, n)``.
        scale_tril_col: ``(..., p, p)``.

    Returns:
        ``(..., n, p)``: ``Var(W_ij) = U_ii V_jj``.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0, 0.0], [0.2, 0.5, 0.0], [0.1, 0.4, 1.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> from pyro_smc.ops.kronecker import vec
        >>> var = kron_tril_variance(L_row, L_col)
        >>> var.shape, bool(torch.allclose(vec(var), cov.diagonal()))
        (torch.Size([2, 3]), True)
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_variance", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    u = scale_tril_row.pow(2).sum(-1)
    v = scale_tril_col.pow(2).sum(-1)
    return u.unsqueeze(-1) * v.unsqueeze(-2)


def kron_tril_entropy(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    r"""Entropy of :math:`\mathcal N(M, V \otimes U)`:
    :math:`\tfrac{np}{2} (1 + \log 2\pi) + p \sum \log \operatorname{diag} L_{\mathrm{row}} + n \sum \log \operatorname{diag} L_{\mathrm{col}}`.

    See ``docs/math/kronecker.md#matrix-normal-distribution``.

    Args:
        scale_tril_row: ``(..., n, n)`` lower triangular with positive diagonal.
        scale_tril_col: ``(..., p, p)`` lower triangular with positive diagonal.

    Returns:
        ``(...)``: the differential entropy in nats.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0], [0.2, 0.5]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> dense = torch.distributions.MultivariateNormal(torch.zeros(4), cov).entropy()
        >>> bool(torch.isclose(kron_tril_entropy(L_row, L_col), dense, atol=1e-5))
        True
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_entropy", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    n, p = scale_tril_row.shape[-1], scale_tril_col.shape[-1]
    return 0.5 * n * p * (1.0 + math.log(2 * math.pi)) + _kron_logdet(scale_tril_row, scale_tril_col, True)
