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

__all__ = ["all_finite", "check_log_weights", "normalize", "ess", "ess_of_weights", "log_mean_exp"]


def all_finite(values: Tensor) -> bool:
    """Whether every entry of ``values`` is finite, with one cheap reduction and one host read.

    ``torch.isfinite`` is several kernels on the CPU; on the hot path of a filter the sum is
    enough: it is finite exactly when every entry is, unless finite entries overflow, in which case
    the exact check decides.

    Args:
        values: any shape.

    Returns:
        ``bool``: ``True`` for an empty tensor.

    Example:
        >>> (
        ...     all_finite(torch.tensor([3e38, 3e38])),
        ...     all_finite(torch.tensor([0.0, float("nan")])),
        ... )
        (True, False)
    """
    if values.numel() == 0:
        return True
    if math.isfinite(values.detach().sum().item()):
        return True
    return bool(torch.isfinite(values).all())


def check_log_weights(log_weights: Tensor, name: str = "log_weights") -> None:
    """Validates log-weights: ``N >= 1``, no NaN or ``+inf``, a finite entry in every row.

    An all ``-inf`` row has no normalisation, so it is an error too.

    Args:
        log_weights: ``(..., N)``.
        name: argument name for the message.

    Returns:
        ``None``.

    Raises:
        ValueError: if ``log_weights`` is not a tensor of shape ``(..., N)`` with ``N >= 1``, has a
            NaN or ``+inf``, or has a row that is all ``-inf``.

    Example:
        >>> check_log_weights(torch.tensor([0.0, -float("inf")]))
        >>> check_log_weights(torch.full((2, 3), -float("inf")), name="lw")
        Traceback (most recent call last):
            ...
        ValueError: lw has a row whose weights are all zero (all -inf)
    """
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

    Raises:
        ValueError: as :func:`check_log_weights`.

    Example:
        >>> log_w, log_sum = normalize(torch.tensor([1.0, 3.0]).log())
        >>> [round(v, 4) for v in log_w.exp().tolist()], round(float(log_sum.exp()), 4)
        ([0.25, 0.75], 4.0)
    """
    check_log_weights(log_weights)
    log_sum = torch.logsumexp(log_weights, dim=-1)
    return log_weights - log_sum.unsqueeze(-1), log_sum


def ess(log_weights: Tensor) -> Tensor:
    r"""Effective sample size :math:`1 / \sum_i w_i^2` of normalised log-weights.

    See ``docs/math/smc.md#effective-sample-size-and-adaptive-resampling``.

    Args:
        log_weights: normalised log-weights, shape ``(..., N)``.

    Returns:
        ESS in ``[1, N]``, shape ``(...)``.

    Example:
        >>> round(float(ess(torch.tensor([0.5, 0.5, 0.0, 0.0]).log())), 4)
        2.0
    """
    # Normalised log-weights are <= 0 and at least one is >= -log N, so the exponentials neither
    # overflow nor all underflow: no logsumexp needed.
    return ess_of_weights(torch.exp(log_weights))


def ess_of_weights(weights: Tensor) -> Tensor:
    """:func:`ess` from the weights ``exp(log_weights)`` ``(..., N)`` (a caller that has them).

    Example:
        >>> float(ess_of_weights(torch.tensor([0.5, 0.5, 0.0, 0.0])))
        2.0
    """
    # (sum w)^2 / sum w^2 equals 1 / sum w^2 for normalised weights, and is unchanged by a common
    # factor, so the rounding error of the normalisation (a shared offset of the log-weights,
    # about 1e-4 in float32 at |log w| ~ 2000) cancels.
    return weights.sum(-1).square() / weights.square().sum(-1)


def log_mean_exp(log_values: Tensor, dim: int = -1) -> Tensor:
    """``log(mean(exp(log_values)))`` along ``dim``, computed stably.

    Args:
        log_values: any shape with ``log_values.shape[dim] >= 1``.
        dim: the dimension to average over.

    Returns:
        ``log_values.shape`` without ``dim``.

    Example:
        >>> round(float(log_mean_exp(torch.tensor([1.0, 3.0]).log())), 4) == round(
        ...     float(torch.tensor(2.0).log()), 4
        ... )
        True
        >>> log_mean_exp(torch.zeros(4, 5), dim=0).shape
        torch.Size([5])
    """
    return torch.logsumexp(log_values, dim=dim) - math.log(log_values.shape[dim])

