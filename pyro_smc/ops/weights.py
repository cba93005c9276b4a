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

__all__ = ["check_log_weights", "normalize", "ess", "log_mean_exp"]


def check_log_weights(log_weights: Tensor, name: str = "log_weights") -> None:
    """Raises ``ValueError`` unless ``log_weights`` ``(..., N)`` has ``N >= 1`` entries, no NaN or
    ``+inf``, and at least one finite entry in every row (an all ``-inf`` row has no normalisation)."""
    if not isinstance(log_weights, Tensor) or log_weights.dim() == 0:
        raise ValueError(f"{name} must be a tensor of shape (..., N), got {tuple(getattr(log_weights, 'shape', ()))}")
    if log_weights.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one particle (last dim > 0)")
    lw = log_weights.detach()
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
    return torch.exp(-torch.logsumexp(2 * log_weights, dim=-1))


def log_mean_exp(log_values: Tensor, dim: int = -1) -> Tensor:
    """``log(mean(exp(log_values)))`` along ``dim``, computed stably."""
    return torch.logsumexp(log_values, dim=dim) - math.log(log_values.shape[dim])
