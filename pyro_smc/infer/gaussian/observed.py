r"""What each time step's observation gives the Gaussian engines to condition on.

The rule itself (missing, partly missing, ``inf``) is ``pyro_smc.observations``'s
``pyro_smc.observations.row_status``, the one every engine uses; this module names its
outcome per step for the Gaussian filters, smoothers and EP, and restricts a projection's moments
to the observed entries of a partly missing step (the exact Gaussian marginal of those entries).

Example:
    >>> import math, torch
    >>> from pyro_smc.infer.gaussian.observed import observation_status
    >>> [
    ...     s.name
    ...     for s in observation_status(
    ...         torch.tensor([[1.0, 2.0], [math.nan, math.nan], [math.nan, 3.0]])
    ...     )
    ... ]
    ['OBSERVED', 'MISSING', 'PARTLY_OBSERVED']
"""

from __future__ import annotations

import enum

from torch import Tensor

from pyro_smc.observations import row_status

__all__ = ["ObservationStatus", "observation_status", "observed_moments"]


class ObservationStatus(enum.IntEnum):
    """How much of a step's observation there is (``pyro_smc.observations.row_status``).

    Example:
        >>> (
        ...     ObservationStatus.PARTLY_OBSERVED < ObservationStatus.OBSERVED,
        ...     bool(ObservationStatus.MISSING),
        ... )
        (True, False)
    """

    MISSING = 0  #: all NaN (or ``None``), so predict only, no measurement message
    PARTLY_OBSERVED = 1  #: some entries NaN, so condition on the observed ones
    OBSERVED = 2  #: every entry observed


def observation_status(observations: Tensor) -> list[ObservationStatus]:
    """The status of every step of ``observations`` ``(T, e)`` (NaN entries missing), for the
    whole sequence at once (not one host sync per step).

    Args:
        observations: ``(T, e)`` floating, as ``pyro_smc.observations.check_observations``
            returns them.

    Returns:
        ``T`` :class:`ObservationStatus` values.

    Raises:
        ValueError: an entry is ``inf`` (``pyro_smc.observations.inf_error``).

    Example:
        >>> import torch
        >>> observation_status(torch.zeros(2, 1))
        [<ObservationStatus.OBSERVED: 2>, <ObservationStatus.OBSERVED: 2>]
    """
    rows = row_status(observations)
    codes = (~rows.missing).int() + (~rows.missing & ~rows.partly).int()
    return [ObservationStatus(code) for code in codes.tolist()]


def observed_moments(y: Tensor, observed: Tensor, mu: Tensor, S: Tensor, C: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The observed entries of ``y`` and the moments of ``(y, x)`` restricted to them: the exact
    Gaussian marginal of the observed entries.

    Args:
        y: ``(e,)``.
        observed: bool ``(e,)``.
        mu: ``(e,)`` the projected mean of ``y``.
        S: ``(e, e)`` its covariance.
        C: ``(d, e)`` the state-observation covariance.

    Returns:
        ``(y (k,), mu (k,), S (k, k), C (d, k))`` for the ``k`` observed entries.

    Example:
        >>> import torch
        >>> y, mu, S, C = observed_moments(
        ...     torch.tensor([1.0, 2.0]),
        ...     torch.tensor([False, True]),
        ...     torch.zeros(2),
        ...     torch.eye(2),
        ...     torch.ones(3, 2),
        ... )
        >>> y.tolist(), S.shape, C.shape
        ([2.0], torch.Size([1, 1]), torch.Size([3, 1]))
    """
    idx = observed.nonzero().squeeze(-1)
    return y[idx], mu[idx], S[idx][:, idx], C[:, idx]
