r"""Invertible maps of matrices applied column by column and row by row (K-Nonlinear flows).

The K-Nonlinear posterior of a weight matrix pushes an :math:`n \times p` noise
matrix ``E`` through an invertible :math:`g_A : \mathbb R^n \to \mathbb R^n` applied to every column and an invertible
:math:`g_B : \mathbb R^p \to \mathbb R^p` applied to every row, :math:`G(E) = G_B(G_A(E^\top)^\top)`, before a K-Linear or K-Diag
layer. After a permutation the Jacobian of :math:`\operatorname{vec} G_A` is block diagonal with one block per
column, so :math:`\log|\det J| = \sum_{\text{columns}} \log|\det J_{g_A}| + \sum_{\text{rows}} \log|\det J_{g_B}|`: :math:`n + p`
small determinants instead of one :math:`np \times np` one, and :math:`O(n^2 + p^2)` flow parameters.
See ``docs/math/kronecker.md#k-nonlinear`` and ``docs/math/kronecker.md#matrix-flows-and-their-log-determinants``.

:class:`ColumnwiseTransform` and :class:`RowwiseTransform` lift any vector transform of Pyro
(``AffineCoupling``, ``AffineAutoregressive`` (IAF), ...) to matrices; :class:`AdditiveCoupling`
is the volume-preserving (NICE) coupling used by the K-Nonlinear paper. :func:`kronecker_nonlinear`
builds ``G`` for a given shape.

Example:
    >>> import torch
    >>> from pyro_smc.guides.kronecker.transforms import kronecker_nonlinear
    >>> g = kronecker_nonlinear(4, 3, flow="additive_coupling")
    >>> E = torch.randn(5, 4, 3)
    >>> W = g(E)
    >>> W.shape, g.log_abs_det_jacobian(E, W).shape
    (torch.Size([5, 4, 3]), torch.Size([5]))
    >>> bool(torch.allclose(g.inv(W.clone()), E, atol=1e-5))
    True
"""

from __future__ import annotations

import numbers

import pyro.distributions.transforms as T
import torch
from pyro.distributions.torch_transform import TransformModule
from pyro.nn import DenseNN
from torch import Tensor, nn
from torch.distributions import constraints

__all__ = [
    "FLOWS",
    "AdditiveCoupling",
    "ColumnwiseTransform",
    "RowwiseTransform",
    "canonical_flow",
    "canonical_hidden_dims",
    "kronecker_nonlinear",
]

FLOWS = ("additive_coupling", "affine_coupling", "iaf")


class AdditiveCoupling(TransformModule):
    """Volume-preserving coupling :math:`y_{1:k} = x_{1:k}`, :math:`y_{k:} = x_{k:} + m(x_{1:k})` (NICE).

    Args:
        input_dim: vector length ``d >= 2``.
        hidden_dims: hidden layer sizes of the shift network ``m``.
        split_dim: ``k``; defaults to ``d // 2``.
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True
    sign = +1  # volume preserving

    def __init__(self, input_dim: int, hidden_dims: tuple[int, ...] = (32,), split_dim: int | None = None):
        super().__init__(cache_size=1)
        if input_dim < 2:
            raise ValueError(f"AdditiveCoupling needs input_dim >= 2, got {input_dim}")
        hidden_dims = canonical_hidden_dims(hidden_dims)
        self.split_dim = input_dim // 2 if split_dim is None else split_dim
        # Both halves must be non-empty: otherwise the map is a constant shift or the identity.
        if not (_is_int(self.split_dim) and 1 <= self.split_dim < input_dim):
            raise ValueError(f"AdditiveCoupling needs split_dim in [1, input_dim - 1] = [1, {input_dim - 1}], got {split_dim!r}")
        self.shift = DenseNN(self.split_dim, list(hidden_dims), param_dims=[input_dim - self.split_dim])
        # Start at the identity so the flow initially leaves the K-Linear posterior unchanged.
        nn.init.zeros_(self.shift.layers[-1].weight)
        nn.init.zeros_(self.shift.layers[-1].bias)

    def _call(self, x: Tensor) -> Tensor:
        x1, x2 = x[..., : self.split_dim], x[..., self.split_dim :]
        return torch.cat([x1, x2 + self.shift(x1)], -1)

    def _inverse(self, y: Tensor) -> Tensor:
        y1, y2 = y[..., : self.split_dim], y[..., self.split_dim :]
        return torch.cat([y1, y2 - self.shift(y1)], -1)

    def log_abs_det_jacobian(self, x: Tensor, y: Tensor) -> Tensor:
        return x.new_zeros(x.shape[:-1])


class _MatrixLift(TransformModule):
    """A vector transform applied to every row (``columns=False``) or column of a matrix."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.independent(constraints.real, 2)
    bijective = True
    # Every flow here has a positive Jacobian determinant (``sign`` must exist for JIT tracing).
    sign = +1
    columns = False

    def __init__(self, base: T.Transform):
        super().__init__(cache_size=1)
        self.base = base

    def _orient(self, x: Tensor) -> Tensor:
        return x.transpose(-1, -2) if self.columns else x

    def _call(self, x: Tensor) -> Tensor:
        return self._orient(self.base(self._orient(x)))

    def _inverse(self, y: Tensor) -> Tensor:
        return self._orient(self.base.inv(self._orient(y)))

    def log_abs_det_jacobian(self, x: Tensor, y: Tensor) -> Tensor:
        # One determinant per row (or column); their sum is the matrix map's log-det.
        return self.base.log_abs_det_jacobian(self._orient(x), self._orient(y)).sum(-1)


class RowwiseTransform(_MatrixLift):
    r"""Applies a transform of :math:`\mathbb R^p` to every row of ``(..., n, p)`` matrices (:math:`g_B`)."""

    columns = False


class ColumnwiseTransform(_MatrixLift):
    r"""Applies a transform of :math:`\mathbb R^n` to every column of ``(..., n, p)`` matrices (:math:`g_A`)."""

    columns = True


class _AffineCoupling(T.AffineCoupling):
    """Pyro's ``AffineCoupling`` (RealNVP) with the ``sign`` that JIT tracing of a module reads."""

    sign = +1  # the Jacobian is triangular with diagonal exp(log_scale)


def canonical_flow(flow: str) -> str:
    """Checks a flow name (one of ``FLOWS``)."""
    if flow not in FLOWS:
        raise ValueError(f"flow must be one of {FLOWS}, got {flow!r}")
    return flow


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def canonical_hidden_dims(hidden_dims) -> tuple[int, ...]:
    """Checks the hidden sizes of a flow's conditioner networks: a non-empty sequence of positive ints.

    Args:
        hidden_dims: e.g. ``(32,)`` or ``[64, 64]``.

    Returns:
        The sizes as a tuple of ``int``.

    Raises:
        ValueError: an empty sequence (the conditioners need a hidden layer), a bare number, or an
            entry that is not a positive int.

    Example:
        >>> canonical_hidden_dims([16, 16])
        (16, 16)
    """
    if isinstance(hidden_dims, (str, bytes)) or not hasattr(hidden_dims, "__iter__"):
        raise ValueError(f"hidden_dims must be a non-empty sequence of positive ints such as (32,), got {hidden_dims!r}")
    sizes = tuple(hidden_dims)
    if not sizes or not all(_is_int(h) and h >= 1 for h in sizes):
        raise ValueError(f"hidden_dims must be a non-empty sequence of positive ints such as (32,), got {hidden_dims!r}")
    return tuple(int(h) for h in sizes)


def _vector_flow(dim: int, flow: str, hidden_dims: tuple[int, ...]) -> T.Transform:
    if flow == "iaf" and min(hidden_dims) < dim:
        # Pyro's AutoRegressiveNN needs a hidden unit per input at least (its masks connect each
        # output to the inputs before it); say so here, with the option's name.
        raise ValueError(f"flow='iaf' needs every hidden_dims entry >= the length {dim} of the vectors it transforms, got hidden_dims={hidden_dims}")
    if flow == "additive_coupling":
        return AdditiveCoupling(dim, hidden_dims)
    if flow == "affine_coupling":
        split = dim // 2
        net = DenseNN(split, list(hidden_dims), param_dims=[dim - split, dim - split])
        return _AffineCoupling(split, net)
    return T.affine_autoregressive(dim, hidden_dims=list(hidden_dims))


def kronecker_nonlinear(n: int, p: int, flow: str = "additive_coupling", hidden_dims: tuple[int, ...] = (32,)) -> T.ComposeTransformModule:
    r""":math:`G(E) = G_B(G_A(E^\top)^\top)` for ``(..., n, p)`` noise matrices.

    See ``docs/math/kronecker.md#matrix-flows-and-their-log-determinants``.

    Args:
        n, p: matrix shape; a side of length 1 gets no flow (a 1-d map has nothing to couple).
        flow: ``"additive_coupling"`` (volume-preserving, NICE; the paper's choice),
            ``"affine_coupling"`` (RealNVP) or ``"iaf"`` (affine autoregressive).
        hidden_dims: hidden sizes of each flow's conditioner network.

    Returns:
        A ``ComposeTransformModule`` with event dim 2 whose parameters are the flows'.

    Raises:
        ValueError: an unknown ``flow``, malformed ``hidden_dims`` (:func:`canonical_hidden_dims`), or
            ``flow="iaf"`` with a hidden size below ``n`` or ``p`` (Pyro's autoregressive networks
            need one hidden unit per input at least).
    """
    flow, hidden_dims = canonical_flow(flow), canonical_hidden_dims(hidden_dims)
    parts = []
    if n >= 2:
        parts.append(ColumnwiseTransform(_vector_flow(n, flow, hidden_dims)))
    if p >= 2:
        parts.append(RowwiseTransform(_vector_flow(p, flow, hidden_dims)))
    return T.ComposeTransformModule(parts)
