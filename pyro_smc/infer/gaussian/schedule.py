r"""What an EP schedule is: the typed problem it iterates on, where it stops, and its fixed-point map.

A schedule (:class:`~pyro_smc.infer.gaussian.sequential.SequentialSchedule`,
:class:`~pyro_smc.infer.gaussian.parallel.ParallelSchedule`) has one public interface:

* ``iterate(problem, start)`` runs EP on an :class:`EPProblem` from the first sweep (or from a
  :class:`WarmStart`) until ``tol`` or ``max_iter`` and returns an :class:`EPRun`;
* ``fixed_point(problem, run)`` returns the :class:`FixedPointMap` ``theta -> F(theta)`` whose
  fixed point is the run's state, and the outputs recomputed from a state: what
  :class:`~pyro_smc.EPSmoother` differentiates implicitly
  (``docs/math/ep.md#the-gradient-of-the-ep-evidence``).

Example:
    >>> import torch
    >>> from pyro_smc.infer.gaussian.schedule import EPSettings
    >>> EPSettings(max_iter=10, damping=1.0, power=1.0, tol=1e-6).max_iter
    10
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from pyro_smc.infer.gaussian.observed import ObservationStatus
from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult

__all__ = ["EPProblem", "EPRun", "EPSettings", "FixedPointMap", "WarmStart"]


class EPSettings(NamedTuple):
    """The iteration's settings (see :class:`~pyro_smc.EPSmoother`).

    Attributes:
        max_iter: sweeps (or first sweep plus parallel iterations) at most.
        damping: ``gamma`` in ``(0, 1]``, from the second sweep on.
        power: ``alpha`` in ``(0, 1]`` of power EP, in every sweep (``docs/math/ep.md#power-ep``).
        tol: stop when no marginal's mean or covariance entry changed by more than this, in units
            of the marginal's spread (:func:`~pyro_smc.ops.gaussian.moment_change`).
        on_iteration: called with each sweep's (or iteration's)
            :class:`~pyro_smc.infer.gaussian.result.EPIteration` as it is recorded: the
            smoother's progress bar and log.

    Example:
        >>> EPSettings(5, 0.5, 1.0, 1e-4).damping
        0.5
    """

    max_iter: int
    damping: float
    power: float
    tol: float
    on_iteration: Callable[[EPIteration], None] | None = None

    def record(self, history: list[EPIteration], iteration: EPIteration) -> None:
        """Appends ``iteration`` to ``history`` and reports it."""
        history.append(iteration)
        if self.on_iteration is not None:
            self.on_iteration(iteration)


class EPProblem(NamedTuple):
    """The observations EP runs on, checked.

    Attributes:
        ys: ``(T, e)`` observations, NaN where missing.
        observed: bool ``(T, e)``, the observed entries.
        status: ``T`` :class:`~pyro_smc.infer.gaussian.observed.ObservationStatus`.

    Example:
        >>> import torch
        >>> from pyro_smc.infer.gaussian.observed import observation_status
        >>> ys = torch.zeros(2, 1)
        >>> EPProblem(ys, ~ys.isnan(), observation_status(ys)).status[0].name
        'OBSERVED'
    """

    ys: Tensor
    observed: Tensor
    status: list[ObservationStatus]


class WarmStart(NamedTuple):
    """Where an earlier run stopped, detached (from its :class:`~pyro_smc.infer.gaussian.result.EPState`).

    Attributes:
        theta: ``(n,)`` the schedule's state.
        means: ``(T, d)`` the marginals' means there.
        covariances: ``(T, d, d)``.

    Example:
        >>> import torch
        >>> WarmStart(torch.zeros(4), torch.zeros(2, 1), torch.ones(2, 1, 1)).theta.shape
        torch.Size([4])
    """

    theta: Tensor
    means: Tensor
    covariances: Tensor


class EPRun(NamedTuple):
    """Where a schedule's iteration stopped.

    Attributes:
        theta: ``(n,)`` the state of the iteration (the sequential schedule's site messages, the
            parallel one's cavities), natural parameters flattened.
        means: ``(T, d)`` the last marginals.
        covariances: ``(T, d, d)``.
        increments: ``(T,)`` the EP evidence's terms of the last sweep.
        history: one :class:`~pyro_smc.infer.gaussian.result.EPIteration` per sweep.
        first_sweep: the first sweep's marginals (``None`` after a warm start).
        converged: whether the iteration stopped on ``tol``.
        damping: the damping the iteration ended with (the parallel schedule adapts it).
        fits: the sequential schedule's last fitted factors, ``(measurements, transitions)``
            of :class:`~pyro_smc.infer.gaussian.factors.LinearFit`; ``None`` for the parallel one.

    Example:
        >>> import torch
        >>> run = EPRun(
        ...     torch.zeros(1),
        ...     torch.zeros(2, 1),
        ...     torch.ones(2, 1, 1),
        ...     torch.zeros(2),
        ...     [],
        ...     None,
        ...     True,
        ...     1.0,
        ... )
        >>> run.converged, run.fits is None
        (True, True)
    """

    theta: Tensor
    means: Tensor
    covariances: Tensor
    increments: Tensor
    history: list[EPIteration]
    first_sweep: GaussianSmootherResult | None
    converged: bool
    damping: float
    fits: tuple | None = None


class FixedPointMap(NamedTuple):
    """A schedule's iteration as a map, for the implicit gradient at its fixed point.

    Attributes:
        step: ``theta -> F(theta)``, one sweep (or parallel iteration) with the graph; it appends
            to ``skipped`` the number of updates it skipped.
        outputs: ``z -> (means, covariances, increments)`` recomputed from the state ``z``.
        skipped: the updates each call of ``step`` skipped (a skipped update is the identity
            map, not the fixed-point equation).

    Example:
        >>> import torch
        >>> fp = FixedPointMap(lambda theta: theta / 2, lambda z: (z, z, z), [])
        >>> fp.step(torch.ones(2)).tolist()
        [0.5, 0.5]
    """

    step: Callable[[Tensor], Tensor]
    outputs: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]
    skipped: list[int]
