r"""The one rule for missing observations, written once and used by every engine.

At time step ``t`` an observation is

* **missing** when it is ``None`` or a tensor whose entries are all NaN: the engine predicts and
  does not update, and the step adds nothing to the log-evidence;
* **partly missing** when a vector observation has some NaN entries: the Gaussian engines (and
  ``ops.kalman``) condition on the observed entries only, with the exact Gaussian marginal of those
  entries; ``SMC`` scores only the observed entries of a site that factorises over them; the online
  filter refuses it, naming the step;
* an **error** when any entry is ``inf`` (one message for every engine, :func:`inf_error`), or when
  it is not a tensor, or its shape differs from the other steps'.

A batch of sequences of different lengths pads each sequence at its end; a padded row is never
read (:func:`row_status` takes the padding mask), so it may hold anything.

Example:
    >>> import math, torch
    >>> from pyro_smc.observations import row_status, step_observation
    >>> ys = torch.tensor([[0.5, 1.0], [math.nan, math.nan], [math.nan, 2.0]])      # (T, k)
    >>> status = row_status(ys)
    >>> status.missing.tolist(), status.partly.tolist()
    ([False, True, False], [False, False, True])
    >>> step_observation(ys[2], t=2).observed.tolist()
    [False, True]
    >>> step_observation(torch.tensor([math.inf]), t=7)
    Traceback (most recent call last):
        ...
    ValueError: observation at time step 7 contains inf (use NaN for a missing entry)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["RowStatus", "StepObservation", "check_observations", "inf_error", "row_status", "step_observation"]


def inf_error(t: int, sequence: int | None = None) -> ValueError:
    """The error for an infinite entry at time step ``t`` (of sequence ``sequence`` in a batch).

    Example:
        >>> str(inf_error(3, sequence=1))
        'observation at time step 3 (sequence 1) contains inf (use NaN for a missing entry)'
    """
    which = "" if sequence is None else f" (sequence {sequence})"
    return ValueError(f"observation at time step {t}{which} contains inf (use NaN for a missing entry)")


class RowStatus(NamedTuple):
    """What each time step's observation row is (see the module docstring).

    Attributes:
        missing: bool ``(..., T)``: nothing to score (all NaN, or padding).
        partly: bool ``(..., T)``: some entries NaN, not missing.
        nan: bool ``(..., T, k)``: the NaN entries of rows that are not padding.
    """

    missing: Tensor
    partly: Tensor
    nan: Tensor


def row_status(flat: Tensor, padded: Tensor | None = None) -> RowStatus:
    """The status of observation rows ``flat`` ``(..., T, k)``, every row checked for ``inf``.

    Args:
        flat: floating rows ``(T, k)``, or ``(B, T, k)`` for a batch of sequences.
        padded: bool ``(..., T)``, rows past a sequence's end (never read); ``None``: none.

    Returns:
        A :class:`RowStatus`.

    Raises:
        ValueError: an unpadded row holds an ``inf`` (:func:`inf_error` of the first such row).

    Example:
        >>> import torch
        >>> row_status(
        ...     torch.zeros(3, 2), padded=torch.tensor([False, False, True])
        ... ).missing.tolist()
        [False, False, True]
    """
    if padded is None:
        padded = torch.zeros(flat.shape[:-1], dtype=torch.bool, device=flat.device)
    inf = torch.isinf(flat).any(-1) & ~padded
    if bool(inf.any()):
        first = inf.nonzero()[0].tolist()
        raise inf_error(first[-1], first[0] if len(first) > 1 else None)
    nan = torch.isnan(flat) & ~padded.unsqueeze(-1)
    missing = (nan.all(-1) & (flat.shape[-1] > 0)) | padded
    return RowStatus(missing, nan.any(-1) & ~missing, nan)


class StepObservation(NamedTuple):
    """One step's observation as a stepping engine reads it.

    Attributes:
        missing: the step is predict-only (``None`` or all NaN).
        observed: bool mask of the observed entries when the observation is partly missing,
            else ``None``.
    """

    missing: bool
    observed: Tensor | None = None


def step_observation(y: Any, t: int, expected_shape: torch.Size | None = None) -> StepObservation:
    """Checks the observation of step ``t`` of a stepping engine (``SMC.step``, the online filter).

    Args:
        y: a tensor or ``None``.
        t: the 0-based time step, for the messages.
        expected_shape: the shape of the earlier steps' observations (``None``: not checked).

    Returns:
        A :class:`StepObservation`; a non-floating tensor is never missing.

    Raises:
        ValueError: ``y`` is neither a tensor nor ``None``, has another shape than
            ``expected_shape``, or holds an ``inf``, naming the time step.

    Example:
        >>> import math, torch
        >>> (
        ...     step_observation(None, t=0),
        ...     step_observation(torch.full((2,), math.nan), t=1).missing,
        ... )
        (StepObservation(missing=True, observed=None), True)
    """
    if y is None:
        return StepObservation(True)
    if not isinstance(y, Tensor):
        raise ValueError(f"observation at time step {t} must be a Tensor or None, got {type(y).__name__}")
    if expected_shape is not None and y.shape != expected_shape:
        raise ValueError(f"observation at time step {t} has shape {tuple(y.shape)}, expected {tuple(expected_shape)}")
    if not y.is_floating_point():
        return StepObservation(False)
    if bool(torch.isinf(y).any()):
        raise inf_error(t)
    nan = torch.isnan(y)
    if not bool(nan.any()):
        return StepObservation(False)
    if bool(nan.all()) and y.numel() > 0:
        return StepObservation(True)
    return StepObservation(False, ~nan)


def check_observations(observations: Tensor | Sequence[Tensor | None], obs_dim: int, like: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A whole sequence for the Gaussian engines: validated, and its observed entries marked.

    Args:
        observations: ``(T, e)`` (or ``(T,)`` when ``e = 1``) with NaN for missing entries, or a
            sequence of ``T`` tensors ``(e,)`` or ``None``; ``T >= 1``.
        obs_dim: ``e``.
        like: a tensor of the model (its ``init_mean``): the observations must have its dtype and
            device, and a sequence's missing steps take them (otherwise the first tensor's).

    Returns:
        ``(observations (T, e), observed (T, e) bool)``.

    Raises:
        ValueError: wrong type or shape, no time step, a dtype or device other than ``like``'s, or
            an ``inf`` (:func:`inf_error`, naming the first time step with one).

    Example:
        >>> import torch
        >>> eye = torch.eye(2, dtype=torch.float64)
        >>> ys, observed = check_observations(
        ...     [torch.ones(2, dtype=torch.float64), None], 2, like=eye
        ... )
        >>> observed.tolist()
        [[True, True], [False, False]]
    """
    if not isinstance(observations, Tensor):
        observations = _stack_steps(observations, obs_dim, like)
    if observations.dim() == 1 and obs_dim == 1:
        observations = observations.unsqueeze(-1)
    if observations.dim() != 2 or observations.shape[-1] != obs_dim:
        raise ValueError(f"observations must have shape (T, {obs_dim}), got {tuple(observations.shape)}")
    if observations.shape[0] == 0:
        raise ValueError(f"observations must have at least one time step, got shape {tuple(observations.shape)}")
    if like is not None and (observations.dtype != like.dtype or observations.device != like.device):
        raise ValueError(
            f"observations have dtype {observations.dtype} on {observations.device}, but the model's tensors are {like.dtype} on "
            f"{like.device}: convert the data, observations.to({like.dtype}) (or .to(ssm.init_mean) for dtype and device)"
            + (f", or build the model in {observations.dtype}" if observations.is_floating_point() else "")
        )
    if observations.is_floating_point():
        row_status(observations)
    return observations, ~torch.isnan(observations)


def _stack_steps(observations: Any, obs_dim: int, like: Tensor | None) -> Tensor:
    """A sequence of ``(e,)`` tensors and ``None`` as one ``(T, e)`` tensor, NaN where ``None``."""
    if not isinstance(observations, Sequence):
        raise ValueError(f"observations must be a tensor of shape (T, {obs_dim}) or a sequence of tensors and None, got {type(observations).__name__}")
    ref = next((y for y in observations if isinstance(y, Tensor)), like)
    if ref is None:
        raise ValueError("observations: a sequence of only None needs like= for its dtype and device")
    missing = torch.full((obs_dim,), float("nan"), dtype=ref.dtype, device=ref.device)
    rows = []
    for t, y in enumerate(observations):
        if y is not None and not isinstance(y, Tensor):
            raise ValueError(f"observations[{t}] must be a tensor or None, got {type(y).__name__}")
        rows.append(missing if y is None else y.reshape(-1))
        if rows[-1].shape != missing.shape:
            raise ValueError(f"observations[{t}] must have shape ({obs_dim},), got {tuple(y.shape)}")
        if rows[-1].dtype != missing.dtype:
            raise ValueError(f"observations[{t}] has dtype {rows[-1].dtype}, the others {missing.dtype}: give every step one dtype")
    return torch.stack(rows) if rows else missing.new_zeros(0, obs_dim)
