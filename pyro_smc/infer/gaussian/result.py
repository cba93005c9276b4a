r"""The results of the Gaussian engines: the marginals of a Gaussian filter, smoother or EP run,
and the record of EP's iteration.

Marginals are ``means (T, d)`` and ``covariances (T, d, d)`` (filtering marginals for a filter,
smoothed ones for a smoother or EP), with ``log_evidence`` and its per-step terms
``log_evidence_increments (T,)`` as in :mod:`pyro_smc.ops.results`: for a filter or smoother the
prediction-error decomposition under its Gaussian approximation, for EP the exact evidence of the
linear-Gaussian model the last sweep's projections fitted (``docs/math/ep.md#the-ep-evidence``).
Every result is immutable.

Example:
    >>> import torch
    >>> from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult
    >>> out = GaussianSmootherResult(
    ...     torch.zeros(3, 1), torch.ones(3, 1, 1), history=(EPIteration(float("inf"), 0),)
    ... )
    >>> out.history[0].change, out.converged
    (inf, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from pyro_smc.infer.gaussian.observed import ObservationStatus

__all__ = ["EPIteration", "EPState", "GaussianSmootherResult"]


class EPIteration(NamedTuple):
    """One EP sweep (or, for the parallel schedule, one parallel iteration).

    Attributes:
        change: max abs change of the marginals' means and covariances (``inf`` on the first sweep).
        skipped: updates not applied because a cavity or the resulting marginal was not a proper
            Gaussian.

    Example:
        >>> sweep = EPIteration(change=0.01, skipped=0)
        >>> sweep.change, sweep.skipped
        (0.01, 0)
    """

    change: float
    skipped: int


class EPState(NamedTuple):
    """Where an EP run stopped, detached: what ``EPSmoother.smooth(..., init=result)`` starts from.

    Attributes:
        schedule: ``"sequential"`` (``theta`` holds the site messages) or ``"parallel"`` (the
            cavities).
        theta: ``(n,)`` the iteration's state, natural parameters flattened.
        steps: per time step, its :class:`~pyro_smc.infer.gaussian.observed.ObservationStatus`: a
            warm start needs the same pattern of missing data.

    Example:
        >>> import torch
        >>> from pyro_smc.infer.gaussian.observed import ObservationStatus as S
        >>> EPState("parallel", torch.zeros(3), (S.OBSERVED, S.MISSING, S.OBSERVED)).steps[
        ...     1
        ... ].name
        'MISSING'
    """

    schedule: str
    theta: Tensor
    steps: tuple[ObservationStatus, ...]


@dataclass(frozen=True)
class GaussianSmootherResult:
    r"""Gaussian marginals ``q(x_t)`` of a Gaussian filter, smoother or EP run.

    Attributes:
        means: ``(T, d)``.
        covariances: ``(T, d, d)``.
        first_sweep: for EP, the result of the first forward-backward sweep (the plain Gaussian
            smoother with ``power=1``); ``None`` otherwise.
        history: for EP, one :class:`EPIteration` per sweep; empty otherwise.
        converged: whether EP stopped on ``tol`` (always ``True`` for filters and smoothers).
        log_evidence: the prediction-error decomposition of :math:`\log p(y_{1:T})` under the filter's
            Gaussian approximation (filters and smoothers); for EP, the same decomposition on the
            linear-Gaussian model of the last sweep (``docs/math/ep.md#the-ep-evidence``).
        log_evidence_increments: ``(T,)`` its per-step terms.
        ep_state: for EP, where the iteration stopped (:class:`EPState`), to warm-start another
            run (``EPSmoother.smooth(ys, init=result)``); ``None`` otherwise.

    Example:
        >>> import torch
        >>> out = GaussianSmootherResult(torch.zeros(5, 2), torch.eye(2).expand(5, 2, 2))
        >>> out.means.shape, out.converged, out.history, out.log_evidence is None
        (torch.Size([5, 2]), True, (), True)
    """

    means: Tensor
    covariances: Tensor
    first_sweep: GaussianSmootherResult | None = None
    history: tuple[EPIteration, ...] = ()
    converged: bool = True
    log_evidence: Tensor | None = None
    log_evidence_increments: Tensor | None = None
    ep_state: EPState | None = None
