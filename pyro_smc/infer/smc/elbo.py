"""``SMCELBO``: minus the particle filter's log-evidence estimate as a Pyro SVI loss.

See ``docs/math/smc.md#training-objectives``.

``log Z_hat`` from :class:`~pyro_smc.SMC` lower-bounds ``log p(y)`` in expectation (for unbiased
resamplers; with optimal-transport resampling the bias is small and the gradient smooth). Its
mean over ``num_filters`` independent filters is an objective for the model's parameters
(theta) and the proposal's (phi), so ``SVI(model, guide, optim, loss=SMCELBO(...))`` learns both.
The model and guide are ``init``/``step`` objects; ``guide=None`` is the bootstrap proposal.

A minibatch of sequences ``(B, T, ...)`` is passed with ``batched=True`` (and ``lengths`` for a
padded batch), as to :meth:`SMC.run <pyro_smc.SMC.run>`; ``num_sequences=D``, the size of the
data set the minibatch was drawn from, scales the loss to an unbiased estimate of the whole data
set's ``-sum_d log Z_hat_d``. See ``docs/math/smc.md#batches-of-sequences``.

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

    A minibatch of 3 padded sequences out of a data set of 100:

    >>> batch = torch.stack([ssm.simulate(10)[1] for _ in range(3)])          # (B, T, dy)
    >>> elbo = SMCELBO(num_particles=50, num_filters=2, num_sequences=100)
    >>> loss = elbo.loss(ssm, None, batch, lengths=torch.tensor([10, 8, 4]), batched=True)
    >>> elbo.smc.log_evidence.shape                                           # (B * num_filters,)
    torch.Size([6])
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from pyro.infer import ELBO
from torch import Tensor

from pyro_smc.infer.smc.checks import ParticleDegeneracyWarning, check_settings
from pyro_smc.infer.smc.engine import SMC
from pyro_smc.infer.smc.schedule import check_lengths

__all__ = ["SMCELBO"]


class SMCELBO(ELBO):
    """Loss ``-mean_k log Z_hat_k`` of ``num_filters`` independent particle filters.

    On a minibatch of ``B`` sequences (``batched=True``) each sequence gets ``num_filters``
    filters and the loss is ``-(1/B) sum_b mean_k log Z_hat_{b,k}``: the mean over the minibatch,
    the unbatched loss being its ``B = 1`` case. With ``num_sequences=D`` it is
    ``-(D/B) sum_b mean_k log Z_hat_{b,k}``, whose expectation over minibatches drawn uniformly
    without replacement is ``-sum_{d=1}^D E[log Z_hat_d]``: Pyro's ``subsample`` scaling, the
    loss of the whole data set (``D`` times the default loss).

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
        num_sequences: ``D``, the number of sequences in the data set that the minibatches are
            drawn from; the loss is multiplied by ``D`` (above). ``None``: the minibatch mean.
        compile: as for :class:`~pyro_smc.SMC` (``None``: replay a recorded step when safe;
            ``False``: always Pyro's handlers). The recording is kept with the model and guide,
            so an SVI loop records once (``docs/engines/smc.md#the-compiled-step``).

    The loss methods take ``(model, guide, observations, *args, lengths=None, batched=False,
    **kwargs)``: ``observations`` ``(T, ...)``, or ``(B, T, ...)`` with ``batched=True`` (any
    ``B``; the last minibatch may be smaller), and ``lengths`` ``(B,)`` as in
    :meth:`SMC.run <pyro_smc.SMC.run>`. ``svi.step(batch, lengths=lengths, batched=True)``
    passes them through. ``smc`` (an :class:`~pyro_smc.SMC`) is the last run, its ``log_evidence`` ``(B * num_filters,)``
    ordered sequence by sequence (``reshape(B, num_filters)``).
    See ``docs/math/smc.md#batches-of-sequences``.

    Returns:
        ``loss`` returns a float and ``differentiable_loss`` a scalar tensor (shape ``()``).

    Raises:
        ValueError: ``num_sequences`` is not a positive integer or ``None``, an argument the
            filter checks is invalid, or (at loss time) ``batched=True`` observations are not
            ``(B, T, ...)``.

    Example:
        >>> import torch
        >>> from pyro_smc import SMCELBO
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                              # (T, dy)
        >>> elbo = SMCELBO(num_particles=20, num_filters=3)
        >>> loss = elbo.differentiable_loss(ssm, None, ys)
        >>> loss.shape, elbo.smc.log_evidence.shape              # (), (num_filters,)
        (torch.Size([]), torch.Size([3]))
        >>> bool(torch.isclose(loss, -elbo.smc.log_evidence.mean()))
        True
    """

    def __init__(
        self,
        num_particles: int = 100,
        resampler: Callable | None = None,
        num_filters: int = 1,
        ess_threshold: float = 0.5,
        max_plate_nesting: int = 0,
        num_sequences: int | None = None,
        compile: bool | None = None,
    ):
        super().__init__(num_particles=1, max_plate_nesting=max_plate_nesting)
        if num_sequences is not None and (isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 1):
            raise ValueError(f"num_sequences must be a positive integer (the data set's size) or None, got {num_sequences!r}")
        # Validate now rather than at the first SVI step.
        check_settings(num_particles, num_filters, max_plate_nesting, ess_threshold, resampler)
        self.num_particles = num_particles
        self.resampler = resampler
        self.num_filters = num_filters
        self.ess_threshold = ess_threshold
        self.num_sequences = num_sequences
        self.compile = compile
        self.smc: SMC | None = None  # the last run, for diagnostics
        self._warned_degeneracy = False

    def _log_evidence(self, model, guide, observations: Tensor, *args, lengths=None, batched: bool = False, **kwargs) -> Tensor:
        """``log Z_hat`` of every filter, ``(B, num_filters)`` (``B = 1`` unbatched)."""
        K = self.num_filters
        if batched is True:
            if not isinstance(observations, Tensor) or observations.dim() < 2 or observations.shape[0] < 1:
                shape = tuple(observations.shape) if isinstance(observations, Tensor) else type(observations).__name__
                raise ValueError(f"observations must be a tensor of shape (B, T, ...) with B >= 1 when batched=True, got {shape}")
            B = observations.shape[0]
            lengths = check_lengths(lengths, B, observations.shape[1], observations.device)
            # Sequence b's K filters are rows b * K ... b * K + K - 1.
            observations, lengths = observations.repeat_interleave(K, 0), lengths.repeat_interleave(K, 0)
            num_filters = B * K
        else:
            B, num_filters = 1, K
        smc = SMC(
            model,
            guide,
            num_particles=self.num_particles,
            resampler=self.resampler,
            ess_threshold=self.ess_threshold,
            num_filters=num_filters,
            max_plate_nesting=self.max_plate_nesting,
            compile=self.compile,
            progress_bar=False,  # one run per SVI step: a bar each time would be noise
        )
        # Collapsed weights are reported once per loss object, not at every SVI step (the counts
        # in the message would defeat Python's once-per-location filter).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ParticleDegeneracyWarning)
            self.smc = smc.run(observations, *args, lengths=lengths, batched=batched, **kwargs)
        for record in caught:
            if issubclass(record.category, ParticleDegeneracyWarning):
                if self._warned_degeneracy:
                    continue
                self._warned_degeneracy = True
                message = f"{record.message} (SMCELBO reports this once; later SVI steps may collapse too)"
                warnings.warn(ParticleDegeneracyWarning(message), stacklevel=3)
            else:
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno, source=record.source)
        return smc.log_evidence.reshape(B, K)

    def differentiable_loss(self, model, guide, observations: Tensor, *args, **kwargs) -> Tensor:
        """``-scale * sum_b mean_k log Z_hat_{b,k}`` with its autograd graph, ``scale = 1/B``, or
        ``D/B`` with ``num_sequences=D``."""
        log_z = self._log_evidence(model, guide, observations, *args, **kwargs)
        loss = -log_z.mean()
        return loss if self.num_sequences is None else self.num_sequences * loss

    def loss(self, model, guide, observations: Tensor, *args, **kwargs) -> float:
        """:meth:`differentiable_loss` as a float, without building a graph."""
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
