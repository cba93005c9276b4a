r"""The static parameters of a state-space model: its ``PyroSample`` attributes.

Particle MCMC (:class:`~pyro_smc.infer.pmcmc.PMMH`, :class:`~pyro_smc.infer.pmcmc.ParticleGibbs`)
and :class:`~pyro_smc.infer.smc2.SMC2` infer parameters :math:`\theta` that do not change with time
beside the latent path. A Pyro model declares them the way a ``PyroModule`` declares any random
attribute, with a prior::

    model.sigma = PyroSample(dist.LogNormal(0.0, 1.0))

:class:`StaticParameters` finds every such attribute of a model and its submodules, and gives the
three things these engines need:

* the prior, as sampling and log-density, with priors that read earlier parameters
  (``PyroSample(lambda self: dist.Normal(self.mu, 1.0))``) evaluated in declaration order;
* the map to and from the unconstrained space that random-walk proposals move in
  (:func:`torch.distributions.biject_to` of each prior's support), with its log-Jacobian;
* :meth:`StaticParameters.fixed`, a context in which the attributes hold given values, so that
  the model's ``init`` and ``step`` run as a plain state-space model given :math:`\theta`.

Inside :meth:`~StaticParameters.fixed` the attributes are ordinary tensor attributes: they are no
sample sites, so a filter run there scores only the model's latent path and observations, and
:class:`~pyro_smc.SMC`'s compiled step takes them as inputs of its recording. Outside it the
attributes are the ``PyroSample`` priors again.

Site names are those Pyro gives: the attribute name on the root module, ``"sub.name"`` on a
submodule ``sub``.

Example:
    >>> import torch, pyro.distributions as dist
    >>> from pyro.nn import PyroModule, PyroSample
    >>> model = PyroModule()
    >>> model.sigma = PyroSample(dist.LogNormal(0.0, 1.0))
    >>> params = StaticParameters(model)
    >>> params.names, params.unconstrained_size
    (['sigma'], 1)
    >>> with params.fixed({"sigma": torch.tensor(2.0)}):
    ...     float(model.sigma)
    2.0
    >>> z = params.unconstrain({"sigma": torch.tensor(1.0)})["sigma"]
    >>> float(z)  # log 1
    0.0
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, NamedTuple

import torch
from pyro.distributions import Distribution
from pyro.nn import PyroModule
from torch import Tensor
from torch.distributions import biject_to
from torch.distributions.transforms import Transform

__all__ = ["StaticParameters"]


class _Site(NamedTuple):
    name: str  # the Pyro site name
    module: PyroModule  # the module that owns the attribute
    attribute: str
    prior: object  # what PyroSample holds: a distribution, or a callable of the module


class StaticParameters:
    """The ``PyroSample`` attributes of a model, as one parameter vector with a prior.

    Args:
        model: a ``PyroModule`` whose static parameters (on it or on its submodules) are
            ``PyroSample`` attributes.
        names: the site names to use, in this order (default: all, in declaration order).
            Parameters not named keep their ``PyroSample`` prior and are drawn afresh wherever the
            model reads them: leave none out unless the model never reads it.

    Raises:
        ValueError: if ``model`` is not a ``PyroModule``, declares no ``PyroSample`` attribute, or
            ``names`` names one it does not declare.

    Example:
        >>> import torch, pyro.distributions as dist
        >>> from pyro.nn import PyroModule, PyroSample
        >>> model = PyroModule()
        >>> model.rho = PyroSample(dist.Uniform(-1.0, 1.0))
        >>> model.sigma = PyroSample(dist.HalfNormal(1.0))
        >>> params = StaticParameters(model)
        >>> values = params.sample((5,))
        >>> params.log_prior(values).shape
        torch.Size([5])
        >>> z = params.flatten(params.unconstrain(values))  # (5, 2), on the real line
        >>> back = params.constrain(params.unflatten(z))
        >>> torch.allclose(back["rho"], values["rho"], atol=1e-5)
        True
    """

    def __init__(self, model: torch.nn.Module, names: list[str] | None = None) -> None:
        if not isinstance(model, PyroModule):
            raise ValueError(f"model must be a PyroModule whose static parameters are PyroSample attributes, got {type(model).__name__}")
        found = {}
        for path, module in model.named_modules():
            if isinstance(module, PyroModule):
                for attribute in module.__dict__.get("_pyro_samples", {}):
                    name = f"{path}.{attribute}" if path else attribute
                    found[name] = _Site(name, module, attribute, module._pyro_samples[attribute])
        if not found:
            raise ValueError(
                "model declares no static parameter: give each a prior as a PyroSample attribute, e.g. model.sigma = PyroSample(dist.LogNormal(0.0, 1.0))"
            )
        if names is None:
            names = list(found)
        unknown = [n for n in names if n not in found]
        if unknown:
            raise ValueError(f"names: {unknown} are not PyroSample attributes of the model (it has {list(found)})")
        self.model = model
        self._sites = [found[n] for n in names]
        self.names: list[str] = list(names)
        # Shapes and supports are read once, from the prior at a prior draw.
        draw = self.sample()
        with self.fixed(draw):
            priors = {s.name: self._prior(s) for s in self._sites}
        self.shapes: dict[str, torch.Size] = {n: draw[n].shape for n in self.names}
        self.transforms: dict[str, Transform] = {n: biject_to(priors[n].support) for n in self.names}
        self._check_fixed_supports()
        self.unconstrained_shapes: dict[str, torch.Size] = {n: torch.Size(self.transforms[n].inv.forward_shape(self.shapes[n])) for n in self.names}
        self.unconstrained_size: int = sum(math.prod(s) for s in self.unconstrained_shapes.values())

    def _check_fixed_supports(self, draws: int = 3) -> None:
        """Raises unless every prior's support is the same at other prior draws: the transforms
        to the unconstrained space are built once, so a support that depends on another
        parameter (``b ~ Uniform(0, a)``) would be frozen at one draw's bounds, silently
        truncating the prior (E[b] 0.279 against the exact 0.375 under SMC2)."""
        dependent = [s for s in self._sites if self._reads_module(s)]
        if not dependent:
            return
        probes = {}
        for site in dependent:
            shape = self.transforms[site.name].inv.forward_shape(self.shapes[site.name])
            like = torch.zeros(shape)
            probes[site.name] = (like, like + 1.0, self.transforms[site.name](like), self.transforms[site.name](like + 1.0))
        for _ in range(draws):
            with self.fixed(self.sample()):
                for site in dependent:
                    zero, one, at_zero, at_one = probes[site.name]
                    transform = biject_to(self._prior(site).support)
                    if not (torch.allclose(transform(zero), at_zero) and torch.allclose(transform(one), at_one)):
                        raise ValueError(
                            f"static parameter '{site.name}': its prior's support depends on the other parameters' values "
                            f"({self._prior(site).support}), which the samplers' unconstrained space cannot follow; "
                            "reparameterise it with a fixed support (e.g. b = a * u with u ~ Uniform(0, 1))"
                        )

    # --- the prior -------------------------------------------------------------------------------

    @staticmethod
    def _reads_module(site: _Site) -> bool:
        return not isinstance(site.prior, torch.distributions.Distribution)

    @staticmethod
    def _prior(site: _Site) -> Distribution:
        prior = site.prior
        if not hasattr(prior, "sample"):  # a callable of the module, as PyroSample allows
            prior = prior(site.module)
        if not isinstance(prior, torch.distributions.Distribution):
            raise ValueError(f"the prior of static parameter '{site.name}' must be a distribution, got {type(prior).__name__}")
        return prior

    def _batch_ndim(self, values: Mapping[str, Tensor]) -> int:
        name = self.names[0]
        return values[name].dim() - len(self.shapes[name])

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> dict[str, Tensor]:
        """Draws the parameters from the prior.

        Args:
            sample_shape: leading shape of the draws.

        Returns:
            ``{name: (*sample_shape, *shape)}``, in declaration order.

        Example:
            >>> import pyro.distributions as dist
            >>> from pyro.nn import PyroModule, PyroSample
            >>> model = PyroModule()
            >>> model.mu = PyroSample(dist.Normal(0.0, 1.0))
            >>> model.x = PyroSample(lambda self: dist.Normal(self.mu, 0.1))
            >>> StaticParameters(model).sample((3,))["x"].shape
            torch.Size([3])
        """
        sample_shape = torch.Size(sample_shape)
        values: dict[str, Tensor] = {}
        for site in self._sites:
            if not sample_shape or not self._reads_module(site):
                with self.fixed(values):
                    values[site.name] = self._prior(site).sample(sample_shape)
                continue
            # a prior that may read earlier parameters: one draw per element of the batch
            flat = {k: v.reshape((-1,) + self.shapes[k]) for k, v in values.items()}
            draws = []
            for i in range(math.prod(sample_shape)):
                with self.fixed({k: v[i] for k, v in flat.items()}):
                    draws.append(self._prior(site).sample())
            values[site.name] = torch.stack(draws).reshape(sample_shape + draws[0].shape)
        return values

    def initial(self, init_strategy) -> dict[str, Tensor]:
        """A starting point for a chain: a Pyro initialisation strategy (``init_to_median``, ...,
        from ``pyro.infer.autoguide.initialization``) applied to each prior in turn, as
        unconstrained values (a prior may read the parameters before it).

        Example:
            >>> import torch, pyro.distributions as dist
            >>> from pyro.infer.autoguide.initialization import init_to_mean
            >>> from pyro.nn import PyroModule, PyroSample
            >>> model = PyroModule()
            >>> model.sigma = PyroSample(dist.LogNormal(0.0, 1.0))
            >>> StaticParameters(model).initial(init_to_mean)  # log of the mean exp(1/2)
            {'sigma': tensor(0.5000)}
        """
        values: dict[str, Tensor] = {}
        for site in self._sites:
            with self.fixed(values):
                prior = self._prior(site)
            message = {"type": "sample", "name": site.name, "fn": prior, "value": None, "is_observed": False, "infer": {}}
            values[site.name] = init_strategy(message).detach()
        return self.unconstrain(values)

    def log_prior(self, values: Mapping[str, Tensor]) -> Tensor:
        """The prior log-density of the parameters (constrained values).

        Args:
            values: ``{name: (*batch, *shape)}`` for every name.

        Returns:
            ``(*batch,)``: the sum over the parameters, ``-inf`` outside the support.

        Example:
            >>> import torch, pyro.distributions as dist
            >>> from pyro.nn import PyroModule, PyroSample
            >>> model = PyroModule()
            >>> model.rho = PyroSample(dist.Uniform(-1.0, 1.0))
            >>> StaticParameters(model).log_prior({"rho": torch.tensor([0.0, 2.0])})
            tensor([-0.6931,    -inf])
        """
        self._check(values)
        batch_ndim = self._batch_ndim(values)
        batch = values[self.names[0]].shape[:batch_ndim]
        if batch_ndim and any(self._reads_module(s) for s in self._sites):
            flat = {k: v.reshape((-1,) + self.shapes[k]) for k, v in values.items()}
            rows = [self.log_prior({k: v[i] for k, v in flat.items()}) for i in range(math.prod(batch))]
            return torch.stack(rows).reshape(batch)
        total = values[self.names[0]].new_zeros(batch)
        with self.fixed(values):
            for site in self._sites:
                prior = self._prior(site)
                value = values[site.name]
                inside = prior.support.check(value)
                # Outside the support log_prob may raise (a transformed distribution's base
                # validates what the inverse map makes of the value), be NaN or be finite: it is
                # evaluated at a point inside instead and set to -inf.
                event = (1,) * (value.dim() - inside.dim())
                point = self.transforms[site.name](torch.zeros(self.unconstrained_shapes[site.name], dtype=value.dtype, device=value.device))
                safe = torch.where(inside.reshape(inside.shape + event), value, point)
                validate, prior._validate_args = prior._validate_args, False
                try:
                    log_prob = prior.log_prob(safe)
                finally:
                    prior._validate_args = validate
                log_prob = torch.where(inside, log_prob, torch.full_like(log_prob, -math.inf))
                extra = log_prob.dim() - batch_ndim
                total = total + (log_prob.reshape(batch + (-1,)).sum(-1) if extra > 0 else log_prob)
        return total

    # --- the unconstrained space -------------------------------------------------------------------

    def unconstrain(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Maps constrained values to the unconstrained space, per parameter."""
        self._check(values)
        return {n: self.transforms[n].inv(values[n]) for n in self.names}

    def constrain(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Maps unconstrained values to the parameters' supports, per parameter."""
        return {n: self.transforms[n](params[n]) for n in self.names}

    def log_abs_det_jacobian(self, params: Mapping[str, Tensor]) -> Tensor:
        r"""``(*batch,)``: :math:`\log |\det \partial \theta / \partial z|` at unconstrained ``params``,
        summed over the parameters: add it to the log-prior to get the density of :math:`z`."""
        total = 0.0
        for n in self.names:
            z = params[n]
            batch_ndim = z.dim() - len(self.unconstrained_shapes[n])
            ladj = self.transforms[n].log_abs_det_jacobian(z, self.transforms[n](z))
            extra = ladj.dim() - batch_ndim
            total = total + (ladj.reshape(z.shape[:batch_ndim] + (-1,)).sum(-1) if extra > 0 else ladj)
        return total

    def log_prior_unconstrained(self, params: Mapping[str, Tensor]) -> Tensor:
        """``(*batch,)``: the prior log-density of the unconstrained ``params`` (Jacobian included)."""
        return self.log_prior(self.constrain(params)) + self.log_abs_det_jacobian(params)

    def flatten(self, params: Mapping[str, Tensor]) -> Tensor:
        """``{name: (*batch, *unconstrained_shape)}`` -> ``(*batch, unconstrained_size)``."""
        parts = []
        for n in self.names:
            shape = self.unconstrained_shapes[n]
            z = params[n]
            parts.append(z.reshape(z.shape[: z.dim() - len(shape)] + (-1,)))
        return torch.cat(parts, dim=-1)

    def unflatten(self, z: Tensor) -> dict[str, Tensor]:
        """``(*batch, unconstrained_size)`` -> ``{name: (*batch, *unconstrained_shape)}``."""
        if z.shape[-1] != self.unconstrained_size:
            raise ValueError(f"z: last dimension {z.shape[-1]}, expected unconstrained_size = {self.unconstrained_size}")
        out, start = {}, 0
        for n in self.names:
            shape = self.unconstrained_shapes[n]
            size = math.prod(shape)
            out[n] = z[..., start : start + size].reshape(z.shape[:-1] + shape)
            start += size
        return out

    # --- running the model given the parameters ---------------------------------------------------

    @contextlib.contextmanager
    def fixed(self, values: Mapping[str, Tensor]) -> Iterator[None]:
        """A context in which the named attributes hold ``values`` (tensors, used as given).

        The caller shapes the values for the run: a scalar parameter of ``B`` filters run side by
        side, for instance, as ``(B, 1)`` so that it broadcasts against the particles ``(B, N)``.
        Names not in ``values`` keep their prior. The ``PyroSample`` priors are restored on exit,
        also after an error.

        Example:
            >>> import torch, pyro.distributions as dist
            >>> from pyro.nn import PyroModule, PyroSample
            >>> model = PyroModule()
            >>> model.sigma = PyroSample(dist.LogNormal(0.0, 1.0))
            >>> with StaticParameters(model).fixed({"sigma": torch.tensor(0.5)}):
            ...     float(model.sigma)
            0.5
            >>> type(model._pyro_samples["sigma"]).__name__
            'LogNormal'
        """
        saved = []
        try:
            for site in self._sites:
                if site.name in values:
                    samples = site.module.__dict__["_pyro_samples"]
                    saved.append((site, samples.copy()))
                    del samples[site.attribute]
                    # a plain instance attribute: found before nn.Module.__getattr__ is asked
                    site.module.__dict__[site.attribute] = values[site.name]
            yield
        finally:
            for site, samples in reversed(saved):
                site.module.__dict__.pop(site.attribute, None)
                site.module.__dict__["_pyro_samples"] = samples

    def _check(self, values: Mapping[str, Tensor]) -> None:
        missing = [n for n in self.names if n not in values]
        if missing:
            raise ValueError(f"values: missing static parameters {missing}")
        batch = None
        for n in self.names:
            shape = self.shapes[n]
            value = values[n]
            if tuple(value.shape[value.dim() - len(shape) :]) != tuple(shape) or value.dim() < len(shape):
                raise ValueError(f"values['{n}']: shape {tuple(value.shape)} does not end in the parameter's shape {tuple(shape)}")
            lead = value.shape[: value.dim() - len(shape)]
            if batch is not None and lead != batch:
                raise ValueError(f"values['{n}']: leading shape {tuple(lead)} differs from the others' {tuple(batch)}")
            batch = lead
