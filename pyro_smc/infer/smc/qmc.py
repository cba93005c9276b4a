r"""The draws of sequential quasi-Monte Carlo: latent sites as inverse CDFs of QMC coordinates.

See ``docs/math/smc.md#sequential-quasi-monte-carlo``. Under ``SMC(qmc=True)`` each step hands every
particle one point of a scrambled Sobol set (:func:`~pyro_smc.ops.qmc.sobol_points`): its first
coordinate picked the particle's ancestor (:func:`~pyro_smc.ops.qmc.qmc_resample`), the others are
spent here, site by site in program order, as the particle's random numbers. :class:`InverseCDFDraws`
is the Pyro handler that does it: every latent site the program draws itself (not observed, not
replayed from the guide) gets the value :math:`F^{-1}(u)` of its distribution at the next
coordinates instead of a pseudo-random draw:

* ``Normal`` (and ``Independent`` of it, so ``.to_event``): :math:`\mu + \sigma \Phi^{-1}(u)`;
* ``MultivariateNormal``: :math:`\mu + L \Phi^{-1}(u)`, ``L`` its Cholesky factor;
* any other distribution whose ``icdf`` works on its batch (``Uniform``, ``Exponential``,
  ``Cauchy``, ...), and ``Independent`` of one.

The value keeps its graph to the distribution's parameters (a reparameterised draw). A site of
any other distribution raises a ``ValueError`` naming it. When the set has too few coordinates
(the first step of a run, before the engine knows how many a step spends) the handler draws a
further, independent scrambled set for the rest; :attr:`InverseCDFDraws.used` tells the engine how
many to draw next time.

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro_smc.infer.smc.importance import ParticleLayout
    >>> layout = ParticleLayout(num_filters=1, num_particles=4, max_plate_nesting=0)
    >>> u = torch.tensor([[[0.5], [0.975], [0.025], [0.5]]], dtype=torch.float64)
    >>> with pyro.plate("particles", 4), InverseCDFDraws(u, layout, "time step 0"):
    ...     x = pyro.sample("x", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
    >>> [round(v, 2) for v in x.tolist()]
    [0.0, 1.96, -1.96, 0.0]
"""

from __future__ import annotations

import math

import torch
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import Distribution, Independent, MultivariateNormal, Normal

from pyro_smc.infer.smc.importance import ParticleLayout
from pyro_smc.ops.qmc import sobol_points
from pyro_smc.tracing import is_latent

__all__ = ["InverseCDFDraws", "inverse_cdf_value"]


def inverse_cdf_value(fn: Distribution, u: Tensor, name: str) -> Tensor:
    """The value of ``fn`` at the coordinates ``u`` (of shape ``batch + event``) by its inverse CDF.

    Raises:
        ValueError: ``fn`` has no inverse CDF this module knows (naming the site ``name``).

    Example:
        >>> import torch
        >>> fn = torch.distributions.Normal(torch.tensor([0.0, 10.0]), 2.0)
        >>> inverse_cdf_value(fn, torch.tensor([0.5, 0.5]), "x").tolist()
        [0.0, 10.0]
    """
    while isinstance(fn, (ExpandedDistribution, MaskedDistribution)):
        fn = fn.base_dist
    if isinstance(fn, Independent):
        return inverse_cdf_value(fn.base_dist, u, name)
    if isinstance(fn, Normal):
        return fn.loc + fn.scale * torch.special.ndtri(u)
    if isinstance(fn, MultivariateNormal):
        return fn.loc + (fn.scale_tril @ torch.special.ndtri(u).unsqueeze(-1)).squeeze(-1)
    if fn.event_shape == torch.Size():
        try:
            return fn.icdf(u)
        except NotImplementedError:
            pass
    raise ValueError(
        f"qmc=True draws each latent site by its inverse CDF; site '{name}' has a {type(fn).__name__}, which has none "
        "(use Normal, MultivariateNormal, a distribution with icdf, or qmc=False)"
    )


class InverseCDFDraws(Messenger):
    """Replaces the latent draws of one step by inverse CDFs of QMC coordinates (module docstring).

    Enter it inside the particle plates (so that each site's distribution is broadcast over the
    particles when it is read) and outside ``poutine.trace`` and ``detach_latent_draws``.

    Args:
        points: ``(B, N, D)`` coordinates in :math:`(0, 1)`, row ``n`` for particle ``n``;
            ``None``: drawn at the first site, ``dims`` of them (or as many as it needs).
        layout: the particle dims.
        where: the step, for messages.
        dims: how many coordinates to draw when ``points`` is ``None``.

    Attributes:
        used: the coordinates spent so far per particle.
    """

    def __init__(self, points: Tensor | None, layout: ParticleLayout, where: str, dims: int = 0):
        super().__init__()
        self.points, self.layout, self.where, self.dims = points, layout, where, dims
        self.used = 0
        self._drawn: set[str] = set()

    def _pyro_sample(self, msg: dict) -> None:
        # Before the draw: a value already set (observed, replayed) is left alone.
        if is_latent(msg) and msg["value"] is None:
            self._drawn.add(msg["name"])

    def _pyro_post_sample(self, msg: dict) -> None:
        name = msg["name"]
        if name not in self._drawn:
            return
        self._drawn.discard(name)
        fn, value = msg["fn"], msg["value"]
        layout = self.layout
        # The particle dim sits left of the model's plates and the event dims.
        dim = value.dim() - len(fn.event_shape) - 1 - layout.max_plate_nesting
        lead = math.prod(value.shape[: dim + 1]) if dim >= 0 else 0
        if lead != layout.num_filters * layout.num_particles:
            raise ValueError(
                f"at {self.where}: qmc=True needs latent site '{name}' to have one value per particle; "
                f"its shape {tuple(value.shape)} has no particle dim {dim - value.dim()}"
            )
        per_particle = math.prod(value.shape[dim + 1 :])
        like = value if value.is_floating_point() else torch.zeros((), dtype=torch.get_default_dtype(), device=value.device)
        u = self._take(per_particle, like).to(dtype=like.dtype, device=like.device)
        msg["value"] = inverse_cdf_value(fn, u.reshape(value.shape), name)

    def _take(self, count: int, like: Tensor) -> Tensor:
        """The next ``count`` coordinates of every particle, ``(B, N, count)``."""
        start, self.used = self.used, self.used + count
        have = 0 if self.points is None else self.points.shape[-1]
        if self.used > have:
            # Too few: one further scrambled set, independent of the first, for the rest.
            size = max(self.used, self.dims) - have if self.points is None else self.used - have
            extra = sobol_points(self.layout.num_particles, size, self.layout.num_filters, like)
            self.points = extra if self.points is None else torch.cat([self.points, extra.to(self.points)], -1)
        return self.points[..., start : self.used]
