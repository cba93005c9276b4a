r"""What :class:`~pyro_smc.infer.smc2.SMC2` records: one :class:`SMC2StepRecord` per time step,
stacked into an :class:`SMC2Result`.

A step's record holds the step's evidence increment
:math:`\log \hat p(y_t \mid y_{1:t-1})`, the effective sample size of the parameter particles
after the step's reweighting, whether the step rejuvenated them (resample-move) and, if it did,
the acceptance rate of each of its Metropolis-Hastings moves.

Example:
    >>> import torch
    >>> records = [
    ...     SMC2StepRecord(torch.tensor(-1.0), torch.tensor(90.0), False, (), 50),
    ...     SMC2StepRecord(torch.tensor(-0.5), torch.tensor(40.0), True, (0.5, 0.25), 100),
    ... ]
    >>> out = SMC2Result.stack(records, torch.tensor(-1.5))
    >>> out.log_evidence_increments.tolist(), out.rejuvenated.tolist()
    ([-1.0, -0.5], [False, True])
    >>> out.acceptance_rates.tolist()  # mean over a step's moves; NaN where none ran
    [nan, 0.375]
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = ["SMC2Result", "SMC2StepRecord"]


class SMC2StepRecord(NamedTuple):
    r"""One step of :class:`~pyro_smc.infer.smc2.SMC2`.

    Attributes:
        log_evidence_increment: ``()``, :math:`\log \hat p(y_t \mid y_{1:t-1})`.
        ess: ``()``, the parameter particles' effective sample size after the reweighting, in
            ``[1, N_theta]``.
        rejuvenated: whether the parameter particles were resampled and moved at this step.
        acceptance_rates: the fraction of particles whose move was accepted, one entry per
            Metropolis-Hastings move of the rejuvenation (empty without one).
        num_particles: :math:`N_x` at the end of the step (an exchange step doubles it).
    """

    log_evidence_increment: Tensor
    ess: Tensor
    rejuvenated: bool
    acceptance_rates: tuple[float, ...]
    num_particles: int


class SMC2Result(NamedTuple):
    r"""The records of an :class:`~pyro_smc.infer.smc2.SMC2` run, stacked over its ``T`` steps.

    Attributes:
        log_evidence: ``()``, the estimate of :math:`\log p(y_{1:T})`.
        log_evidence_increments: ``(T,)``, summing to ``log_evidence``.
        ess: ``(T,)``, the parameter particles' ESS after each step's reweighting.
        rejuvenated: ``(T,)`` bool, the steps that resampled and moved the parameter particles.
        acceptance_rates: ``(T,)``, the mean acceptance rate of a step's moves (NaN without one).
        move_acceptance_rates: every move's acceptance rate, in order, one tuple per step.
        num_particles: ``(T,)`` int64, :math:`N_x` at the end of each step.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro.nn import PyroModule, PyroSample
        >>> from pyro_smc import SMC2
        >>> class AR1(PyroModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
        ...     def init(self, state):
        ...         state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))
        ...     def step(self, state, y=None):
        ...         x = pyro.sample("x", dist.Normal(self.rho * state["x"], 1.0))
        ...         state["x"] = x
        ...         pyro.sample("y", dist.Normal(x, 0.5), obs=y)
        >>> smc2 = SMC2(AR1(), num_parameter_particles=20, num_particles=10)
        >>> result = smc2.run(torch.randn(5)).result
        >>> result.log_evidence_increments.shape, result.ess.shape
        (torch.Size([5]), torch.Size([5]))
        >>> bool(torch.isclose(result.log_evidence_increments.sum(), result.log_evidence))
        True
    """

    log_evidence: Tensor
    log_evidence_increments: Tensor
    ess: Tensor
    rejuvenated: Tensor
    acceptance_rates: Tensor
    move_acceptance_rates: tuple[tuple[float, ...], ...]
    num_particles: Tensor

    @classmethod
    def stack(cls, records: Sequence[SMC2StepRecord], log_evidence: Tensor) -> SMC2Result:
        """Stacks ``records`` (at least one) in order, beside the run's ``log_evidence``."""
        like = log_evidence
        rates = [sum(r.acceptance_rates) / len(r.acceptance_rates) if r.acceptance_rates else math.nan for r in records]
        return cls(
            log_evidence,
            torch.stack([r.log_evidence_increment for r in records]),
            torch.stack([r.ess for r in records]),
            torch.tensor([r.rejuvenated for r in records], device=like.device),
            torch.tensor(rates, dtype=like.dtype, device=like.device),
            tuple(r.acceptance_rates for r in records),
            torch.tensor([r.num_particles for r in records], device=like.device),
        )
