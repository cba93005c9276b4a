"""What ``SMC.run`` feeds to each step: observations checked once, missing entries and padding masked.

``run(observations)`` walks a sequence ``(T, ...)``; ``run(observations, batched=True,
lengths=...)`` walks a batch of sequences ``(B, T, ...)``, one per filter. Each step receives one
:class:`StepInput`: the observation as the model sees it (missing entries and padding set to
zero: they are never scored), whether the step is predict-only for every filter, the mask of the
observed entries of a partly missing observation, and, for a batch, which filters observe at all.
See ``docs/math/smc.md#missing-observations`` and ``docs/math/smc.md#batches-of-sequences``.

Example:
    >>> import math, torch
    >>> ys = torch.tensor([[0.5, 1.0], [math.nan, math.nan], [math.nan, 2.0]])
    >>> [
    ...     (s.predict_only, s.observed is not None)
    ...     for s in observation_schedule(ys, num_filters=1)
    ... ]
    [(False, False), (True, False), (False, True)]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.smc.checks import HALF_DTYPES
from pyro_smc.observations import row_status

__all__ = ["StepInput", "check_lengths", "fill_missing", "observation_schedule"]


class StepInput(NamedTuple):
    """One step's observation and masks.

    Attributes:
        y: the observation passed to the model, missing entries set to zero.
        predict_only: no filter observes anything at this step.
        observed: bool mask of the observed entries (broadcasting like ``y``) when some entries
            are missing, else ``None``.
        active: bool ``(B,)`` of the filters whose observation is present at this step, ``None``
            when all are.
        ended: bool ``(B,)`` of the filters past the end of their sequence, ``None`` when none is.
    """

    y: Tensor
    predict_only: bool
    observed: Tensor | None = None
    active: Tensor | None = None
    ended: Tensor | None = None


def fill_missing(args: tuple, observed: Tensor | None) -> tuple:
    """``args`` with the missing entries of a partly-NaN observation (the first argument) set to
    zero; ``observed`` is the mask of its observed entries (``None``: nothing is partly missing)."""
    if observed is None:
        return args
    y = args[0]
    return (torch.where(observed, y, torch.zeros_like(y)),) + tuple(args[1:])


def check_lengths(lengths, num_sequences: int, num_steps: int, device) -> Tensor:
    """``lengths`` as a long tensor ``(B,)`` in ``[1, T]`` (all ``T`` when ``None``).

    Raises:
        ValueError: not an integer tensor of shape ``(B,)``, or an entry outside ``[1, T]``.
    """
    if lengths is None:
        return torch.full((num_sequences,), num_steps, dtype=torch.long, device=device)
    if not isinstance(lengths, Tensor):
        try:
            lengths = torch.as_tensor(lengths)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"lengths must be an integer tensor of shape ({num_sequences},), got {lengths!r}") from error
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(f"lengths must be an integer tensor of shape ({num_sequences},), got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (num_sequences,):
        raise ValueError(f"lengths must be an integer tensor of shape ({num_sequences},) (one per sequence), got shape {tuple(lengths.shape)}")
    if num_sequences and not bool(((lengths >= 1) & (lengths <= num_steps)).all()):
        raise ValueError(f"lengths must lie in [1, T] = [1, {num_steps}], got {lengths.tolist()}")
    return lengths.to(device=device, dtype=torch.long)


def observation_schedule(observations: Tensor, num_filters: int, lengths: Tensor | None = None, batched: bool = False) -> list[StepInput]:
    """The per-step inputs of ``SMC.run``, every observation checked up front.

    Args:
        observations: ``(T, ...)``, or ``(B, T, ...)`` with ``B == num_filters`` when ``batched``.
        num_filters: ``B``.
        lengths: integer ``(B,)`` in ``[1, T]`` (``batched`` only).
        batched: one sequence per filter.

    Returns:
        ``T`` :class:`StepInput` records. Batched, ``y`` is ``observations[:, t]`` as ``(B, 1, ...)``
        (``(...)`` when ``B == 1``), broadcasting against the particle dims ``(B, N)``.

    Raises:
        ValueError: not a tensor of the shape above, an infinite entry (naming the step), or bad
            ``lengths`` / ``batched`` (naming the argument).
    """
    if not isinstance(observations, Tensor):
        raise ValueError(f"observations must be a tensor of shape (T, ...), got {type(observations).__name__}")
    if not isinstance(batched, bool):
        raise ValueError(f"batched must be True or False, got {batched!r}")
    if observations.dtype in HALF_DTYPES:
        raise ValueError(
            f"observations are {observations.dtype}: half precision cannot hold log-weights accumulated over time steps; "
            "use float32 or float64 (observations.float())"
        )
    if batched:
        return _batched_schedule(observations, num_filters, lengths)
    if lengths is not None:
        raise ValueError("lengths needs batched=True: observations (B, T, ...) of one sequence per filter")
    if observations.dim() == 0:
        raise ValueError("observations must have a leading time dimension, got a scalar")
    T = observations.shape[0]
    if T == 0:
        raise ValueError(f"observations has no time steps (shape {tuple(observations.shape)}): there is nothing to filter")
    if not observations.is_floating_point():
        return [StepInput(observations[t], False) for t in range(T)]
    status = row_status(observations.reshape(T, -1))
    missing, partly = status.missing.tolist(), set(status.partly.nonzero()[:, 0].tolist())
    schedule = []
    for t in range(T):
        y, observed = observations[t], None
        if t in partly:
            observed = ~status.nan[t].reshape(y.shape)
            (y,) = fill_missing((y,), observed)
        schedule.append(StepInput(y, missing[t], observed))
    return schedule


def _batched_schedule(observations: Tensor, num_filters: int, lengths) -> list[StepInput]:
    """``run(..., batched=True)``: filter ``b`` on ``observations[b]``, steps past ``lengths[b]`` masked."""
    B = num_filters
    if observations.dim() < 2 or observations.shape[0] != B:
        raise ValueError(
            f"observations must have shape (B, T, ...) with B == num_filters == {B} when batched=True, got {tuple(observations.shape)}"
        )
    T = observations.shape[1]
    if T == 0:
        raise ValueError(f"observations has no time steps (shape {tuple(observations.shape)}, dim 1 is time): there is nothing to filter")
    lengths = check_lengths(lengths, B, T, observations.device)
    flat = observations.reshape(B, T, -1)
    padded = torch.arange(T, device=observations.device) >= lengths.unsqueeze(-1)  # (B, T)
    if observations.is_floating_point():
        row_missing, partly, nan = row_status(flat, padded)
        # Missing and padded entries are never scored; the model sees zeros there.
        filled = torch.where(torch.isnan(flat) | padded.unsqueeze(-1), torch.zeros_like(flat), flat).reshape(observations.shape)
    else:
        row_missing, partly, nan, filled = padded, torch.zeros_like(padded), None, observations
    shape = (B, 1) + tuple(observations.shape[2:]) if B > 1 else tuple(observations.shape[2:])
    schedule = []
    for t in range(T):
        active = ~row_missing[:, t]
        observed = (~nan[:, t]).reshape(shape) if bool(partly[:, t].any()) else None
        ended = padded[:, t]
        schedule.append(
            StepInput(
                filled[:, t].reshape(shape),
                bool(row_missing[:, t].all()),
                observed,
                None if bool(active.all()) else active,
                ended if bool(ended.any()) else None,
            )
        )
    return schedule
