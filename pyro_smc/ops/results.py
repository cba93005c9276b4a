r"""The typed results of pyro_smc's engines: plain containers of tensors.

Conventions every result type here keeps:

* ``T`` time steps, state dimension ``d``; marginals are ``means (T, d)`` and
  ``covariances (T, d, d)``, on the device and dtype of the model.
* ``log_evidence`` is the one name for the (estimated) total ``log p(y_{1:T})``: a tensor, or
  ``None`` where the engine does not compute it. What it means depends on the engine:

  - Kalman filter (:class:`FilterResult`): exact.
  - Gaussian filters and smoothers (EKF/EKS, UKF/URTSS, GP-ADF/GP-RTSS,
    :class:`GaussianSmootherResult`): the Gaussian approximation given by the prediction-error
    decomposition, ``sum_t log N(y_t | mu_t, S_t)`` with the projected predictive moments.
  - EP: the exact evidence of the linear-Gaussian model fitted by the last sweep's projections
    (``docs/math/ep.md#the-ep-evidence``).
  - SMC: an estimate whose exponential is unbiased for the evidence ``Z``.
  - The online variational filter: an ELBO, a lower bound.

* ``log_evidence_increments`` ``(T,)`` (batch dims after ``T`` where the model carries them) are the
  per-step terms ``log p(y_t | y_{1:t-1})`` whose sum is ``log_evidence``, where they exist; a step
  without an observation contributes 0.
* Old names stay as properties that emit a ``FutureWarning`` naming the new one.

The Gaussian side (:class:`FilterResult`, :class:`SmootherResult`, :class:`GaussianSmootherResult`)
comes from functions; the engines that are objects stepping through a stream (``SMC``, the online
filter) keep their running state as attributes and hand out a snapshot of it as
:class:`SMCResult` / :class:`OnlineFilterResult` from their ``result`` property.

Example:
    >>> import torch
    >>> from pyro_smc.ops.results import FilterResult
    >>> z = torch.zeros(3, 1, dtype=torch.float64)
    >>> out = FilterResult(z, z[..., None], z, z[..., None], torch.full((3,), -1.0, dtype=torch.float64))
    >>> out.log_evidence.item()
    -3.0
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional

from torch import Tensor

__all__ = ["EPIteration", "EPState", "FilterResult", "GaussianSmootherResult", "OnlineFilterResult", "SMCResult", "SmootherResult"]


def _renamed(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=3)


class FilterResult(NamedTuple):
    """Kalman filtering output.

    Attributes:
        means: ``(T, d)`` ``E[x_t | y_{1:t}]``.
        covariances: ``(T, d, d)``.
        predicted_means: ``(T, d)`` ``E[x_t | y_{1:t-1}]`` (the prior at ``t = 0``).
        predicted_covariances: ``(T, d, d)``.
        log_evidence_increments: ``(T,)`` ``log p(y_t | y_{1:t-1})``; 0 at steps without data.

    Example:
        >>> import torch
        >>> z = torch.zeros(3, 1)
        >>> out = FilterResult(z, z[..., None], z, z[..., None], torch.tensor([-1.0, -0.5, 0.0]))
        >>> out.means.shape, float(out.log_evidence)
        (torch.Size([3, 1]), -1.5)
    """

    means: Tensor
    covariances: Tensor
    predicted_means: Tensor
    predicted_covariances: Tensor
    log_evidence_increments: Tensor

    @property
    def log_evidence(self) -> Tensor:
        """Exact ``log p(y_{1:T})``, the sum of the increments over time."""
        return self.log_evidence_increments.sum(0)

    @property
    def log_likelihoods(self) -> Tensor:
        """Deprecated name of :attr:`log_evidence_increments`."""
        _renamed("FilterResult.log_likelihoods", "FilterResult.log_evidence_increments")
        return self.log_evidence_increments


class SmootherResult(NamedTuple):
    """RTS smoothing output: the marginals ``p(x_t | y_{1:T})`` and the filter's evidence.

    Attributes:
        means: ``(T, d)`` ``E[x_t | y_{1:T}]``.
        covariances: ``(T, d, d)``.
        log_evidence: scalar, the filter's exact ``log p(y_{1:T})``; ``None`` when built without one.

    Example:
        >>> import torch
        >>> out = SmootherResult(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2))
        >>> out.covariances.shape, out.log_evidence is None
        (torch.Size([4, 2, 2]), True)
    """

    means: Tensor
    covariances: Tensor
    log_evidence: Tensor | None = None


class EPIteration(NamedTuple):
    """One EP sweep.

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

    def __getitem__(self, key):
        # The history used to be a list of dicts: h["change"] keeps working, with a warning.
        if isinstance(key, str):
            _renamed(f'history[k]["{key}"]', f"history[k].{key}")
            return getattr(self, key)
        return tuple.__getitem__(self, key)


class EPState(NamedTuple):
    """Where an EP run stopped, detached: what ``EPSmoother.smooth(..., init=result)`` starts from.

    Attributes:
        schedule: ``"sequential"`` (``theta`` holds the site messages) or ``"parallel"`` (the
            cavities).
        theta: ``(n,)`` the iteration's state, natural parameters flattened.
        steps: per time step, 0 (no data), 1 (partly observed) or 2 (fully observed): a warm
            start needs the same pattern of missing data.

    Example:
        >>> import torch
        >>> EPState("parallel", torch.zeros(3), (2, 0, 2)).steps
        (2, 0, 2)
    """

    schedule: str
    theta: Tensor
    steps: tuple


@dataclass
class GaussianSmootherResult:
    """Gaussian marginals ``q(x_t)`` of a Gaussian filter, smoother or EP run.

    Attributes:
        means: ``(T, d)``.
        covariances: ``(T, d, d)``.
        first_sweep: for EP, the result of the first forward-backward sweep (the plain Gaussian
            smoother); ``None`` otherwise.
        history: for EP, one :class:`EPIteration` per sweep; empty otherwise.
        converged: whether EP stopped on ``tol`` (always ``True`` for filters and smoothers).
        log_evidence: the prediction-error decomposition of ``log p(y_{1:T})`` under the filter's
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

    @property
    def log_likelihood(self) -> Tensor | None:
        """Deprecated name of ``log_evidence``."""
        _renamed("GaussianSmootherResult.log_likelihood", "GaussianSmootherResult.log_evidence")
        return self.log_evidence


class SMCResult(NamedTuple):
    """A snapshot of a particle filter run over ``T`` steps with ``B`` independent filters.

    The tensors keep their autograd graph (``log_evidence`` and the means are differentiable under a
    differentiable resampler); ``ess`` and the flags are detached diagnostics.

    Attributes:
        log_evidence: ``(B,)`` ``log Z_hat``; ``exp(log_evidence)`` is unbiased for the evidence.
        log_evidence_increments: ``(T, B)`` ``log p_hat(y_t | y_{1:t-1})`` per step (an ``init``
            that scores sites adds its term to the first step); 0 at a predict-only step.
        filtering_means: ``{key: (T, B, *event)}`` weighted means of each state entry (labels
            included), taken before resampling.
        ess: ``(T, B)`` effective sample size after each step's reweighting, in ``[1, N]``.
        resampled: ``(T, B)`` bool, whether each filter resampled at each step.
        resampler_converged: ``(T, B)`` bool: whether the resampler's inner solve (Sinkhorn for
            optimal-transport resampling) converged at each step; ``True`` where nothing was
            solved. ``None`` for resamplers that solve nothing.

    Example:
        >>> import torch
        >>> T, B = 3, 2
        >>> inc = torch.full((T, B), -0.5)
        >>> out = SMCResult(inc.sum(0), inc, {"x": torch.zeros(T, B)}, torch.full((T, B), 10.0), torch.zeros(T, B, dtype=torch.bool))
        >>> out.log_evidence.tolist(), out.resampler_converged is None
        ([-1.5, -1.5], True)
    """

    log_evidence: Tensor
    log_evidence_increments: Tensor
    filtering_means: dict
    ess: Tensor
    resampled: Tensor
    resampler_converged: Optional[Tensor] = None


class OnlineFilterResult(NamedTuple):
    """A snapshot of a streaming variational filter after ``T`` steps, state dimension ``d``.

    Attributes:
        log_evidence: scalar, the running ELBO: a Monte Carlo estimate of a lower bound on
            ``log p(y_{1:T})``.
        log_evidence_increments: ``(T,)`` its per-step terms.
        means: ``(T, d)`` means of the filtering marginals ``q_t(x_t)``.
        covariances: ``(T, d, d)`` their covariances.
        log_evidence_standard_error: scalar, the Monte Carlo standard error of ``log_evidence``
            (``None`` when not known).

    Example:
        >>> import torch
        >>> inc = torch.tensor([-1.0, -2.0])
        >>> out = OnlineFilterResult(inc.sum(), inc, torch.zeros(2, 3), torch.eye(3).expand(2, 3, 3))
        >>> float(out.log_evidence), out.means.shape
        (-3.0, torch.Size([2, 3]))
    """

    log_evidence: Tensor
    log_evidence_increments: Tensor
    means: Tensor
    covariances: Tensor
    log_evidence_standard_error: Optional[Tensor] = None
