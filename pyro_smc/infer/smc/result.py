"""What one step of :class:`~pyro_smc.SMC` reports (:class:`StepRecord`) and a whole run
(:class:`SMCResult`, the records stacked over time).

A step returns its record; the engine keeps the list and nothing else, so every per-step
history (``filtering_means``, ``ess_history``, ``resampled``, ``log_evidence_increments``) is a
stack of one field, and a checkpoint is the particle state plus the records.

Example:
    >>> import torch
    >>> rec = StepRecord(
    ...     torch.tensor([-0.5]),
    ...     {"x": torch.zeros(1, 2)},
    ...     torch.tensor([9.0]),
    ...     torch.tensor([False]),
    ... )
    >>> out = stack_records([rec, rec], log_evidence=torch.tensor([-1.0]))
    >>> (
    ...     out.log_evidence_increments.shape,
    ...     out.filtering_means["x"].shape,
    ...     out.resampler_converged,
    ... )
    (torch.Size([2, 1]), torch.Size([2, 1, 2]), None)
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["SMCResult", "StepRecord", "stack_records"]


class StepRecord(NamedTuple):
    r"""One step of ``B`` filters, as :meth:`SMC.step <pyro_smc.SMC.step>` returns it to the engine.

    Attributes:
        log_evidence_increment: ``(B,)`` :math:`\log \hat p(y_t \mid y_{1:t-1})` (an ``init`` that scores
            sites adds its term to the first step's); 0 at a predict-only step. Keeps its graph.
        filtering_means: ``{key: (B, *event)}`` weighted means of each state entry, taken before
            resampling. Keep their graph.
        ess: ``(B,)`` effective sample size after the reweighting, in ``[1, N]`` (detached).
        resampled: ``(B,)`` bool, the filters that resampled.
        ancestors: the resampler's ancestor indices ``(B', N)`` for the ``B'`` filters that
            resampled; ``None`` when nothing was resampled or the resampler draws no ancestors.
        resampler_converged: ``(B,)`` bool, whether the resampler's inner solve converged
            (``True`` for filters that did not resample); ``None`` when it solved nothing.
    """

    log_evidence_increment: Tensor
    filtering_means: dict
    ess: Tensor
    resampled: Tensor
    ancestors: Optional[Tensor] = None
    resampler_converged: Optional[Tensor] = None


class SMCResult(NamedTuple):
    r"""A snapshot of a particle filter run over ``T`` steps with ``B`` independent filters.

    The tensors keep their autograd graph (``log_evidence`` and the means are differentiable under a
    differentiable resampler); ``ess`` and the flags are detached diagnostics.

    Attributes:
        log_evidence: ``(B,)`` :math:`\log \hat Z`; ``exp(log_evidence)`` is unbiased for the evidence.
        log_evidence_increments: ``(T, B)`` :math:`\log \hat p(y_t \mid y_{1:t-1})` per step (an ``init``
            that scores sites adds its term to the first step); 0 at a predict-only step.
        filtering_means: ``{key: (T, B, *event)}`` weighted means of each state entry (labels
            included), taken before resampling.
        ess: ``(T, B)`` effective sample size after each step's reweighting, in ``[1, N]`` (the
            engine's ``SMC.ess`` is the last row, ``(B,)``).
        resampled: ``(T, B)`` bool, whether each filter resampled at each step.
        resampler_converged: ``(T, B)`` bool: whether the resampler's inner solve (Sinkhorn for
            optimal-transport resampling) converged at each step; ``True`` where nothing was
            solved. ``None`` for resamplers that solve nothing.

    Example:
        >>> import torch
        >>> T, B = 3, 2
        >>> inc = torch.full((T, B), -0.5)
        >>> out = SMCResult(
        ...     inc.sum(0),
        ...     inc,
        ...     {"x": torch.zeros(T, B)},
        ...     torch.full((T, B), 10.0),
        ...     torch.zeros(T, B, dtype=torch.bool),
        ... )
        >>> out.log_evidence.tolist(), out.resampler_converged is None
        ([-1.5, -1.5], True)
    """

    log_evidence: Tensor
    log_evidence_increments: Tensor
    filtering_means: dict
    ess: Tensor
    resampled: Tensor
    resampler_converged: Optional[Tensor] = None


def stack_records(records: Sequence[StepRecord], log_evidence: Tensor) -> SMCResult:
    """The records of ``T >= 1`` steps as one :class:`SMCResult`.

    A step that solved nothing counts as converged, so ``resampler_converged`` is ``None`` only
    when no step solved anything.

    Example:
        >>> import torch
        >>> rec = StepRecord(
        ...     torch.zeros(2),
        ...     {},
        ...     torch.ones(2),
        ...     torch.tensor([True, False]),
        ...     resampler_converged=torch.tensor([False, True]),
        ... )
        >>> stack_records(
        ...     [rec._replace(resampler_converged=None), rec], torch.zeros(2)
        ... ).resampler_converged.tolist()
        [[True, True], [False, True]]
    """
    # A state entry that first appears at a later step has a shorter history of means.
    keys = dict.fromkeys(key for record in records for key in record.filtering_means)
    converged = None
    if any(record.resampler_converged is not None for record in records):
        converged = torch.stack(
            [torch.ones_like(r.resampled) if r.resampler_converged is None else r.resampler_converged for r in records]
        )
    return SMCResult(
        log_evidence=log_evidence,
        log_evidence_increments=torch.stack([record.log_evidence_increment for record in records]),
        filtering_means={key: torch.stack([r.filtering_means[key] for r in records if key in r.filtering_means]) for key in keys},
        ess=torch.stack([record.ess for record in records]),
        resampled=torch.stack([record.resampled for record in records]),
        resampler_converged=converged,
    )
