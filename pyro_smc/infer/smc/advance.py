"""One step of :class:`~pyro_smc.SMC`, strung together from its phases (:mod:`~pyro_smc.infer.smc.step`).

See ``docs/math/smc.md#one-step-of-the-filter``. :func:`advance` reads the particles and weights
the step starts from and returns what the step made as a :class:`StepOutcome`; the engine keeps
that and nothing else, so no step hands data to the next through attributes::

    proposal = program.propose(...)            # run the Pyro program (or its replay)
    terms, score = log-weight and score terms  # log omega, and the gradient estimator's terms
    weights = weigh(...)                       # log w_t, log p_hat(y_t | y_{1:t-1})
    means, ess = summarise(...)                # the step's record
    weights, resampling = maybe_resample(...)  # the filters whose ESS < ess_threshold * N
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes
from pyro_smc.infer.smc import smoothing
from pyro_smc.infer.smc.compiled import CompiledStep, Weighed
from pyro_smc.infer.smc.convergence import ConvergenceReport
from pyro_smc.infer.smc.replay import resample_every
from pyro_smc.infer.smc.checks import ESTIMATOR_OPTION, check_marginal_supported
from pyro_smc.infer.smc.importance import ParticleLayout, log_weight_terms, score_terms
from pyro_smc.infer.smc.result import StepRecord
from pyro_smc.infer.smc.scores import marginal_scores
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.infer.smc.step import StepInputs, StepProgram, maybe_resample, summarise, weigh
from pyro_smc.infer.smc.trace_checks import TraceChecks
from pyro_smc.ops.resample import resample_where
from pyro_smc.resamplers import GradientEstimator, estimator_of
from pyro_smc.resamplers.index import index_scheme

__all__ = ["StepOutcome", "StepSettings", "advance"]


class StepSettings(NamedTuple):
    """The engine's settings a step reads.

    Attributes:
        layout: the particle dims.
        resampler: the resampler (its :class:`~pyro_smc.resamplers.GradientEstimator` picks the
            gradient estimator).
        ess_threshold: resample a filter when its ESS falls below ``ess_threshold * N``.
        store_history: keep what :meth:`~pyro_smc.SMC.smooth` needs.
        compiled: the run's :class:`~pyro_smc.infer.smc.compiled.CompiledStep`, or ``None``.
        report: within ``SMC.run``, the run's
            :class:`~pyro_smc.infer.smc.convergence.ConvergenceReport` (``None``: every
            unconverged solve warns at its step).
        deferred: the resampling happens at the start of the next step (the auxiliary and
            quasi-Monte Carlo filters, :mod:`~pyro_smc.infer.smc.first_stage`), not after the
            weighing.
        draws: a handler that sets the step's latent draws (SQMC), or ``None``.
    """

    layout: ParticleLayout
    resampler: Callable
    ess_threshold: float
    store_history: bool
    compiled: CompiledStep | None = None
    report: ConvergenceReport | None = None
    deferred: bool = False
    draws: Any = None

    @property
    def estimator(self) -> GradientEstimator:
        return estimator_of(self.resampler)


class StepOutcome(NamedTuple):
    """What one step made.

    Attributes:
        weights: the new weights; ``None`` while there is nothing to weigh (no weights, no state).
        ess: ``(B,)`` the ESS after the reweighting (``None`` with ``weights``).
        weighted: the particles and log-weights after the reweighting, before any resampling.
        record: the step's :class:`~pyro_smc.infer.smc.result.StepRecord` (``None`` at ``init``,
            whose evidence term joins step 0's increment).
        history: the step's smoothing record (``store_history`` only).
    """

    weights: ParticleWeights | None
    ess: Tensor | None = None
    weighted: tuple[dict[str, Tensor], Tensor] | None = None
    record: StepRecord | None = None
    history: dict | None = None


def advance(
    settings: StepSettings,
    program: StepProgram,
    checks: TraceChecks,
    state: SMCState,
    weights: ParticleWeights | None,
    model_fn: Callable,
    guide_fn: Callable | None,
    inputs: StepInputs,
) -> StepOutcome:
    """Takes one step (``inputs.t is None``: ``init``): the model writes the new particles into
    ``state``; everything else the step made is returned.

    Raises:
        ValueError: the checks of :class:`~pyro_smc.infer.smc.trace_checks.TraceChecks`, naming the step.
        SMCFailedError: every particle of a filter has zero weight.
    """
    layout = settings.layout
    estimator = settings.estimator
    score_function = estimator in (GradientEstimator.SCORE, GradientEstimator.MARGINAL_SCORE)
    # The marginal estimator needs the previous weights; init (and a step before any weights)
    # scores its draws along the path, which is the same thing for a parentless draw.
    marginal = estimator is GradientEstimator.MARGINAL_SCORE and torch.is_grad_enabled() and weights is not None
    if estimator is GradientEstimator.MARGINAL_SCORE:
        check_marginal_supported(program.guide, layout.max_plate_nesting)
    # The unbatched state: step_record adds the filter dim itself.
    parent = (dict(state), weights.log_weights) if settings.store_history and weights is not None else None
    # What the marginal estimator and the smoother's checks re-run the step from.
    before = (dict(state), plain_attributes(program.model)) if marginal or parent is not None else None

    compiled = settings.compiled
    scored = score_function and torch.is_grad_enabled()
    # Asked once: a recording that gives up inside run() leaves observe() nothing to do.
    eligible = compiled is not None and compiled.eligible(settings.store_history, inputs, estimator is GradientEstimator.MARGINAL_SCORE)
    threshold = settings.ess_threshold * layout.num_particles
    log_weights = None if weights is None else weights.log_weights
    replayed = compiled.run(program, state, log_weights, threshold, model_fn, guide_fn, inputs, score_function, scored) if eligible else None
    if replayed is not None and replayed.proposal is None:
        # A replayed step: its checks ran when it was recorded, and it weighed itself.
        recorded = replayed.weighed
        return finish(settings, checks.discrete_keys, state, weights.gain(recorded.log_weights, recorded.increment), inputs, None, recorded)
    if replayed is None:
        try:
            proposal = program.propose(state, model_fn, guide_fn, inputs, detach=score_function, draws=settings.draws)
        except ValueError as error:
            # Pyro's validation (a parameter outside its constraint) names the site, not the step.
            if inputs.where in str(error):
                raise
            raise ValueError(f"at {inputs.where}: {error}") from error
    else:
        proposal = replayed.proposal
    checks.check(proposal, state, inputs, ESTIMATOR_OPTION[estimator.value] if score_function else None)
    if replayed is None:
        terms = log_weight_terms(
            proposal.model_trace,
            proposal.guide_trace,
            layout,
            inputs.predict_only,
            inputs.partial,
            inputs.active,
            inputs.ended,
            inputs.args[0] if inputs.args else None,
            inputs.where,
        )
    else:
        terms = replayed.terms
    if eligible and replayed is None:
        compiled.observe(program, proposal, state, terms)
    history = smoothing.step_record(proposal.model_trace, state, parent, layout) if settings.store_history and inputs.t is not None else None
    if history is not None and parent is not None:
        history["problem"] = smoothing.backward_kernel_problem(program, proposal, before, state, inputs, layout)
    score = None if replayed is None else replayed.score
    if marginal:
        score = marginal_scores(program, proposal, weights.log_weights, before, state, inputs, layout)
        if score is not None:
            # The previous weights' gradient now enters through the marginal score only.
            weights = weights._replace(log_weights=weights.log_weights.detach())
    elif scored and replayed is None:
        score = score_terms(proposal.model_trace, proposal.guide_trace, layout, inputs.active)
    checks.check_state(state, inputs.where)
    return finish(settings, checks.discrete_keys, state, weigh(weights, terms, score, layout, inputs, _any_tensor(state)), inputs, history)


def finish(
    settings: StepSettings,
    discrete_keys: set[str],
    state: SMCState,
    weights: ParticleWeights | None,
    inputs: StepInputs,
    history: dict | None,
    recorded: Weighed | None = None,
) -> StepOutcome:
    """The phases after the reweighting: summarise (unless a replayed step ``recorded`` its
    summary), maybe resample, and the step's record."""
    if weights is None:
        return StepOutcome(None)
    layout = settings.layout
    if recorded is None:
        means, ess = summarise(state, weights, layout, inputs)
        need, flags = ess < settings.ess_threshold * layout.num_particles, None
    else:
        means, ess, need, flags = recorded.means, recorded.ess, recorded.need, recorded.flags
    if settings.deferred:
        # The next step's first stage resamples (it reads the next observation).
        need, flags = torch.zeros_like(need), (False, False)
    # References, not copies: resampling replaces the state tensors instead of mutating them.
    weighted = (dict(state), weights.log_weights)
    if history is not None:
        smoothing.record_weighted(history, state, weights.log_weights, layout)
    scheme = index_scheme(settings.resampler) if recorded is not None and state else None
    if scheme is not None:
        # A replayed step with an index resampler: no resampler call (flags: read with the step).
        resampling = None
        if flags[0]:
            weights = _resample_replayed(state, weights, need, flags[1], scheme, layout)
    else:
        weights, resampling = maybe_resample(state, weights, need, settings.resampler, discrete_keys, layout, inputs.where, flags, settings.report)
    if history is not None and resampling is not None:
        smoothing.record_resampling(history, need, resampling.ancestors, layout)
    if inputs.t is None:
        # An init's log-evidence term stays unreported and joins step 0's increment.
        return StepOutcome(weights, ess, weighted)
    weights, increment = weights.reported()
    record = StepRecord(
        log_evidence_increment=increment,
        filtering_means=means,
        ess=ess,
        resampled=need if state else torch.zeros_like(need),
        # Kept with the history only: (B, N) per step is the smoother's memory, not the run's.
        ancestors=resampling.ancestors if resampling is not None and settings.store_history else None,
        resampler_converged=None if resampling is None else resampling.converged,
    )
    return StepOutcome(weights, ess, weighted, record, history)


def _resample_replayed(state: SMCState, weights: ParticleWeights, need: Tensor, every: bool, scheme: tuple, layout: ParticleLayout) -> ParticleWeights:
    """:func:`~pyro_smc.infer.smc.step.maybe_resample` of a replayed step with an index
    resampler: the same draws and copies, without the resampler's Python and its checks (the
    replay checked the normalisers; labels are copied as they are, which is what their integer
    round trip does)."""
    batched = [layout.batched_particles(value) for value in state.values()]
    if every:
        new, log_weights = resample_every(weights.log_weights, batched, scheme)
    else:
        new, log_weights = resample_where(need, every, weights.log_weights, batched, *scheme)
    state.replace({key: value.squeeze(0) if layout.num_filters == 1 else value for key, value in zip(state, new)})
    return weights._replace(log_weights=log_weights)


def _any_tensor(state: SMCState) -> Tensor | None:
    """A state tensor, for the dtype of the first weights when nothing was scored."""
    return next(iter(state.values())) if state else None
