r"""Pyro distributions: the matrix normal with lower-Cholesky row and column scales.

``MatrixNormal(M, L_row, L_col)`` is the law of :math:`W = M + L_{\mathrm{row}} E L_{\mathrm{col}}^\top` with ``E`` of i.i.d.
standard normal entries; row covariance :math:`U = L_{\mathrm{row}} L_{\mathrm{row}}^\top`, column covariance
:math:`V = L_{\mathrm{col}} L_{\mathrm{col}}^\top`, and with column-major ``vec``

    :math:`\operatorname{vec}(W) \sim \mathcal N(\operatorname{vec}(M), V \otimes U)`            (NumPyro's convention).

Huang et al. write the K-Linear layer as :math:`W = M + A E B'` with
:math:`\operatorname{vec}(W) \sim \mathcal N(\operatorname{vec}(M), (B'^\top B') \otimes (A A^\top))`: that is :math:`L_{\mathrm{row}} = A` and :math:`L_{\mathrm{col}} = B'^\top`. The
Kronecker-flow guides store the lower-triangular :math:`B = B'^\top` and write :math:`W = M + A E B^\top`, so
for them :math:`L_{\mathrm{col}} = B`. The Kronecker algebra lives in :mod:`pyro_smc.ops.kronecker` and
:mod:`pyro_smc.ops.kronecker_tril`.
See ``docs/math/kronecker.md#matrix-normal-distribution``.

Closed-form KL divergences are registered with ``torch.distributions.kl.register_kl`` for
``(MatrixNormal, MatrixNormal)`` and ``(MatrixNormal, Independent(Normal))`` (any elementwise
loc/scale, e.g. the prior ``dist.Normal(0, 1).expand([n, p]).to_event(2)``), so
``pyro.infer.TraceMeanField_ELBO`` uses them. See ``docs/math/kronecker.md#kl-divergences``.

Example:
    >>> import torch
    >>> import pyro.distributions as dist
    >>> from pyro_smc.distributions import MatrixNormal
    >>> q = MatrixNormal(torch.zeros(3, 2), torch.eye(3), 2 * torch.eye(2))
    >>> w = q.rsample((5,))
    >>> w.shape, q.log_prob(w).shape
    (torch.Size([5, 3, 2]), torch.Size([5]))
    >>> prior = dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2)
    >>> # 0.5 * (6 * 4 - 6) - 3 * 2 * log 2
    >>> kl = torch.distributions.kl_divergence(q, prior)
    >>> round(float(kl), 4)
    4.8411
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch import Tensor
from torch.distributions import Independent, Normal, constraints
from torch.distributions.kl import register_kl

from pyro_smc.ops.kronecker import kron_matvec
from pyro_smc.ops.kronecker_tril import (
    kron_tril_entropy,
    kron_tril_logdet,
    kron_tril_mahalanobis,
    kron_tril_trace,
    kron_tril_variance,
)

__all__ = ["MatrixNormal"]


_FLOATS = (torch.float32, torch.float64)


def _check_square(name: str, value: Tensor, size: int, what: str) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a tensor of shape (..., {what}, {what}), got {type(value).__name__}")
    if value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        raise ValueError(f"{name} must be a square matrix (..., {what}, {what}), got shape {tuple(value.shape)}")
    if value.shape[-1] != size:
        raise ValueError(f"{name} must have shape (..., {size}, {size}) to match loc's {what} = {size}, got shape {tuple(value.shape)}")
    # Triangular solves exist for float32/float64 only: other dtypes would fail later, in log_prob.
    if value.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float32 or float64, got {value.dtype}")
    # torch's lower_cholesky constraint lets inf through; an infinite scale is never meant.
    if not bool(torch.isfinite(value.detach()).all()):
        raise ValueError(f"{name} has non-finite entries")


class MatrixNormal(TorchDistribution):
    r"""Matrix normal distribution over ``(n, p)`` matrices, parametrised by lower-Cholesky scales.

    :math:`W = \mathrm{loc} + L_{\mathrm{row}} E L_{\mathrm{col}}^\top` with :math:`E_{ij} \sim \mathcal N(0, 1)` i.i.d., so
    :math:`\operatorname{vec}(W) \sim \mathcal N(\operatorname{vec}(\mathrm{loc}), V \otimes U)`
    with :math:`U = L_{\mathrm{row}} L_{\mathrm{row}}^\top` (:math:`n \times n`, covariance between rows) and :math:`V = L_{\mathrm{col}} L_{\mathrm{col}}^\top`
    (:math:`p \times p`, covariance between columns), ``vec`` column-major. In the guides' K-Linear form
    :math:`W = M + A E B^\top` (``A``, ``B`` lower triangular), :math:`L_{\mathrm{row}} = A` and :math:`L_{\mathrm{col}} = B`.
    See ``docs/math/kronecker.md#matrix-normal-distribution``.

    The log-density is computed by triangular solves, never forming the :math:`np \times np` covariance:

    .. math::

        \log p(W) = {} & -\frac{1}{2} \| L_{\mathrm{row}}^{-1} (W - M) L_{\mathrm{col}}^{-\top} \|_F^2 \\
                    & - p \sum \log \operatorname{diag} L_{\mathrm{row}} - n \sum \log \operatorname{diag} L_{\mathrm{col}}
                    - (n p / 2) \log 2 \pi.

    Args:
        loc: mean ``M``, shape ``(..., n, p)`` with ``n, p >= 1``, finite, float32 or float64.
        scale_tril_row: ``L_row``, lower triangular with positive diagonal, ``(..., n, n)``.
        scale_tril_col: ``L_col``, lower triangular with positive diagonal, ``(..., p, p)``.
        validate_args: as for torch distributions (the lower-Cholesky checks of the scales).

    Raises:
        ValueError: shapes that do not match or broadcast, a zero-size dim, non-finite entries, a
            dtype other than float32/float64 or different devices (each naming the argument); with
            validation, a scale that is not lower triangular with positive diagonal. Mixed float32
            and float64 arguments are promoted to float64, as in torch's distributions.

    Event shape ``(n, p)``; batch shape is the broadcast of the three arguments' leading dims.

    Example:
        >>> import torch
        >>> from pyro_smc.distributions import MatrixNormal
        >>> d = MatrixNormal(torch.zeros(2, 4, 3), torch.eye(4), torch.eye(3))
        >>> d.batch_shape, d.event_shape
        (torch.Size([2]), torch.Size([4, 3]))
        >>> round(float(d.log_prob(torch.zeros(4, 3))[0]), 4)  # -(12 / 2) log(2 pi)
        -11.0273
    """

    arg_constraints = {
        "loc": constraints.independent(constraints.real, 2),
        "scale_tril_row": constraints.lower_cholesky,
        "scale_tril_col": constraints.lower_cholesky,
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(self, loc: Tensor, scale_tril_row: Tensor, scale_tril_col: Tensor, validate_args: bool | None = None) -> None:
        if not isinstance(loc, Tensor) or loc.dim() < 2:
            raise ValueError(f"loc must be a tensor of shape (..., n, p), got {tuple(getattr(loc, 'shape', ()))}")
        if loc.numel() == 0:
            # torch's Cholesky constraint checks cannot reduce over empty tensors.
            raise ValueError(f"loc must have no zero-size dims (at least one 1 x 1 matrix), got shape {tuple(loc.shape)}")
        if loc.dtype not in _FLOATS:
            raise ValueError(f"loc must be float32 or float64, got {loc.dtype}")
        # torch's `real` constraint only rejects NaN; an infinite mean gives -inf/NaN densities.
        if not bool(torch.isfinite(loc.detach()).all()):
            raise ValueError("loc has non-finite entries")
        n, p = loc.shape[-2:]
        _check_square("scale_tril_row", scale_tril_row, n, "n")
        _check_square("scale_tril_col", scale_tril_col, p, "p")
        for name, value in (("scale_tril_row", scale_tril_row), ("scale_tril_col", scale_tril_col)):
            if value.device != loc.device:
                raise ValueError(f"{name} must be on loc's device {loc.device}, got {value.device}")
        # Mixed float dtypes are promoted to a common one, as torch's broadcast_all does for Normal.
        dtype = torch.promote_types(torch.promote_types(loc.dtype, scale_tril_row.dtype), scale_tril_col.dtype)
        loc, scale_tril_row, scale_tril_col = loc.to(dtype), scale_tril_row.to(dtype), scale_tril_col.to(dtype)
        try:
            batch_shape = torch.broadcast_shapes(loc.shape[:-2], scale_tril_row.shape[:-2], scale_tril_col.shape[:-2])
        except RuntimeError as e:
            raise ValueError(
                "batch dims of loc, scale_tril_row and scale_tril_col do not broadcast: "
                f"{tuple(loc.shape[:-2])}, {tuple(scale_tril_row.shape[:-2])}, {tuple(scale_tril_col.shape[:-2])}"
            ) from e
        self.loc = loc.expand(batch_shape + (n, p))
        self.scale_tril_row = scale_tril_row.expand(batch_shape + (n, n))
        self.scale_tril_col = scale_tril_col.expand(batch_shape + (p, p))
        super().__init__(batch_shape, torch.Size((n, p)), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None) -> MatrixNormal:
        """The distribution with batch shape ``batch_shape`` (factors broadcast, no copy)."""
        new = self._get_checked_instance(MatrixNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        n, p = self.event_shape
        new.loc = self.loc.expand(batch_shape + (n, p))
        new.scale_tril_row = self.scale_tril_row.expand(batch_shape + (n, n))
        new.scale_tril_col = self.scale_tril_col.expand(batch_shape + (p, p))
        super(MatrixNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> Tensor:
        """``M`` ``(..., n, p)``."""
        return self.loc

    @property
    def mode(self) -> Tensor:
        """``M`` as well."""
        return self.loc

    @property
    def variance(self) -> Tensor:
        r""":math:`\operatorname{Var}(W_{ij}) = U_{ii} V_{jj}`, shape ``batch + (n, p)``."""
        return kron_tril_variance(self.scale_tril_row, self.scale_tril_col)

    @property
    def row_covariance(self) -> Tensor:
        r""":math:`U = L_{\mathrm{row}} L_{\mathrm{row}}^\top`, shape ``batch + (n, n)``."""
        return self.scale_tril_row @ self.scale_tril_row.transpose(-1, -2)

    @property
    def column_covariance(self) -> Tensor:
        r""":math:`V = L_{\mathrm{col}} L_{\mathrm{col}}^\top`, shape ``batch + (p, p)``."""
        return self.scale_tril_col @ self.scale_tril_col.transpose(-1, -2)

    def rsample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        r""":math:`M + L_{\mathrm{row}} E L_{\mathrm{col}}^\top` with standard normal ``E`` ``(sample_shape, ..., n, p)``."""
        shape = self._extended_shape(torch.Size(sample_shape))
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        value = self.loc + kron_matvec(self.scale_tril_row, self.scale_tril_col.transpose(-1, -2), eps)
        # Remember the noise of the last draw (as a Transform with cache_size=1 remembers its
        # pre-image): scoring one's own sample (what every ELBO does) then needs no triangular
        # solve, which in float32 is badly wrong once the factors are ill-conditioned. The
        # tensors' versions are kept too: a draw or a parameter changed in place since (an
        # optimiser's step on a leaf ``loc``) must be scored afresh, not from the stale noise.
        self._last_draw = (value, eps, self._versions(value))
        return value

    def _versions(self, value: Tensor) -> tuple[int, ...]:
        return tuple(t._version for t in (value, self.loc, self.scale_tril_row, self.scale_tril_col))

    def log_prob(self, value: Tensor) -> Tensor:
        """The log density at ``value`` ``(..., n, p)``."""
        if self._validate_args:
            self._validate_sample(value)
        n, p = self.event_shape
        last = getattr(self, "_last_draw", None)
        if last is not None and value is last[0] and self._versions(value) == last[2]:
            maha = self._own_draw_mahalanobis(value, last[1])
        else:
            maha = kron_tril_mahalanobis(self.scale_tril_row, self.scale_tril_col, value - self.loc)
        return -0.5 * maha - kron_tril_logdet(self.scale_tril_row, self.scale_tril_col) - 0.5 * n * p * math.log(2 * math.pi)

    def _own_draw_mahalanobis(self, value: Tensor, eps: Tensor) -> Tensor:
        r"""The Mahalanobis term of the last draw, :math:`\|E\|^2`, with the gradients of the solved
        form :math:`\|L_{\mathrm{row}}^{-1} (W - M) L_{\mathrm{col}}^{-\top}\|^2` in the value and the parameters,
        written with the known noise (each gradient term is zero in value). Without them
        :math:`\nabla_W \log q(W)` at one's own draw was silently zero (path-derivative and DReG
        estimators, Langevin moves). With :math:`G = L_{\mathrm{row}}^{-\top} E L_{\mathrm{col}}^{-1}`: the gradient is
        :math:`2G` in ``W``, :math:`-2G` in ``M``, :math:`-2 L_{\mathrm{row}}^{-\top} E E^\top` in :math:`L_{\mathrm{row}}` and
        :math:`-2 L_{\mathrm{col}}^{-\top} E^\top E` in :math:`L_{\mathrm{col}}` (lower triangles)."""
        maha = eps.square().sum((-2, -1))
        tensors = (value, self.loc, self.scale_tril_row, self.scale_tril_col)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return maha
        row, col = self.scale_tril_row.detach(), self.scale_tril_col.detach()
        solve = torch.linalg.solve_triangular
        g = solve(col, solve(row.mT, eps, upper=True), upper=False, left=False)
        g_row = solve(row.mT, eps @ eps.mT, upper=True).tril()
        g_col = solve(col.mT, eps.mT @ eps, upper=True).tril()
        terms = zip((g, -g, -g_row, -g_col), tensors)
        return maha + 2 * sum((grad * (t - t.detach())).sum((-2, -1)) for grad, t in terms)

    def entropy(self) -> Tensor:
        """The differential entropy, ``(batch_shape)``."""
        return kron_tril_entropy(self.scale_tril_row, self.scale_tril_col)


@register_kl(MatrixNormal, MatrixNormal)
def _kl_matrixnormal_matrixnormal(q: MatrixNormal, p: MatrixNormal) -> Tensor:
    r""":math:`\operatorname{KL}(q \,\|\, p) = \frac{1}{2} [\operatorname{tr}(S_p^{-1} S_q) + m^\top S_p^{-1} m - np + \log\det S_p - \log\det S_q]`,
    :math:`m = M_p - M_q`.

    See ``docs/math/kronecker.md#kl-divergences``.
    """
    if q.event_shape != p.event_shape:
        raise ValueError(f"event shapes differ: {tuple(q.event_shape)} vs {tuple(p.event_shape)}")
    n, p_ = q.event_shape
    trace = kron_tril_trace(p.scale_tril_row, p.scale_tril_col, q.scale_tril_row, q.scale_tril_col)
    maha = kron_tril_mahalanobis(p.scale_tril_row, p.scale_tril_col, p.loc - q.loc)
    logdet = kron_tril_logdet(p.scale_tril_row, p.scale_tril_col) - kron_tril_logdet(q.scale_tril_row, q.scale_tril_col)
    return 0.5 * (trace + maha - n * p_) + logdet


@register_kl(MatrixNormal, Independent)
def _kl_matrixnormal_independent_normal(q: MatrixNormal, p: Independent) -> Tensor:
    r"""KL to a diagonal Gaussian ``Independent(Normal(mu, s), 2)`` over the same ``(n, p)`` event.

    :math:`\frac{1}{2} \sum_{ij} [(U_{ii} V_{jj} + (\mu_{ij} - M_{ij})^2) / s_{ij}^2 - 1 + 2 \log s_{ij}] - \log\det S_q^{1/2}`.
    Raises ``NotImplementedError`` for any other ``Independent`` (so ``TraceMeanField_ELBO`` falls
    back to sampling). See ``docs/math/kronecker.md#kl-divergences``.
    """
    base = p.base_dist
    while isinstance(base, Independent):
        base = base.base_dist
    if not isinstance(base, Normal) or p.event_shape != q.event_shape:
        raise NotImplementedError
    event_dims = len(p.event_shape)
    # Normal's batch dims (..., n, p) are Independent's batch + event dims: broadcast against q's.
    var_ratio = q.variance / base.scale.pow(2)
    diff2 = ((base.loc - q.loc) / base.scale).pow(2)
    terms = 0.5 * (var_ratio + diff2 - 1.0) + base.scale.log()
    return terms.sum(tuple(range(-event_dims, 0))) - kron_tril_logdet(q.scale_tril_row, q.scale_tril_col)
