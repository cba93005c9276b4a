"""Importance weights in log space.

Every function works on the last dimension of ``log_weights`` (the particle dimension) and
broadcasts over any leading batch dimensions (independent filters).
See ``docs/math/smc.md#one-step-of-the-filter`` and ``docs/math/smc.md#effective-sample-size-and-adaptive-resampling``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.weights import normalize, ess
    >>> lw, log_norm = normalize(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    >>> float(ess(lw))
    4.0
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["all_finite", "check_log_weights", "normalize", "ess", "log_mean_exp"]


def all_finite(values: Tensor) -> bool:
    """Whether every entry of ``values`` is finite, with one cheap reduction and one host read.

    ``torch.isfinite`` is several kernels on the CPU; on the hot path of a filter the sum is
    enough: it is finite exactly when every entry is, unless finite entries overflow, in which case
    the exact check decides.
    """
    if values.numel() == 0:
        return True
    if math.isfinite(values.detach().sum().item()):
        return True
    return bool(torch.isfinite(values).all())


def check_log_weights(log_weights: Tensor, name: str = "log_weights") -> None:
    """Raises ``ValueError`` unless ``log_weights`` ``(..., N)`` has ``N >= 1`` entries, no NaN or
    ``+inf``, and at least one finite entry in every row (an all ``-inf`` row has no normalisation)."""
    if not isinstance(log_weights, Tensor) or log_weights.dim() == 0:
        raise ValueError(f"{name} must be a tensor of shape (..., N), got {tuple(getattr(log_weights, 'shape', ()))}")
    if log_weights.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one particle (last dim > 0)")
    lw = log_weights.detach()
    # A row's maximum is NaN if the row has a NaN, +inf if it has +inf and -inf if it is all -inf:
    # valid weights have a finite maximum in every row, which one reduction checks.
    if all_finite(lw.amax(-1)):
        return
    if bool(torch.isnan(lw).any()) or bool((lw == float("inf")).any()):
        raise ValueError(f"{name} contains NaN or +inf")
    if bool((lw == float("-inf")).all(-1).any()):
        raise ValueError(f"{name} has a row whose weights are all zero (all -inf)")


def normalize(log_weights: Tensor) -> tuple[Tensor, Tensor]:
    """Normalises log-weights over the last dimension.

    Args:
        log_weights: unnormalised log-weights, shape ``(..., N)``.

    Returns:
        ``(log_w, log_sum)``: normalised log-weights ``(..., N)`` with ``logsumexp(log_w) = 0``
        and ``log_sum = logsumexp(log_weights)`` of shape ``(...)``.
    """
    check_log_weights(log_weights)
    log_sum = torch.logsumexp(log_weights, dim=-1)
    return log_weights - log_sum.unsqueeze(-1), log_sum


def ess(log_weights: Tensor) -> Tensor:
    """Effective sample size ``1 / sum_i w_i^2`` of normalised log-weights.

    See ``docs/math/smc.md#effective-sample-size-and-adaptive-resampling``.

    Args:
        log_weights: normalised log-weights, shape ``(..., N)``.

    Returns:
        ESS in ``[1, N]``, shape ``(...)``.
    """
    # (sum w)^2 / sum w^2 equals 1 / sum w^2 for normalised weights, and is unchanged by a common
    # factor, so the rounding error of the normalisation (a shared offset of the log-weights,
    # about 1e-4 in float32 at |log w| ~ 2000) cancels. Normalised log-weights are <= 0 and at least
    # one is >= -log N, so the exponentials neither overflow nor all underflow: no logsumexp needed.
    w = torch.exp(log_weights)
    return w.sum(-1).square() / w.square().sum(-1)


def log_mean_exp(log_values: Tensor, dim: int = -1) -> Tensor:
    """``log(mean(exp(log_values)))`` along ``dim``, computed stably."""
    return torch.logsumexp(log_values, dim=dim) - math.log(log_values.shape[dim])
