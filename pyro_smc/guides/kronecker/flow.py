r"""``AutoKroneckerFlow``: Kronecker-structured and flow posteriors for weight matrices.

A drop-in replacement for Pyro's ``AutoNormal``. Like it, the guide works on every site's
*unconstrained* value ``u = biject_to(support).inv(value)``, and a site is a *matrix site* when
``u`` has event dim >= 2 (a weight ``Normal(0, 1).expand([n, p]).to_event(2)``; a convolution
kernel ``(out, in, k, k)``, read as the ``(out, in k k)`` matrix; a positive matrix). Each matrix
site gets

* ``kind="diag"``: :math:`U = M + A E B^\top` with diagonal ``A`` (n) and ``B`` (p), ``E`` standard normal;
* ``kind="linear"``: the same with lower-triangular ``A``, ``B``: a matrix normal,
  :math:`\operatorname{Cov}(\operatorname{vec} U) = B B^\top \otimes A A^\top`;
* ``kind="nonlinear"``: :math:`U = M + A \, G(E) \, B^\top`, where ``G`` applies an invertible flow to every
  column and then to every row of ``E`` (:mod:`pyro_smc.guides.kronecker.transforms`);

at :math:`np + n(n+1)/2 + p(p+1)/2` parameters (plus the flows') instead of the :math:`O(n^2 p^2)` of a
full Gaussian. Each kind is a strategy object of :mod:`pyro_smc.guides.kronecker.kinds`, which
``kind=`` also accepts. Every other site (scalars, vectors, simplex, ``LKJCholesky``, whose unconstrained
value is a vector) gets ``AutoNormal``'s diagonal normal. A model without matrix sites therefore
gets exactly ``AutoNormal``'s family, without a warning (``guide.matrix_sites`` lists the matrix
sites, so a model whose weights were meant to be matrices can be checked).

Matrix sites may be batched or sit inside plates: every plate element gets its own ``M``, ``A``
and ``B`` (one flow network per site is shared by the elements). As in ``AutoNormal``, the
parameters of a site inside a subsampled plate have the plate's full size, and each call uses the
rows of its minibatch.

A triangular factor is stored as :math:`L = D (I + N)`: the logs of the diagonal ``D`` and the strictly
lower ``N`` relative to its row's scale, so that Adam's roughly ``lr``-sized steps change
correlations by a fraction instead of swamping a diagonal that has shrunk during training. The
``"diag"`` and ``"linear"`` posteriors are :class:`pyro_smc.distributions.MatrixNormal` s, so
``TraceMeanField_ELBO`` uses their closed-form KL to ``Normal`` priors.

See ``docs/math/kronecker.md#posterior-families`` and ``docs/math/kronecker.md#factor-parametrisation``.

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro_smc.guides import AutoKroneckerFlow
    >>> def model(x, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    ...     with pyro.plate("data", x.shape[0]):
    ...         pyro.sample("y", dist.Normal(x @ w, 0.1).to_event(1), obs=y)
    >>> x, y = torch.randn(20, 3), torch.randn(20, 2)
    >>> pyro.clear_param_store()
    >>> guide = AutoKroneckerFlow(model, kind="linear")
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(x, y)
    >>> guide.matrix_sites, guide.median(x, y)["w"].shape
    ({'w': (3, 2)}, torch.Size([3, 2]))
"""

from __future__ import annotations

import math
import numbers
from contextlib import ExitStack, nullcontext
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

from pyro_smc.guides.kronecker.kinds import KINDS, KroneckerKind, as_kind, factor_from_params, params_from_factor

__all__ = ["KINDS", "AutoKroneckerFlow", "factor_from_params", "params_from_factor"]


class AutoKroneckerFlow(AutoGuide):
    """Kronecker-structured (``"diag"``, ``"linear"``) or flow (``"nonlinear"``) guide.

    Args:
        model: a Pyro model (a ``PyroModule`` BNN with ``PyroSample`` weights works as is).
        kind: ``"diag"``, ``"linear"`` or ``"nonlinear"``, or a
            :class:`~pyro_smc.guides.kronecker.kinds.KroneckerKind` instance.
        flow: ``kind="nonlinear"`` only: the K-Nonlinear flow of every column and row,
            ``"additive_coupling"`` (the default; volume-preserving, NICE; the paper's),
            ``"affine_coupling"`` (RealNVP) or ``"iaf"`` (affine autoregressive).
        hidden_dims: ``kind="nonlinear"`` only: hidden sizes of the flows' conditioner networks,
            default ``(32,)``; with ``"iaf"`` each must be at least the longer side of every matrix.
        init_loc_fn: initial values of the locations (Pyro's init strategies).
        init_scale: initial posterior standard deviation of every unconstrained entry.
        create_plates: as for every ``AutoGuide`` (e.g. to pass the model's subsample indices).

    Attributes:
        kind: the kind's name.
        flow: the flow in use (``None`` for a kind without a flow).
        hidden_dims: the conditioner networks' hidden sizes in use (``None`` for a kind without a flow).
        matrix_sites: ``{name: (n, p)}`` of the sites given a Kronecker posterior (after the
            first call); empty for a model without matrix sites, which then gets ``AutoNormal``'s
            family. A site with no entries (a zero in its shape) is not a matrix site: like every
            other site it gets ``AutoNormal``'s (here trivial) family.
        quantile_samples: draws behind the Monte Carlo :meth:`quantiles` of ``"nonlinear"``
            matrix sites (default 4096, at least 2).

    Calling the guide with the model's arguments returns ``{site: value}``, one draw of every
    latent site in the site's own shape (an ``(n, p)`` matrix for a matrix site).

    Raises:
        ValueError: ``init_scale`` not finite and positive; an unknown ``kind`` or ``flow``;
            ``flow`` or ``hidden_dims`` with a kind that has no flow (``"diag"``, ``"linear"``) or
            next to a kind object (which carries its own); malformed ``hidden_dims``. On the first
            call: ``flow="iaf"`` with a hidden size below a side of a matrix site (naming the site).

    Example:
        Matrix sites get the flow posterior, scalar ones a mean-field normal:

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_smc.guides import AutoKroneckerFlow
        >>> def model(x, y):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
        ...     b = pyro.sample("b", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Normal(x @ w + b, 0.1).to_event(1), obs=y)
        >>> pyro.clear_param_store()
        >>> pyro.set_rng_seed(0)
        >>> x, y = torch.randn(10, 3), torch.randn(10, 2)            # (n_data, 3), (n_data, 2)
        >>> guide = AutoKroneckerFlow(model, kind="nonlinear", hidden_dims=(8,))
        >>> draw = guide(x, y)
        >>> guide.matrix_sites, draw["w"].shape, draw["b"].shape
        ({'w': (3, 2)}, torch.Size([3, 2]), torch.Size([]))
    """

    quantile_samples = 4096

    def __init__(
        self,
        model,
        kind: str | KroneckerKind = "nonlinear",
        flow: str | None = None,
        hidden_dims: tuple[int, ...] | None = None,
        init_loc_fn=init_to_median,
        init_scale: float = 0.1,
        create_plates=None,
    ):
        if isinstance(init_scale, bool) or not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        # None means "not given": flow and hidden_dims given to a kind without a flow are errors.
        self._kind = as_kind(kind, flow, hidden_dims)
        self.kind = self._kind.name
        self.flow, self.hidden_dims = getattr(self._kind, "flow", None), getattr(self._kind, "hidden_dims", None)
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
        self._noise_mapped: set[str] = set()
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
            finfo = torch.finfo(loc.dtype)
            if not finfo.tiny <= self._init_scale <= finfo.max:
                # Its square root (each Kronecker factor's share) would under- or overflow too.
                raise ValueError(
                    f"init_scale={self._init_scale!r} is outside the normal range of site '{name}''s dtype "
                    f"{loc.dtype} ({finfo.tiny:.3g} to {finfo.max:.3g})"
                )
            # A site with no entries has nothing to correlate: AutoNormal's (trivial) family, as
            # AutoNormal gives it (torch's Cholesky constraint checks fail on empty matrices).
            if event_dim < 2 or loc.numel() == 0:
                self._set_param("locs", name, loc, constraints.real, event_dim)
                self._set_param("scales", name, torch.full_like(loc, self._init_scale), constraints.positive, event_dim)
                continue
            batch, event = loc.shape[: loc.dim() - event_dim], loc.shape[loc.dim() - event_dim :]
            n, p = event[0], math.prod(event[1:])
            self.matrix_sites[name] = (n, p)
            self._set_param("locs", name, loc.reshape(batch + (n, p)), constraints.real, 2)
            # The entry scale init_scale is split evenly between the row and column factors.
            s = math.sqrt(self._init_scale)
            for factors, size in (("row_factors", n), ("col_factors", p)):
                params, constraint = self._kind.init_factor(size, s, loc, batch)
                self._set_param(factors, name, params, constraint, 1)
            try:
                noise_map = self._kind.noise_map(n, p, loc)
            except ValueError as error:
                raise ValueError(f"matrix site {name!r} of shape (n, p) = {(n, p)}: {error}") from error
            if noise_map is not None:
                deep_setattr(self.flows, name, noise_map)
                self._noise_mapped.add(name)

    def _set_param(self, group: str, name: str, init: Tensor, constraint: constraints.Constraint, event_dim: int) -> None:
        module = getattr(self, group)
        deep_setattr(module, name, PyroParam(init, constraint, event_dim))
        # A PyroParam takes the value of a parameter of the same name already in Pyro's param store
        # (left by another guide of this model, or by another version of it): of another shape it
        # would fail later with an obscure error, or be used silently.
        shape = attrgetter(name)(module).shape
        if shape != init.shape:
            raise ValueError(
                f"Pyro's param store already holds {group}.{name} of shape {tuple(shape)}, not the {tuple(init.shape)} that site "
                f"{name!r} needs (left by another guide or another version of the model?): call pyro.clear_param_store() first"
            )

    def _matrix_parts(self, name: str) -> tuple[Tensor, Tensor, Tensor, Transform | None]:
        """``M``, ``A``, ``B`` and ``G`` of a matrix site (inside its plates: subsampled)."""
        n, p = self.matrix_sites[name]
        a = self._kind.factor(attrgetter(name)(self.row_factors), n)
        b = self._kind.factor(attrgetter(name)(self.col_factors), p)
        noise_map = attrgetter(name)(self.flows) if name in self._noise_mapped else None
        return attrgetter(name)(self.locs), a, b, noise_map

    def _posterior(self, name: str) -> dist.Distribution:
        """The guide's distribution of the unconstrained value of ``name`` (inside its plates:
        subsampled to the active minibatch)."""
        if name not in self.matrix_sites:
            loc = attrgetter(name)(self.locs)
            return dist.Normal(loc, attrgetter(name)(self.scales)).to_event(self._event_dims[name])
        loc, a, b, noise_map = self._matrix_parts(name)
        posterior = self._kind.posterior(loc, a, b, noise_map)
        event = self._shapes[name][len(self._shapes[name]) - self._event_dims[name] :]
        if len(event) == 2:
            return posterior
        return dist.TransformedDistribution(posterior, [ReshapeTransform(loc.shape[-2:], event, cache_size=1)])

    def _create_plates(self, *args, **kwargs) -> dict:
        # A plate draws its subsample indices when it is built, on the default device, and Pyro's
        # AutoGuide builds its plates without a device: build them where the sites live.
        with torch.device(self._device) if self._device is not None else nullcontext():
            return super()._create_plates(*args, **kwargs)

    # --- sampling ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        """Samples every weight matrix from the flow and returns them by site name (as any Pyro autoguide)."""
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
        if name not in self.matrix_sites:
            return attrgetter(name)(self.locs)
        loc, a, b, noise_map = self._matrix_parts(name)
        # The image of the noise median E = 0 (the location itself unless the noise map moves 0).
        median = loc if noise_map is None else self._kind.transform(loc, a, b, noise_map)(torch.zeros_like(loc))
        return median.reshape(self._shapes[name])

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, Tensor]:
        """Posterior medians of every site, full size (not subsampled), detached copies.

        For ``"nonlinear"`` matrix sites: the image of the noise median :math:`E = 0`.
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
        r"""Marginal quantiles of every site, ``(len(quantiles), *site_shape)``.

        Exact for diagonal-normal sites and for ``"diag"``/``"linear"`` matrix sites (each entry of
        a matrix normal is normal with variance :math:`(A A^\top)_{ii} (B B^\top)_{jj}`, and the support
        transform is monotone). For ``"nonlinear"`` matrix sites the flow's marginals have no
        closed form: they are the sample quantiles of ``quantile_samples`` draws from a fixed seed
        (so repeated calls agree; standard error :math:`\sqrt{q (1 - q) / S} / \mathrm{density}`, and memory
        :math:`S n p`), which leaves the global random state untouched. :math:`q = 0` and :math:`q = 1` are the
        ends of the support for every kind (``-inf`` and ``inf`` before the support transform: the
        flow is a bijection of the whole space), as in ``AutoNormal``.

        Args:
            quantiles: a probability or a 1-d sequence (or tensor) of probabilities in ``[0, 1]``.

        Raises:
            ValueError: ``quantiles`` not 0-d or 1-d, or not in ``[0, 1]`` (NaN included);
                ``quantile_samples`` below 2 when a ``"nonlinear"`` matrix site needs it.
        """
        probabilities = _as_probabilities(quantiles)
        # Standard-normal quantiles by ndtri in float64: Normal.icdf's erfinv(2 q - 1) rounds
        # 2 q - 1 to -1 below q ~ 1e-17 (float64) or ~ 6e-8 (float32) and returns -inf there.
        z = torch.special.ndtri(probabilities)
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        out = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            shape = self._shapes[name]
            if name not in self.matrix_sites:
                values = _normal_quantiles(attrgetter(name)(self.locs), attrgetter(name)(self.scales), z)
            else:
                loc, a, b, noise_map = self._matrix_parts(name)
                if noise_map is None and self._kind.exact_marginals:
                    values = _normal_quantiles(loc, self._kind.entry_scale(a, b), z)
                else:
                    samples = self.quantile_samples
                    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 2:
                        raise ValueError(f"quantile_samples must be an int >= 2, got {samples!r}")
                    values = _sample_quantiles(self._kind.transform(loc, a, b, noise_map), loc, probabilities, int(samples))
            out[name] = biject_to(site["fn"].support)(values.reshape((len(probabilities),) + shape))
        return out


def _as_probabilities(quantiles) -> Tensor:
    """``quantiles`` as a 1-d float64 CPU tensor, checked to lie in ``[0, 1]``: a handful of numbers,
    parsed in float64 whatever the default dtype and device (so that ``1 + 1e-7`` is not rounded
    into range by float32, and the normal quantiles are computed before rounding to a site's dtype)."""
    try:
        q = quantiles if isinstance(quantiles, Tensor) else torch.as_tensor(quantiles, dtype=torch.float64, device="cpu")
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"quantiles must be a probability or a 1-d sequence of probabilities, got {quantiles!r}") from error
    if q.dim() > 1:
        raise ValueError(f"quantiles must be a probability or a 1-d sequence of probabilities, got shape {tuple(q.shape)}")
    q = q.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    if not bool(((q >= 0) & (q <= 1)).all()):
        raise ValueError(f"quantiles must lie in [0, 1], got {q.tolist()}")
    return q


def _normal_quantiles(loc: Tensor, scale: Tensor, z: Tensor) -> Tensor:
    """``loc + scale z`` for every standard-normal quantile ``z`` (float64), ``(len(z), *loc.shape)``;
    ``z = -inf, inf`` give ``-inf, inf`` whatever the scale (also one that underflowed to 0)."""
    z = z.to(dtype=loc.dtype, device=loc.device).reshape((-1,) + (1,) * loc.dim())
    values = loc + scale * z
    return torch.where(torch.isinf(z), z.expand_as(values), values)


def _sample_quantiles(transform: Transform, loc: Tensor, q: Tensor, num_samples: int) -> Tensor:
    """Sample quantiles (linear interpolation, as ``torch.quantile``) of ``transform(E)`` for
    ``num_samples`` standard-normal ``E`` of ``loc``'s shape drawn from a fixed seed, at the
    float64 levels ``q``; ``q = 0`` and ``q = 1`` give ``-inf`` and ``inf``, the ends of the
    support, not the extreme draws."""
    generator = torch.Generator(device=loc.device).manual_seed(0)
    noise = torch.randn((num_samples,) + loc.shape, generator=generator, device=loc.device, dtype=loc.dtype)
    draws = transform(noise).sort(0).values
    # Positions in float64 (q's dtype), so that a level just below 1 is not rounded to 1.
    position = q * (num_samples - 1)
    lower = position.floor().long().clamp(max=num_samples - 2)
    shape = (-1,) + (1,) * (draws.dim() - 1)
    frac = (position - lower).to(dtype=loc.dtype, device=loc.device).reshape(shape)
    lower = lower.to(loc.device)
    values = draws[lower] + frac * (draws[lower + 1] - draws[lower])
    ends = q.to(loc.device).reshape(shape)
    return values.masked_fill(ends == 0, -math.inf).masked_fill(ends == 1, math.inf)


def _is_identity(transform: Transform) -> bool:
    base = transform
    while isinstance(base, torch.distributions.transforms.IndependentTransform):
        base = base.base_transform
    return base == torch.distributions.transforms.identity_transform or isinstance(base, ComposeTransform) and not base.parts
