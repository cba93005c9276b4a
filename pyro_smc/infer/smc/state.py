"""The state :class:`~pyro_smc.SMC` carries from one step to the next.

Two parts, kept apart because different code may write them:

* :class:`SMCState`, the particles: the dict of tensors that the user's model writes (as under
  ``pyro.infer.SMCFilter``) and that resampling replaces;
* :class:`ParticleWeights`, what the engine carries: the normalised log-weights, the running
  log-evidence and the part of it not yet reported in a step's record (an ``init`` that scores
  sites adds its term to the first step's increment). A step phase takes one and returns a new
  one; nothing else flows between steps.

Example:
    >>> import torch
    >>> weights = ParticleWeights.uniform(
    ...     num_filters=2, num_particles=4, like=torch.zeros(())
    ... )
    >>> weights.log_weights.exp().sum(-1).tolist(), weights.log_evidence.tolist()
    ([1.0, 1.0], [0.0, 0.0])
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["ParticleWeights", "SMCState"]


class SMCState(dict):
    """The particle state: a dict of tensors that only the model may write.

    Every tensor has the particle dimensions ``(B, N)`` (``(N,)`` with one filter) in front.

    Code written against ``pyro.infer.SMCFilter`` also reads the weights from the state: here too
    ``state._log_weights`` is the last step's log-weights, ``(N,)`` with one filter (``(B, N)``
    with ``B``), ``None`` before ``init``. They are normalised (``logsumexp`` 0), where
    ``SMCFilter``'s are shifted to a maximum of 0: the same weights, the same ``argmax``, the same
    :class:`~pyro.distributions.Empirical`. Pyro's ``CompartmentalModel.heuristic()`` reads them
    so. Read-only: the engine owns the weights (:attr:`~pyro_smc.SMC.log_weights`).

    Example:
        >>> import torch
        >>> from pyro_smc import SMC
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
        >>> _, ys = ssm.simulate(1)
        >>> SMC(ssm, num_particles=10).init().step(ys[0]).state["x"].shape
        torch.Size([10, 2])
    """

    def __init__(self, log_weights: Callable[[], Tensor | None] | None = None):
        super().__init__()
        self._locked = False
        self._weights_of = log_weights

    @property
    def _log_weights(self) -> Tensor | None:
        # SMCFilter's name for the weights (see the class docstring); read from the engine, so
        # that a checkpoint restore or a resampling can never leave a stale copy here.
        return None if self._weights_of is None else self._weights_of()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Refuses writes while the guide runs: the guide proposes, only the model writes."""
        self._locked = True
        try:
            yield
        finally:
            self._locked = False

    def __setitem__(self, key, value):
        if self._locked:
            raise RuntimeError("Guide cannot write to SMC state; only the model may")
        super().__setitem__(key, value)

    def replace(self, values: dict) -> None:
        """Writes the engine's new particles (after resampling), bypassing the lock."""
        dict.update(self, values)


class ParticleWeights(NamedTuple):
    r"""The weights of ``B`` filters of ``N`` particles.

    Attributes:
        log_weights: ``(B, N)`` normalised log-weights (``logsumexp`` 0 per filter), with their graph.
        log_evidence: ``(B,)`` the running :math:`\log \hat Z`, with its graph.
        unreported: ``(B,)`` the part of ``log_evidence`` gained since the last step record
            (``None``: nothing).
    """

    log_weights: Tensor
    log_evidence: Tensor
    unreported: Optional[Tensor] = None

    @classmethod
    def uniform(cls, num_filters: int, num_particles: int, like: Tensor) -> ParticleWeights:
        """Equal weights and zero evidence, in ``like``'s floating dtype (else the default) and device."""
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        log_w = torch.full((num_filters, num_particles), -math.log(num_particles), dtype=dtype, device=like.device)
        return cls(log_w, torch.zeros(num_filters, dtype=dtype, device=like.device))

    def gain(self, log_weights: Tensor, increment: Tensor) -> ParticleWeights:
        """New log-weights, with ``increment`` ``(B,)`` added to the evidence and to its unreported part."""
        unreported = increment if self.unreported is None else self.unreported + increment
        return ParticleWeights(log_weights, self.log_evidence + increment, unreported)

    def reported(self) -> tuple[ParticleWeights, Tensor]:
        """These weights with nothing unreported, and the increment to report (zeros if none)."""
        increment = torch.zeros_like(self.log_evidence) if self.unreported is None else self.unreported
        return self._replace(unreported=None), increment
