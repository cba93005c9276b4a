r"""The posterior families of :class:`~pyro_smc.guides.AutoKroneckerFlow`, one strategy object each.

A kind says how the factors of one ``(n, p)`` matrix site are stored and how standard-normal noise
``E`` becomes the site's unconstrained value ``U``:

* :class:`DiagKind` (``"diag"``): :math:`U = M + A E B^\top` with diagonal ``A`` (n), ``B`` (p);
* :class:`LinearKind` (``"linear"``): the same with lower-triangular ``A`` and ``B``, stored as
  :math:`L = D (I + N)` (:func:`factor_from_params`): a matrix normal,
  :math:`\operatorname{Cov}(\operatorname{vec} U) = B B^\top \otimes A A^\top`;
* :class:`NonlinearKind` (``"nonlinear"``): :math:`U = M + A \, G(E) \, B^\top`, with ``G`` an invertible flow
  applied to every column and every row of ``E`` (:mod:`pyro_smc.guides.kronecker.transforms`).

The guide holds one kind and never branches on its name; a new family is a new subclass.
See ``docs/math/kronecker.md#posterior-families``.

Example:
    >>> import torch
    >>> from pyro_smc.guides.kronecker.kinds import LinearKind
    >>> kind = LinearKind()
    >>> params, _ = kind.init_factor(3, 0.5, torch.zeros(()), torch.Size())
    >>> kind.factor(params, 3)
    tensor([[0.5000, 0.0000, 0.0000],
            [0.0000, 0.5000, 0.0000],
            [0.0000, 0.0000, 0.5000]])
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.distributions.transforms import ComposeTransform
from torch import Tensor
from torch.distributions import constraints
from torch.distributions.transforms import Transform

from pyro_smc.distributions import MatrixNormal
from pyro_smc.guides.kronecker.transforms import canonical_flow, canonical_hidden_dims, kronecker_nonlinear
from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector
from pyro_smc.ops.kronecker import kron_logdet

__all__ = ["KINDS", "DiagKind", "KroneckerKind", "LinearKind", "NonlinearKind", "as_kind", "factor_from_params", "params_from_factor"]

KINDS = ("diag", "linear", "nonlinear")


def factor_from_params(params: Tensor, size: int) -> Tensor:
    """The triangular factor :math:`L = D (I + N)` of a ``"linear"``/``"nonlinear"`` guide.

    See ``docs/math/kronecker.md#factor-parametrisation``.

    Args:
        params: ``(..., size (size + 1) / 2)`` free numbers in ``torch.tril_indices`` order: the
            log of ``D`` on the diagonal, ``N`` (relative to the row's scale) below it.
        size: the factor's size ``n``.

    Returns:
        ``(..., n, n)`` lower triangular with positive diagonal.
    """
    raw = tril_from_vector(params, size)
    scale = raw.diagonal(dim1=-2, dim2=-1)
    return raw.tril(-1) * scale.unsqueeze(-1) + torch.diag_embed(scale)


def params_from_factor(factor: Tensor) -> Tensor:
    """The inverse of :func:`factor_from_params` (to set a guide to a known posterior)."""
    scale = factor.diagonal(dim1=-2, dim2=-1)
    if not bool((scale.detach() > 0).all()):
        raise ValueError("factor must have a positive diagonal")
    return tril_to_vector(factor.tril(-1) / scale.unsqueeze(-1) + torch.diag_embed(scale))


class KroneckerAffine(Transform):
    r""":math:`X \mapsto M + A X B` on ``(..., n, p)`` matrices; :math:`\log|\det| = p \log|\det A| + n \log|\det B|`.

    ``A`` lower and ``B`` upper triangular with positive diagonals.
    See ``docs/math/kronecker.md#matrix-flows-and-their-log-determinants``.
    """

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.independent(constraints.real, 2)
    bijective = True
    sign = +1  # triangular factors with positive diagonals

    def __init__(self, loc: Tensor, a: Tensor, b: Tensor):
        # Cache the pre-image: log q of the guide's own samples must use the exact noise, not a
        # triangular solve, whose error an optimiser can exploit when A or B is ill-conditioned.
        super().__init__(cache_size=1)
        self.loc, self.a, self.b = loc, a, b

    def _call(self, x: Tensor) -> Tensor:
        return self.loc + self.a @ x @ self.b

    def _inverse(self, y: Tensor) -> Tensor:
        z = torch.linalg.solve_triangular(self.a, y - self.loc, upper=False)
        return torch.linalg.solve_triangular(self.b, z, upper=True, left=False)

    def log_abs_det_jacobian(self, x: Tensor, y: Tensor) -> Tensor:
        return kron_logdet(self.a, self.b, triangular=True).expand(x.shape[:-2])


class KroneckerKind:
    """Base class: the factor storage and the noise-to-matrix map of one posterior family.

    Attributes:
        name: the string accepted by ``AutoKroneckerFlow(kind=...)``.
        exact_marginals: whether every entry's marginal is normal with the variance of
            :meth:`entry_scale` (so quantiles are exact).
    """

    name = ""
    exact_marginals = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def init_factor(self, size: int, scale: float, like: Tensor, batch: torch.Size) -> tuple[Tensor, constraints.Constraint]:
        """Free parameters of a ``(*batch, size, size)`` factor equal to ``scale * I``, and their constraint."""
        raise NotImplementedError

    def factor(self, params: Tensor, size: int) -> Tensor:
        """The ``(..., size, size)`` lower-triangular factor of the stored parameters."""
        raise NotImplementedError

    def noise_map(self, n: int, p: int, like: Tensor) -> Transform | None:
        r"""A learnable map ``G`` of the ``(n, p)`` noise (a module), or ``None`` for :math:`G = \mathrm{id}`."""
        return None

    def transform(self, loc: Tensor, a: Tensor, b: Tensor, noise_map: Transform | None) -> Transform:
        r"""The map :math:`E \mapsto U` from standard-normal noise to the site's unconstrained matrix."""
        affine = KroneckerAffine(loc, a, b.transpose(-1, -2))
        return affine if noise_map is None else ComposeTransform([noise_map, affine])

    def posterior(self, loc: Tensor, a: Tensor, b: Tensor, noise_map: Transform | None) -> dist.TorchDistribution:
        r"""The distribution of ``U`` (event shape ``(n, p)``): a ``MatrixNormal`` when :math:`G = \mathrm{id}`,
        so that ``TraceMeanField_ELBO`` finds its closed-form KL."""
        if noise_map is None:
            return MatrixNormal(loc, a, b)  # U = M + A E B^T
        noise = dist.Normal(torch.zeros_like(loc), 1.0).to_event(2)
        return dist.TransformedDistribution(noise, [self.transform(loc, a, b, noise_map)])

    @staticmethod
    def entry_scale(a: Tensor, b: Tensor) -> Tensor:
        r""":math:`\operatorname{sd}(U_{ij}) = \sqrt{(A A^\top)_{ii} (B B^\top)_{jj}}` when :math:`G = \mathrm{id}`, shape ``(..., n, p)``."""
        return (a.square().sum(-1).unsqueeze(-1) * b.square().sum(-1).unsqueeze(-2)).sqrt()


class DiagKind(KroneckerKind):
    """K-Diag: positive diagonal ``A`` and ``B``, :math:`n + p` scale parameters per matrix.

    See ``docs/math/kronecker.md#k-diag``.
    """

    name = "diag"

    def init_factor(self, size, scale, like, batch):
        return like.new_full(batch + (size,), scale), constraints.positive

    def factor(self, params, size):
        return torch.diag_embed(params)


class LinearKind(KroneckerKind):
    """K-Linear: lower-triangular ``A``, ``B`` stored as :math:`L = D (I + N)` (:func:`factor_from_params`).

    See ``docs/math/kronecker.md#k-linear``.
    """

    name = "linear"

    def init_factor(self, size, scale, like, batch):
        rows, cols = torch.tril_indices(size, size, device=like.device)
        params = torch.where(rows == cols, math.log(scale), 0.0).to(like.dtype)
        return params.expand(batch + params.shape).clone(), constraints.real

    def factor(self, params, size):
        return factor_from_params(params, size)


class NonlinearKind(LinearKind):
    """K-Nonlinear: K-Linear factors around a flow ``G`` of every column and row of the noise.

    See ``docs/math/kronecker.md#k-nonlinear``.

    Args:
        flow: ``"additive_coupling"`` (volume preserving, NICE; the paper's), ``"affine_coupling"``
            (RealNVP) or ``"iaf"``.
        hidden_dims: hidden sizes of the flows' conditioner networks (a non-empty sequence of
            positive ints; with ``"iaf"`` each at least the longer side of every matrix site).

    Raises:
        ValueError: an unknown ``flow`` or malformed ``hidden_dims``.
    """

    name = "nonlinear"
    exact_marginals = False

    def __init__(self, flow: str = "additive_coupling", hidden_dims: tuple[int, ...] = (32,)):
        self.flow, self.hidden_dims = canonical_flow(flow), canonical_hidden_dims(hidden_dims)

    def __repr__(self) -> str:
        return f"NonlinearKind(flow={self.flow!r}, hidden_dims={self.hidden_dims})"

    def noise_map(self, n, p, like):
        with torch.device(like.device):  # built where the site lives, not on the default device
            flow = kronecker_nonlinear(n, p, self.flow, self.hidden_dims)
        return flow.to(like.dtype)


#: The options of ``AutoKroneckerFlow`` that only the ``"nonlinear"`` kind uses, with its defaults.
NONLINEAR_DEFAULTS = {"flow": "additive_coupling", "hidden_dims": (32,)}


def as_kind(kind: str | KroneckerKind, flow: str | None = None, hidden_dims: tuple[int, ...] | None = None) -> KroneckerKind:
    """A :class:`KroneckerKind` from a kind object or its name.

    Args:
        kind: ``"diag"``, ``"linear"``, ``"nonlinear"`` or a :class:`KroneckerKind` instance.
        flow: ``"nonlinear"`` only (default ``"additive_coupling"``).
        hidden_dims: ``"nonlinear"`` only (default ``(32,)``).

    Raises:
        ValueError: an unknown ``kind``; ``flow`` or ``hidden_dims`` given with a kind that does not
            use them, or next to a kind object (which carries its own); malformed values.

    Example:
        >>> as_kind("nonlinear", flow="iaf")
        NonlinearKind(flow='iaf', hidden_dims=(32,))
        >>> as_kind("linear", flow="iaf")
        Traceback (most recent call last):
            ...
        ValueError: flow='iaf' applies to kind='nonlinear' only; kind='linear' has no flow (leave flow unset)
    """
    options = {name: value for name, value in (("flow", flow), ("hidden_dims", hidden_dims)) if value is not None}
    given = next(iter(options.items()), None)  # the first option given, if any
    if isinstance(kind, KroneckerKind):
        if given is not None:
            name, value = given
            raise ValueError(f"{name}={value!r} cannot be combined with a kind object ({kind!r}): set it on the object, e.g. NonlinearKind({name}=...)")
        return kind
    if isinstance(kind, type) and issubclass(kind, KroneckerKind):
        raise ValueError(f"kind must be a KroneckerKind instance, got the class {kind.__name__}: pass kind={kind.__name__}()")
    if kind == "nonlinear":
        return NonlinearKind(**{**NONLINEAR_DEFAULTS, **options})
    if kind in ("diag", "linear"):
        # An option the kind would ignore is an error: the user meant a flow they would not get.
        if given is not None:
            name, value = given
            raise ValueError(f"{name}={value!r} applies to kind='nonlinear' only; kind={kind!r} has no flow (leave {name} unset)")
        return DiagKind() if kind == "diag" else LinearKind()
    raise ValueError(f"kind must be one of {KINDS} or a KroneckerKind, got {kind!r}")
