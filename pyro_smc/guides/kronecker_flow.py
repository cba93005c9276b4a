r"""``AutoKroneckerFlow``: Kronecker-structured and flow posteriors for weight matrices.

Every latent site whose value is a matrix (event dim >= 2; convolution kernels
``(out, in, k, k)`` are read as ``(out, in k k)``) gets the posterior of MATH.md section 3,

* ``kind="diag"``: ``W = M + A E B`` with diagonal ``A`` (n) and ``B`` (p);
* ``kind="linear"``: the same with lower-triangular ``A``, ``B`` (a matrix normal,
  ``vec W ~ N(vec M, B^T B kron A A^T)``);
* ``kind="nonlinear"``: ``W = M + A G(E) B`` with ``G`` invertible flows applied to every
  column and every row of the noise (:mod:`pyro_smc.guides.matrix_transforms`) and ``A``, ``B``
  lower triangular,

at ``np + n(n+1)/2 + p(p+1)/2`` parameters (plus the flows' ``O(n^2 + p^2)``) instead of the
``O(n^2 p^2)`` of a full Gaussian. Every other site gets a diagonal normal in the unconstrained
space, as ``AutoNormal``. A triangular factor is stored as ``L = D (I + N)``: the logs of the
diagonal ``D`` and the strictly lower ``N`` *relative to its row's scale*, so that optimiser steps
(Adam moves every coordinate by about ``lr``) change correlations by a fixed fraction instead of
by a fixed amount that swamps a diagonal which has shrunk during training. The ``"diag"`` and
``"linear"`` matrix posteriors are :class:`pyro_smc.distributions.MatrixNormal` s, so
``TraceMeanField_ELBO`` uses their closed-form KL to the usual ``Normal`` priors.

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro_smc.guides import AutoKroneckerFlow
    >>> def model(x, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    ...     with pyro.plate("data", x.shape[0]):
    ...         pyro.sample("y", dist.Normal(x @ w, 0.1).to_event(1), obs=y)
    >>> x, y = torch.randn(20, 3), torch.randn(20, 2)
    >>> guide = AutoKroneckerFlow(model, kind="linear")
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(x, y)
    >>> guide.median(x, y)["w"].shape
    torch.Size([3, 2])
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.transforms import ComposeTransform
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.nn import PyroModule, PyroParam
from torch import Tensor
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import ReshapeTransform, Transform

from pyro_smc.distributions import MatrixNormal
from pyro_smc.guides.matrix_transforms import kronecker_nonlinear
from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector
from pyro_smc.ops.kronecker import kron_logdet

__all__ = ["KINDS", "AutoKroneckerFlow", "factor_from_params", "params_from_factor"]

KINDS = ("diag", "linear", "nonlinear")


def _tril_init(size: int, scale: float, like: Tensor) -> Tensor:
    rows, cols = torch.tril_indices(size, size, device=like.device)
    return torch.where(rows == cols, math.log(scale), 0.0).to(like.dtype)


def factor_from_params(params: Tensor, size: int) -> Tensor:
    """The triangular factor ``L = D (I + N)`` of a ``"linear"``/``"nonlinear"`` guide.

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


class _KroneckerAffine(Transform):
    """``X -> M + A X B`` on ``(n, p)`` matrices; ``log|det| = p log|det A| + n log|det B|``."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.independent(constraints.real, 2)
    bijective = True

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


class AutoKroneckerFlow(AutoGuide):
    """Kronecker-structured (``"diag"``, ``"linear"``) or flow (``"nonlinear"``) guide.

    Args:
        model: a Pyro model (a ``PyroModule`` BNN with ``PyroSample`` weights works as is).
        kind: ``"diag"``, ``"linear"`` or ``"nonlinear"``.
        flow: the K-Nonlinear flow: ``"realnvp"`` (volume-preserving coupling, the paper's),
            ``"affine_coupling"`` or ``"iaf"``.
        hidden_dims: hidden sizes of the flows' conditioner networks.
        init_loc_fn: initial values of the locations (Pyro's init strategies).
        init_scale: initial posterior standard deviation of every entry.
        create_plates: as for every ``AutoGuide``.

    Matrix sites must not sit inside plates (weights are global). A model without matrix
    sites gets a warning and a purely diagonal guide.
    """

    def __init__(self, model, kind: str = "nonlinear", flow: str = "realnvp", hidden_dims: tuple[int, ...] = (32,), init_loc_fn=init_to_median, init_scale: float = 0.1, create_plates=None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        self.kind, self.flow, self.hidden_dims = kind, flow, tuple(hidden_dims)
        self.init_loc_fn, self._init_scale = init_loc_fn, float(init_scale)
        # As Pyro's AutoNormal does: the prototype trace (hence every location) follows init_loc_fn.
        model = InitMessenger(self.init_loc_fn)(model)
        super().__init__(model, create_plates=create_plates)

    # --- parameters -------------------------------------------------------------------------
    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        self.locs, self.scales, self.flows = PyroModule(), PyroModule(), PyroModule()
        self._matrix_shapes: dict[str, tuple[int, int]] = {}
        self._event_dims: dict[str, int] = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            fn = site["fn"]
            unconstrained = biject_to(fn.support).inv(site["value"].detach())
            event_dim = fn.event_dim
            self._event_dims[name] = event_dim
            key = name.replace(".", "__")
            if event_dim >= 2:
                batch = unconstrained.shape[: unconstrained.dim() - event_dim]
                if len(batch) and batch.numel() > 1:
                    raise ValueError(f"matrix site {name!r} has batch shape {tuple(batch)}; AutoKroneckerFlow needs global weight matrices")
                shape = unconstrained.shape[unconstrained.dim() - event_dim :]
                n, p = shape[0], math.prod(shape[1:])
                self._matrix_shapes[name] = (n, p)
                setattr(self.locs, key, PyroParam(unconstrained.reshape(n, p)))
                # The entry scale init_scale is split evenly between the row and column factors.
                s = math.sqrt(self._init_scale)
                if self.kind == "diag":
                    setattr(self.scales, key + "_row", PyroParam(unconstrained.new_full((n,), s), constraints.positive))
                    setattr(self.scales, key + "_col", PyroParam(unconstrained.new_full((p,), s), constraints.positive))
                else:
                    setattr(self.scales, key + "_row", PyroParam(_tril_init(n, s, unconstrained)))
                    setattr(self.scales, key + "_col", PyroParam(_tril_init(p, s, unconstrained)))
                if self.kind == "nonlinear":
                    # Built on the site's device (not on the default one and then copied over).
                    with torch.device(unconstrained.device):
                        flow = kronecker_nonlinear(n, p, self.flow, self.hidden_dims)
                    setattr(self.flows, key, flow.to(unconstrained.dtype))
            else:
                setattr(self.locs, key, PyroParam(unconstrained))
                setattr(self.scales, key, PyroParam(torch.full_like(unconstrained, self._init_scale), constraints.positive))
        if not self._matrix_shapes:
            warnings.warn("AutoKroneckerFlow: the model has no matrix-valued latent sites; every site gets a diagonal normal", stacklevel=2)

    def _factors(self, name: str) -> tuple[Tensor, Tensor]:
        key = name.replace(".", "__")
        n, p = self._matrix_shapes[name]
        row, col = getattr(self.scales, key + "_row"), getattr(self.scales, key + "_col")
        if self.kind == "diag":
            return torch.diag_embed(row), torch.diag_embed(col)
        return factor_from_params(row, n), factor_from_params(col, p)

    def _posterior(self, name: str, site) -> dist.Distribution:
        """The guide's distribution of the unconstrained value of ``name``."""
        key = name.replace(".", "__")
        loc = getattr(self.locs, key)
        if name not in self._matrix_shapes:
            return dist.Normal(loc, getattr(self.scales, key)).to_event(self._event_dims[name])
        a, b = self._factors(name)
        shape = site["fn"].event_shape
        reshape = [] if len(shape) == 2 else [ReshapeTransform(loc.shape, shape, cache_size=1)]
        if self.kind == "nonlinear":
            noise = dist.Normal(torch.zeros_like(loc), 1.0).to_event(2)
            parts = [getattr(self.flows, key), _KroneckerAffine(loc, a, b.transpose(-1, -2))] + reshape
            return dist.TransformedDistribution(noise, parts)
        # W = M + A E B with B upper triangular is the MatrixNormal with column factor B^T.
        base = MatrixNormal(loc, a, b)
        return dist.TransformedDistribution(base, reshape) if reshape else base

    # --- sampling ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            transform = biject_to(site["fn"].support)
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                posterior = self._posterior(name, site)
                if _is_identity(transform):
                    result[name] = pyro.sample(name, posterior)
                    continue
                unconstrained = pyro.sample(f"{name}_unconstrained", posterior, infer={"is_auxiliary": True})
                value = transform(unconstrained)
                log_density = transform.inv.log_abs_det_jacobian(value, unconstrained)
                event_dim = self._event_dims[name]
                log_density = _sum_rightmost(log_density, event_dim - transform.codomain.event_dim)
                result[name] = pyro.sample(name, dist.Delta(value, log_density=log_density, event_dim=event_dim))
        return result

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, Tensor]:
        """Posterior medians; for ``"nonlinear"`` the image of the noise median ``E = 0``."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        out = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            key = name.replace(".", "__")
            loc = getattr(self.locs, key)
            if self.kind == "nonlinear" and name in self._matrix_shapes:
                posterior = self._posterior(name, site)
                loc = ComposeTransform(posterior.transforms)(torch.zeros_like(loc))
            out[name] = biject_to(site["fn"].support)(loc.reshape(site["value"].shape))
        return out


    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, Tensor]:
        """Marginal quantiles of every site, ``(len(quantiles), *site_shape)``.

        Exact for ``"diag"`` and ``"linear"`` (each entry of a matrix normal is normal with
        variance ``U_ii V_jj``, and the support transform is monotone); not defined for
        ``"nonlinear"`` (the flow's marginals have no closed form).
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if self.kind == "nonlinear" and self._matrix_shapes:
            raise NotImplementedError("AutoKroneckerFlow.quantiles is not defined for kind='nonlinear'")
        out = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            key = name.replace(".", "__")
            loc = getattr(self.locs, key)
            if name in self._matrix_shapes:
                a, b = self._factors(name)
                scale = (a.square().sum(-1).unsqueeze(-1) * b.square().sum(-1).unsqueeze(-2)).sqrt()
            else:
                scale = getattr(self.scales, key)
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device).reshape((-1,) + (1,) * loc.dim())
            values = dist.Normal(loc, scale).icdf(q)
            out[name] = biject_to(site["fn"].support)(values.reshape((-1,) + site["value"].shape))
        return out


def _is_identity(transform: Transform) -> bool:
    base = transform
    while isinstance(base, torch.distributions.transforms.IndependentTransform):
        base = base.base_transform
    return base == torch.distributions.transforms.identity_transform or isinstance(base, torch.distributions.transforms.ComposeTransform) and not base.parts


def _sum_rightmost(x: Tensor, dims: int) -> Tensor:
    return x.sum(list(range(-dims, 0))) if dims > 0 else x
