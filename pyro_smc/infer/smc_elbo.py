"""``SMCELBO``: minus the particle filter's log-evidence estimate as a Pyro SVI loss.

See ``docs/math/smc.md#training-objectives``.

``log Z_hat`` from :class:`~pyro_smc.SMC` lower-bounds ``log p(y)`` in expectation (for unbiased
resamplers; with optimal-transport resampling the bias is small and the gradient smooth). Its
mean over ``num_filters`` independent filters is an objective for the model's parameters
(theta) and the proposal's (phi), so ``SVI(model, guide, optim, loss=SMCELBO(...))`` learns both.
The model and guide are ``init``/``step`` objects; ``guide=None`` is the bootstrap proposal.

Example:
    >>> import torch, pyro
    >>> from pyro.infer import SVI
    >>> from pyro_smc import SMCELBO
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(10)
    >>> loss = SMCELBO(num_particles=50, num_filters=2).loss(ssm, None, ys)
    >>> loss > 0
    True
"""

from __future__ import annotations

from typing import Callable

import torch
from pyro.infer import ELBO
from torch import Tensor

from pyro_smc.infer.smc import SMC

__all__ = ["SMCELBO"]


class SMCELBO(ELBO):
    """Loss ``-mean_b log Z_hat_b`` of ``num_filters`` independent particle filters.

    Gradients reach every ``pyro.param`` (and ``PyroParam``) the model and guide read: the
    ``param`` sites pass through to SVI while the sample sites stay inside the filter.
    The loss is not divided by the number of time steps; scale learning rates accordingly.

    Args:
        num_particles: particles per filter.
        resampler: a resampler from :mod:`pyro_smc.resamplers` (default systematic; use
            :class:`~pyro_smc.resamplers.OTResampler` for gradients through resampling).
        num_filters: independent filters averaged in the loss.
        ess_threshold: resampling threshold as a fraction of ``num_particles``.
        max_plate_nesting: plates used by the model inside a step.
    """

    def __init__(
        self,
        num_particles: int = 100,
        resampler: Callable | None = None,
        num_filters: int = 1,
        ess_threshold: float = 0.5,
        max_plate_nesting: int = 0,
    ):
        super().__init__(num_particles=1, max_plate_nesting=max_plate_nesting)
        # Validate now rather than at the first SVI step.
        SMC(_NullModel(), num_particles=num_particles, resampler=resampler, num_filters=num_filters,
            ess_threshold=ess_threshold, max_plate_nesting=max_plate_nesting)
        self.num_particles = num_particles
        self.resampler = resampler
        self.num_filters = num_filters
        self.ess_threshold = ess_threshold
        self.smc: SMC | None = None  # the last run, for diagnostics

    def _run(self, model, guide, observations: Tensor, *args, **kwargs) -> SMC:
        smc = SMC(
            model,
            guide,
            num_particles=self.num_particles,
            resampler=self.resampler,
            ess_threshold=self.ess_threshold,
            num_filters=self.num_filters,
            max_plate_nesting=self.max_plate_nesting,
        )
        self.smc = smc.run(observations, *args, **kwargs)
        return smc

    def differentiable_loss(self, model, guide, observations: Tensor, *args, **kwargs) -> Tensor:
        """``-mean(log Z_hat)`` with its autograd graph."""
        return -self._run(model, guide, observations, *args, **kwargs).log_evidence.mean()

    def loss(self, model, guide, observations: Tensor, *args, **kwargs) -> float:
        """``-mean(log Z_hat)`` as a float, without building a graph."""
        with torch.no_grad():
            return float(self.differentiable_loss(model, guide, observations, *args, **kwargs))

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError("SMCELBO scores a particle filter, not a single (model, guide) trace pair")

    def loss_and_grads(self, model, guide, observations: Tensor, *args, **kwargs) -> float:
        """Computes the loss and accumulates its gradients into the parameters."""
        loss = self.differentiable_loss(model, guide, observations, *args, **kwargs)
        if loss.requires_grad:
            loss.backward()
        return float(loss.detach())


class _NullModel:
    def init(self, state):
        pass

    def step(self, state):
        pass
