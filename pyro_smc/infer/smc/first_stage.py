r"""The start-of-step resampling of the auxiliary and quasi-Monte Carlo filters.

See ``docs/math/smc.md#auxiliary-particle-filter`` and
``docs/math/smc.md#sequential-quasi-monte-carlo``. Under ``SMC(auxiliary=True)`` or
``SMC(qmc=True)`` a step resamples *before* it moves the particles, where the default filter
resamples after it weighs them: the auxiliary filter needs the coming observation to choose the
ancestors, SQMC needs the ancestor and the move to share one QMC point. With auxiliary log-weights
:math:`\log \eta^i` (zero without a look-ahead) the first stage is

.. math::

    \log \tilde w^i = \log w_{t-1}^i + \log \eta^i - L_1, \qquad L_1 = \log \sum_i w_{t-1}^i \eta^i,

the filters whose ESS of :math:`\tilde w` is below ``ess_threshold * N`` (all of them under SQMC)
draw ancestors :math:`A^n` from :math:`\tilde w`, and their new log-weights are
:math:`\log \bar w^n = r^n - \log \eta^{A^n}` normalised (:math:`r^n` the resampler's new
log-weight, :math:`-\log N` in value), the normaliser plus :math:`L_1` joining the step's
evidence increment. The step's weighing then multiplies by the incremental weight as usual, so
its increment is :math:`\log \hat p(y_t \mid y_{1:t-1}) = L_1 + \log \sum_n \tfrac1N \omega^n / \eta^{A^n}`,
whose exponential is unbiased. A filter that does not resample keeps :math:`w_{t-1}` as it is.

Example:
    >>> import torch
    >>> from pyro_smc.infer.smc.importance import ParticleLayout
    >>> from pyro_smc.infer.smc.state import ParticleWeights, SMCState
    >>> from pyro_smc.resamplers import SystematicResampler
    >>> layout = ParticleLayout(num_filters=1, num_particles=4, max_plate_nesting=0)
    >>> state = SMCState()
    >>> state.replace({"x": torch.arange(4.0)})
    >>> weights = ParticleWeights.uniform(1, 4, torch.zeros(()))
    >>> eta = torch.tensor([[0.0, 0.0, 0.0, -float("inf")]])  # 3 cannot explain y_t
    >>> out = resample_first(
    ...     state, weights, eta, layout, SystematicResampler(), 1.0, set(), "step 0"
    ... )
    >>> bool(out.need[0]), 3.0 in state["x"].tolist()
    (True, False)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.smc import auxiliary, smoothing
from pyro_smc.infer.smc.importance import ParticleLayout
from pyro_smc.infer.smc.qmc import InverseCDFDraws
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.infer.smc.step import Resampling, StepInputs, maybe_resample
from pyro_smc.ops.hilbert import hilbert_order
from pyro_smc.ops.qmc import qmc_resample, sobol_points
from pyro_smc.ops.resample import stop_gradient_log_weights
from pyro_smc.ops.weights import ess_of_weights
from pyro_smc.resamplers.base import flatten_floats, gather

__all__ = ["FirstStage", "resample_first", "resample_qmc", "run"]


class FirstStage(NamedTuple):
    """What a first stage did.

    Attributes:
        weights: the weights the step starts from (the normaliser in their unreported evidence).
        need: bool ``(B,)``, the filters that resampled.
        resampling: the ancestors (of the filters in ``need``) and the solver's convergence, or
            ``None`` when no filter resampled.
        moves: ``(B, N, D)`` the QMC coordinates left for the move (SQMC only), else ``None``.
    """

    weights: ParticleWeights
    need: Tensor
    resampling: Resampling | None
    moves: Tensor | None = None


def _auxiliary(log_weights: Tensor, log_eta: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The first-stage weights :math:`\\tilde w` and :math:`L_1` (``None`` without a look-ahead)."""
    if log_eta is None:
        return log_weights, None
    joint = log_weights + log_eta
    log_norm = torch.logsumexp(joint, -1)
    if not bool(torch.isfinite(log_norm.detach()).all()):
        raise ValueError("look_ahead gave log-weight -inf to every particle of a filter with positive weight: no particle can be resampled")
    return joint - log_norm.unsqueeze(-1), log_norm


def _second_stage(
    weights: ParticleWeights, new_log_w: Tensor, need: Tensor, log_eta_a: Tensor | None, log_norm: Tensor | None, active: Tensor | None
) -> ParticleWeights:
    """The weights after the resampling of the filters ``need``: divided by the ancestors'
    :math:`\\eta`, normalised, the normaliser and :math:`L_1` into the evidence."""
    if log_eta_a is None:
        return weights._replace(log_weights=torch.where(need.unsqueeze(-1), new_log_w, weights.log_weights))
    divided = new_log_w - log_eta_a
    second = torch.logsumexp(divided, -1)
    log_w = torch.where(need.unsqueeze(-1), divided - second.unsqueeze(-1), weights.log_weights)
    gain = torch.where(need, log_norm + second, torch.zeros_like(second))
    if active is not None:
        # A filter that observes nothing has eta = 1; exactly zero in value keeps its evidence.
        gain = torch.where(active, gain, gain - gain.detach())
    return weights.gain(log_w, gain)


def resample_first(
    state: SMCState,
    weights: ParticleWeights,
    log_eta: Tensor | None,
    layout: ParticleLayout,
    resampler: Callable,
    ess_threshold: float,
    discrete_keys: set[str],
    where: str,
    recompute: Callable[[], Tensor] | None = None,
    active: Tensor | None = None,
    report=None,
) -> FirstStage:
    """The auxiliary filter's first stage with the engine's resampler (module docstring).

    Args:
        state: the particles of the previous step; resampled filters are written into it.
        weights: their normalised weights.
        log_eta: ``(B, N)`` auxiliary log-weights, or ``None`` (no look-ahead at this step).
        layout: the particle dims.
        resampler: the engine's resampler.
        ess_threshold: resample the filters whose first-stage ESS is below ``ess_threshold * N``.
        discrete_keys: state keys holding labels (copied, never averaged).
        where: the step, for messages.
        recompute: the look-ahead at the resampled particles, for a resampler that moves
            particles instead of copying them (no ancestors).
        active: bool ``(B,)``, the filters that observe at this step (``None``: all).
        report: the run's convergence report, if any.
    """
    aux, log_norm = _auxiliary(weights.log_weights, log_eta)
    need = ess_of_weights(aux.detach().exp()) < ess_threshold * layout.num_particles
    if not state or not bool(need.any()):
        return FirstStage(weights, need, None)
    new, resampling = maybe_resample(state, weights._replace(log_weights=aux), need, resampler, discrete_keys, layout, where, None, report)
    log_eta_a = None
    if log_eta is not None:
        if resampling.ancestors is not None:
            rows = need.nonzero().squeeze(-1)
            log_eta_a = log_eta.index_put((rows,), log_eta[rows].gather(-1, resampling.ancestors.reshape(-1, layout.num_particles)))
        else:
            # Moved particles have no ancestor: their eta is the look-ahead at their new place.
            log_eta_a = recompute()
    return FirstStage(_second_stage(weights, new.log_weights, need, log_eta_a, log_norm, active), need, resampling)


def resample_qmc(
    state: SMCState,
    weights: ParticleWeights,
    log_eta: Tensor | None,
    layout: ParticleLayout,
    points: Tensor,
    stop_gradient: bool,
    active: Tensor | None = None,
) -> FirstStage:
    """SQMC's first stage: every filter resampled along the Hilbert curve by the points' first
    coordinate (:func:`~pyro_smc.ops.qmc.qmc_resample`).

    Args:
        state: the particles of the previous step; replaced by their resampled copies.
        weights: their normalised weights.
        log_eta: ``(B, N)`` auxiliary log-weights, or ``None``.
        layout: the particle dims.
        points: ``(B, N, 1 + D)`` the step's QMC points.
        stop_gradient: new log-weights by the stop-gradient rule (else ``-log N``, no gradient).
        active: bool ``(B,)``, the filters that observe at this step (``None``: all).
    """
    aux, log_norm = _auxiliary(weights.log_weights, log_eta)
    particles = {key: layout.batched_particles(value) for key, value in state.items()}
    cloud, _ = flatten_floats(particles, aux)
    if cloud.shape[-1] == 0:
        order = torch.arange(layout.num_particles, device=aux.device).expand(aux.shape)
    else:
        order = hilbert_order(cloud.detach())
    ancestors, moves = qmc_resample(aux.detach(), order, points)
    new = gather(particles, ancestors)
    state.replace({key: value.squeeze(0) if layout.num_filters == 1 else value for key, value in new.items()})
    if stop_gradient:
        new_log_w = stop_gradient_log_weights(aux, ancestors)
    else:
        new_log_w = torch.full_like(aux, -math.log(layout.num_particles))
    need = torch.ones(layout.num_filters, dtype=torch.bool, device=aux.device)
    log_eta_a = None if log_eta is None else log_eta.gather(-1, ancestors)
    return FirstStage(_second_stage(weights, new_log_w, need, log_eta_a, log_norm, active), need, Resampling(ancestors, None), moves)


def run(smc, inputs: StepInputs) -> InverseCDFDraws | None:
    """The first stage of ``smc`` (an :class:`~pyro_smc.SMC` with ``auxiliary`` or ``qmc``) at
    the step ``inputs``: its weights and particles updated, the resampling written into the
    previous step's record (the resampling of the particles that step weighed) and history.

    Returns:
        SQMC's draws for the step's move, else ``None``.
    """
    layout, program = smc._layout, smc._program
    scored = not inputs.predict_only and inputs.observed is None

    def look_ahead() -> Tensor:
        log_eta = auxiliary.evaluate(program, smc._look_ahead, smc.state, inputs)
        if inputs.active is not None:
            log_eta = torch.where(inputs.active.unsqueeze(-1), log_eta, torch.zeros_like(log_eta))
        return log_eta.to(smc._weights.log_weights.dtype)

    # A step that scores nothing (a missing observation) has eta = 1.
    log_eta = look_ahead() if smc._look_ahead is not None and scored else None
    draws = None
    if smc.qmc:
        like = smc._weights.log_weights
        dims = smc._qmc_dims.get("step", flatten_floats(dict(smc.state), torch.zeros(layout.particle_shape, dtype=like.dtype, device=like.device))[0].shape[-1])
        points = sobol_points(layout.num_particles, 1 + dims, layout.num_filters, like)
        out = resample_qmc(smc.state, smc._weights, log_eta, layout, points, smc.score_function, inputs.active)
        draws = InverseCDFDraws(out.moves, layout, inputs.where)
    else:
        out = resample_first(
            smc.state,
            smc._weights,
            log_eta,
            layout,
            smc.resampler,
            smc.ess_threshold,
            smc._checks.discrete_keys,
            inputs.where,
            look_ahead,
            inputs.active,
            smc._report,
        )
    smc._weights = out.weights
    if out.resampling is None:
        return draws
    if smc._records:
        ancestors = out.resampling.ancestors if smc.store_history else None
        smc._records[-1] = smc._records[-1]._replace(resampled=out.need, ancestors=ancestors, resampler_converged=out.resampling.converged)
    if smc._history:
        smoothing.record_resampling(smc._history[-1], out.need, out.resampling.ancestors, layout)
    return draws
