r"""``AutoKroneckerFlow``: Kronecker-structured and flow posteriors for weight matrices.

A drop-in replacement for Pyro's ``AutoNormal``. Like it, the guide works on every site's
*unconstrained* value ``u = biject_to(support).inv(value)``, and a site is a *matrix site* when
``u`` has event dim >= 2 (a weight ``Normal(0, 1).expand([n, p]).to_event(2)``; a convolution
kernel ``(out, in, k, k)``, read as the ``(out, in k k)`` matrix; a positive matrix). Each matrix
site gets

* ``kind="diag"``: ``U = M + A E B^T`` with diagonal ``A`` (n) and ``B`` (p), ``E`` standard normal;
* ``kind="linear"``: the same with lower-triangular ``A``, ``B``: a matrix normal,
  ``Cov(vec U) = B B^T kron A A^T``;
* ``kind="nonlinear"``: ``U = M + A G(E) B^T``, where ``G`` applies an invertible flow to every
  column and then to every row of ``E`` (:mod:`pyro_smc.guides.matrix_transforms`);

at ``np + n(n+1)/2 + p(p+1)/2`` parameters (plus the flows') instead of the ``O(n^2 p^2)`` of a
full Gaussian. Every other site (scalars, vectors, simplex, ``LKJCholesky``, whose unconstrained
value is a vector) gets ``AutoNormal``'s diagonal normal. A model without matrix sites therefore
gets exactly ``AutoNormal``'s family, without a warning (``guide.matrix_sites`` lists the matrix
sites, so a model whose weights were meant to be matrices can be checked).

Matrix sites may be batched or sit inside plates: every plate element gets its own ``M``, ``A``
and ``B`` (one flow network per site is shared by the elements). As in ``AutoNormal``, the
parameters of a site inside a subsampled plate have the plate's full size, and each call uses the
rows of its minibatch.

A triangular factor is stored as ``L = D (I + N)``: the logs of the diagonal ``D`` and the strictly
lower ``N`` relative to its row's scale, so that Adam's roughly ``lr``-sized steps change
correlations by a fraction instead of swamping a diagonal that has shrunk during training. The
``"diag"`` and ``"linear"`` posteriors are :class:`pyro_smc.distributions.MatrixNormal` s, so
``TraceMeanField_ELBO`` uses their closed-form KL to ``Normal`` priors.

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
    >>> guide.matrix_sites, guide.median(x, y)["w"].shape
    ({'w': (3, 2)}, torch.Size([3, 2]))
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.transforms import ComposeTransform
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors
from pyro.nn import PyroModule, PyroParam
from pyro.ops.tensor_utils import periodic_repeat
from torch import Tensor
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import ReshapeTransform, Transform

from pyro_smc.distributions import MatrixNormal
from pyro_smc.guides.matrix_transforms import canonical_flow, kronecker_nonlinear
from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector
from pyro_smc.ops.kronecker import kron_logdet

__all__ = ["KINDS", "AutoKroneckerFlow", "factor_from_params", "params_from_factor"]

KINDS = ("diag", "linear", "nonlinear")


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
    """``X -> M + A X B`` on ``(..., n, p)`` matrices; ``log|det| = p log|det A| + n log|det B|``."""

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


class AutoKroneckerFlow(AutoGuide):
    """Kronecker-structured (``"diag"``, ``"linear"``) or flow (``"nonlinear"``) guide.

    Args:
        model: a Pyro model (a ``PyroModule`` BNN with ``PyroSample`` weights works as is).
        kind: ``"diag"``, ``"linear"`` or ``"nonlinear"``.
        flow: the K-Nonlinear flow of every column and row: ``"additive_coupling"``
            (volume-preserving, NICE; the paper's), ``"affine_coupling"`` (RealNVP) or ``"iaf"``
            (affine autoregressive). ``"realnvp"`` is a deprecated name of ``"additive_coupling"``.
        hidden_dims: hidden sizes of the flows' conditioner networks.
        init_loc_fn: initial values of the locations (Pyro's init strategies).
        init_scale: initial posterior standard deviation of every unconstrained entry.
        create_plates: as for every ``AutoGuide`` (e.g. to pass the model's subsample indices).

    Attributes:
        matrix_sites: ``{name: (n, p)}`` of the sites given a Kronecker posterior (after the
            first call); empty for a model without matrix sites, which then gets ``AutoNormal``'s
            family.
        quantile_samples: draws behind the Monte Carlo :meth:`quantiles` of ``"nonlinear"``
            matrix sites (default 4096).
    """

    quantile_samples = 4096

    def __init__(self, model, kind: str = "nonlinear", flow: str = "additive_coupling", hidden_dims: tuple[int, ...] = (32,), init_loc_fn=init_to_median, init_scale: float = 0.1, create_plates=None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        flow = canonical_flow(flow)
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        self.kind, self.flow, self.hidden_dims = kind, flow, tuple(hidden_dims)
        self.init_loc_fn, self._init_scale = init_loc_fn, float(init_scale)
        # As Pyro's AutoNormal does: the prototype trace (hence every location) follows init_loc_fn.
        model = InitMessenger(self.init_loc_fn)(model)
        super().__init__(model, create_plates=create_plates)

    # --- parameters -------------------------------------------------------------------------
    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        self.locs, self.scales = PyroModule(), PyroModule()
        self.row_factors, self.col_factors, self.flows = PyroModule(), PyroModule(), PyroModule()
        self.matrix_sites: dict[str, tuple[int, int]] = {}
        self._event_dims: dict[str, int] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._device = None
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            self._device = self._device or site["value"].device
            with helpful_support_errors(site):
                loc = biject_to(site["fn"].support).inv(site["value"].detach()).detach()
            event_dim = site["fn"].event_dim + loc.dim() - site["value"].dim()
            # Subsampled plates: parameters get the plate's full size, as in AutoNormal.
            for frame in site["cond_indep_stack"]:
                full_size = frame.full_size or frame.size
                if full_size != frame.size:
                    loc = periodic_repeat(loc, full_size, frame.dim - event_dim).contiguous()
            self._event_dims[name], self._shapes[name] = event_dim, loc.shape
            if event_dim < 2:
                deep_setattr(self.locs, name, PyroParam(loc, constraints.real, event_dim))
                deep_setattr(self.scales, name, PyroParam(torch.full_like(loc, self._init_scale), constraints.positive, event_dim))
                continue
            batch, event = loc.shape[: loc.dim() - event_dim], loc.shape[loc.dim() - event_dim :]
            n, p = event[0], math.prod(event[1:])
            self.matrix_sites[name] = (n, p)
            deep_setattr(self.locs, name, PyroParam(loc.reshape(batch + (n, p)), constraints.real, 2))
            # The entry scale init_scale is split evenly between the row and column factors.
            s = math.sqrt(self._init_scale)
            if self.kind == "diag":
                row, col, constraint = loc.new_full(batch + (n,), s), loc.new_full(batch + (p,), s), constraints.positive
            else:
                row, col, constraint = _tril_init(n, s, loc, batch), _tril_init(p, s, loc, batch), constraints.real
            deep_setattr(self.row_factors, name, PyroParam(row, constraint, 1))
            deep_setattr(self.col_factors, name, PyroParam(col, constraint, 1))
            if self.kind == "nonlinear":
                with torch.device(loc.device):  # built where the site lives, not on the default device
                    flow = kronecker_nonlinear(n, p, self.flow, self.hidden_dims)
                deep_setattr(self.flows, name, flow.to(loc.dtype))

    def _factors(self, name: str) -> tuple[Tensor, Tensor]:
        n, p = self.matrix_sites[name]
        row, col = attrgetter(name)(self.row_factors), attrgetter(name)(self.col_factors)
        if self.kind == "diag":
            return torch.diag_embed(row), torch.diag_embed(col)
        return factor_from_params(row, n), factor_from_params(col, p)

    def _posterior(self, name: str) -> dist.Distribution:
        """The guide's distribution of the unconstrained value of ``name`` (inside its plates:
        subsampled to the active minibatch)."""
        loc = attrgetter(name)(self.locs)
        if name not in self.matrix_sites:
            return dist.Normal(loc, attrgetter(name)(self.scales)).to_event(self._event_dims[name])
        a, b = self._factors(name)
        event = self._shapes[name][len(self._shapes[name]) - self._event_dims[name] :]
        reshape = [] if len(event) == 2 else [ReshapeTransform(loc.shape[-2:], event, cache_size=1)]
        if self.kind == "nonlinear":
            noise = dist.Normal(torch.zeros_like(loc), 1.0).to_event(2)
            parts = [attrgetter(name)(self.flows), _KroneckerAffine(loc, a, b.transpose(-1, -2))] + reshape
            return dist.TransformedDistribution(noise, parts)
        base = MatrixNormal(loc, a, b)  # U = M + A E B^T
        return dist.TransformedDistribution(base, reshape) if reshape else base

    def _create_plates(self, *args, **kwargs) -> dict:
        # Pyro's AutoGuide makes its subsampling plates without a device, so their indices are
        # drawn on the default device; draw them where the sites live.
        if self.master is None:
            plates = self.create_plates(*args, **kwargs) if self.create_plates is not None else []
            plates = [plates] if isinstance(plates, pyro.plate) else list(plates)
            self.plates = {p.name: p for p in plates}
            for name, frame in sorted(self._prototype_frames.items()):
                if name not in self.plates:
                    self.plates[name] = pyro.plate(name, frame.full_size or frame.size, dim=frame.dim, subsample_size=frame.size, device=self._device)
            return self.plates
        return super()._create_plates(*args, **kwargs)

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
                posterior = self._posterior(name)
                if _is_identity(transform):
                    # Sampled under the site's own name, so TraceMeanField_ELBO sees the
                    # MatrixNormal and uses its closed-form KL.
                    result[name] = pyro.sample(name, posterior)
                    continue
                unconstrained = pyro.sample(f"{name}_unconstrained", posterior, infer={"is_auxiliary": True})
                value = transform(unconstrained)
                if poutine.get_mask() is False:
                    log_density = 0.0
                else:
                    log_density = transform.inv.log_abs_det_jacobian(value, unconstrained)
                    log_density = sum_rightmost(log_density, log_density.dim() - value.dim() + site["fn"].event_dim)
                result[name] = pyro.sample(name, dist.Delta(value, log_density=log_density, event_dim=site["fn"].event_dim))
        return result

    def _unconstrained_median(self, name: str) -> Tensor:
        loc = attrgetter(name)(self.locs)
        if self.kind == "nonlinear" and name in self.matrix_sites:
            loc = ComposeTransform(self._posterior(name).transforms[:2])(torch.zeros_like(loc))
        return loc.reshape(self._shapes[name])

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, Tensor]:
        """Posterior medians of every site, full size (not subsampled), detached copies.

        For ``"nonlinear"`` matrix sites: the image of the noise median ``E = 0``.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        out = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            loc = self._unconstrained_median(name)
            out[name] = biject_to(site["fn"].support)(loc).detach().clone()
        return out

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, Tensor]:
        """Marginal quantiles of every site, ``(len(quantiles), *site_shape)``.

        Exact for diagonal-normal sites and for ``"diag"``/``"linear"`` matrix sites (each entry of
        a matrix normal is normal with variance ``(A A^T)_ii (B B^T)_jj``, and the support
        transform is monotone). For ``"nonlinear"`` matrix sites the flow's marginals have no
        closed form: they are the sample quantiles of ``quantile_samples`` draws from a fixed seed
        (so repeated calls agree; standard error ``sqrt(q (1 - q) / S) / density``, and memory
        ``S n p``), which leaves the global random state untouched.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        out = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            loc = attrgetter(name)(self.locs)
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device)
            shape = self._shapes[name]
            if name not in self.matrix_sites:
                values = dist.Normal(loc, attrgetter(name)(self.scales)).icdf(q.reshape((-1,) + (1,) * loc.dim()))
            elif self.kind == "nonlinear":
                values = _sample_quantiles(self._posterior(name), q, self.quantile_samples)
            else:
                a, b = self._factors(name)
                scale = (a.square().sum(-1).unsqueeze(-1) * b.square().sum(-1).unsqueeze(-2)).sqrt()
                values = dist.Normal(loc, scale).icdf(q.reshape((-1,) + (1,) * loc.dim()))
            out[name] = biject_to(site["fn"].support)(values.reshape((-1,) + shape))
        return out


def _tril_init(size: int, scale: float, like: Tensor, batch: torch.Size) -> Tensor:
    rows, cols = torch.tril_indices(size, size, device=like.device)
    params = torch.where(rows == cols, math.log(scale), 0.0).to(like.dtype)
    return params.expand(batch + params.shape).clone()


def _sample_quantiles(posterior: dist.TransformedDistribution, q: Tensor, num_samples: int) -> Tensor:
    """Sample quantiles (linear interpolation, as ``torch.quantile``) of draws from a fixed seed."""
    base = posterior.base_dist.base_dist
    generator = torch.Generator(device=base.loc.device).manual_seed(0)
    noise = torch.randn((num_samples,) + base.loc.shape, generator=generator, device=base.loc.device, dtype=base.loc.dtype)
    draws = ComposeTransform(posterior.transforms)(noise).sort(0).values
    position = q.clamp(0, 1) * (num_samples - 1)
    lower = position.floor().long().clamp(max=num_samples - 2)
    frac = (position - lower).reshape((-1,) + (1,) * (draws.dim() - 1))
    return draws[lower] + frac * (draws[lower + 1] - draws[lower])


def _is_identity(transform: Transform) -> bool:
    base = transform
    while isinstance(base, torch.distributions.transforms.IndependentTransform):
        base = base.base_transform
    return base == torch.distributions.transforms.identity_transform or isinstance(base, ComposeTransform) and not base.parts
