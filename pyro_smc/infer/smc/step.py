"""One step of :class:`~pyro_smc.SMC` as its phases: propose, weigh, summarise, maybe resample.

See ``docs/math/smc.md#one-step-of-the-filter``. Each phase is a function of what it reads,
returning what it makes::

    proposal = program.propose(state, model_fn, guide_fn, inputs)       # run the Pyro program
    weights  = weigh(weights, terms, score, layout, inputs)              # log w_t, log p_hat(y_t | .)
    means, ess = summarise(state, weights, layout, inputs)               # the step's record
    weights, outcome = maybe_resample(state, weights, need, ...)         # when ESS < threshold * N

The engine strings them together and keeps only the new weights and the step's record
(:class:`~pyro_smc.infer.smc.result.StepRecord`).

Example:
    >>> import torch
    >>> from pyro_smc.infer.smc.importance import ParticleLayout
    >>> layout = ParticleLayout(num_filters=1, num_particles=3, max_plate_nesting=0)
    >>> terms = [("y", torch.zeros(3))]  # equal likelihoods, (N,)
    >>> w = weigh(None, terms, None, layout, StepInputs((), {}, t=0))
    >>> [round(p, 4) for p in w.log_weights.exp()[0].tolist()], w.log_evidence.tolist()
    ([0.3333, 0.3333, 0.3333], [0.0])
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.nn import PyroModule
from pyro.poutine.trace_struct import Trace
from torch import Tensor

from pyro_smc.infer.smc.convergence import ConvergenceReport
from pyro_smc.infer.smc.importance import ParticleLayout, centred_increment, failure
from pyro_smc.infer.smc.scores import add_scores
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.ops.weights import all_finite, ess_of_weights
from pyro_smc.resamplers import Resampled, Resampler, resample
from pyro_smc.tracing import detach_latent_draws, module_context, replay_where

__all__ = ["Proposal", "Resampling", "StepInputs", "StepProgram", "maybe_resample", "moments", "summarise", "weigh"]


class StepInputs(NamedTuple):
    """What one call of ``init`` or ``step`` is given.

    Attributes:
        args: the program's positional arguments after ``state`` (the observation first).
        kwargs: its keyword arguments.
        t: the 0-based time step; ``None`` for ``init``.
        predict_only: no filter's observation is scored (``None`` or all-NaN).
        observed: the mask of the observed entries of a partly-missing observation, else ``None``.
        active: bool ``(B,)``, the filters whose observation is present at this step (``None``: all).
        ended: bool ``(B,)``, the filters past the end of their sequence, which score nothing
            (``None``: none).
        bare: whether the observation carries none of the engine's dims (``False`` for a batch
            of sequences, whose observations are ``(B, 1, ...)``).
    """

    args: tuple
    kwargs: dict
    t: int | None
    predict_only: bool = False
    observed: Tensor | None = None
    active: Tensor | None = None
    ended: Tensor | None = None
    bare: bool = True

    @property
    def where(self) -> str:
        """The step, as error messages name it."""
        return "init" if self.t is None else f"time step {self.t}"

    @property
    def partial(self) -> tuple[Tensor, Tensor, str] | None:
        """``(y, observed, where)`` for a partly-missing observation, else ``None``."""
        return None if self.observed is None else (self.args[0], self.observed, self.where)


class Proposal(NamedTuple):
    """The traces of one proposal: the model's, replayed against the guide's draws.

    Attributes:
        model_trace: the model's trace.
        guide_trace: the guide's trace, ``None`` when the model's transition proposed.
        model_fn: the model as it ran (replayed against the guide), for re-running the step.
    """

    model_trace: Trace
    guide_trace: Trace | None
    model_fn: Callable


class StepProgram:
    """Runs the user's Pyro program for one step, under handlers built once per engine.

    Args:
        model: the model, with ``init``/``step``.
        guide: the guide, or ``None``.
        layout: the particle dims (the particle plate sits left of ``max_plate_nesting`` plates).
    """

    def __init__(self, model: Any, guide: Any, layout: ParticleLayout):
        self.model, self.guide, self.layout = model, guide, layout
        # Built once and re-entered each step: building them costs more than a small step's
        # bookkeeping.
        self._block = poutine.block(hide_types=["sample"])
        self._has_modules = isinstance(model, PyroModule) or isinstance(guide, PyroModule)
        mpn = layout.max_plate_nesting
        self._plates = [pyro.plate("particles", layout.num_particles, dim=-1 - mpn)]
        if layout.num_filters > 1:
            self._plates.insert(0, pyro.plate("filters", layout.num_filters, dim=-2 - mpn))

    @contextlib.contextmanager
    def handlers(self) -> Iterator[contextlib.ExitStack]:
        """The particle (and filter) plates, the model's and guide's module contexts, and a block
        that keeps the step's sample sites out of any enclosing trace."""
        modules = module_context(self.model, self.guide) if self._has_modules else contextlib.nullcontext()
        with self._block, modules, contextlib.ExitStack() as stack:
            for plate in self._plates:
                stack.enter_context(plate)
            yield stack

    def propose(self, state: SMCState, model_fn: Callable, guide_fn: Callable | None, inputs: StepInputs, detach: bool, draws: Any = None) -> Proposal:
        """Runs the guide (if any), then the model replayed against the guide's draws.

        Args:
            state: the particles; the model writes the new ones into it.
            model_fn: ``model.init`` or ``model.step``.
            guide_fn: ``guide.init`` or ``guide.step``, or ``None`` (the model's transition proposes).
            inputs: the step's arguments and masks.
            detach: record detached draws (the score-function estimators).
            draws: a handler that sets the latent draws (SQMC's
                :class:`~pyro_smc.infer.smc.qmc.InverseCDFDraws`), or ``None``.

        Raises:
            ValueError: a model plate collides with the particle plate (naming the step).
        """
        mpn = self.layout.max_plate_nesting
        with self.handlers() as stack:
            if draws is not None:
                # Inside the plates (the sites' distributions are broadcast when it reads them),
                # outside the detaching handler, which then detaches its values.
                stack.enter_context(draws)
            if detach:
                # Inside the plates, outside the traces: the traces record the detached draws.
                stack.enter_context(detach_latent_draws())
            guide_trace, replay = None, contextlib.nullcontext()
            try:
                # poutine.trace() as a context manager: get_trace would copy the trace each step.
                if guide_fn is not None:
                    with state.locked(), poutine.trace() as tracer:
                        guide_fn(state, *inputs.args, **inputs.kwargs)
                    guide_trace = tracer.trace
                    if inputs.active is None:
                        model_fn = poutine.replay(model_fn, trace=guide_trace)
                    else:
                        # Filters that observe nothing here move by the model's own transition.
                        replay = replay_where(guide_trace, inputs.active, 1 + mpn)
                with replay, poutine.trace() as tracer:
                    model_fn(state, *inputs.args, **inputs.kwargs)
            except ValueError as error:
                # Pyro reports a plate collision as a ValueError whose text is the only mark.
                if "collide" not in str(error):
                    raise
                raise ValueError(
                    f"at {inputs.where}: a model plate collides with the particle plate at dim {-1 - mpn}; set "
                    f"max_plate_nesting (now {mpn}) to the number of plates the model nests inside a step"
                ) from error
        return Proposal(tracer.trace, guide_trace, model_fn)

    def advance_guide(self, state: SMCState, inputs: StepInputs) -> None:
        """Calls the guide at a step where it cannot propose (a missing or partly missing
        observation), its draws discarded, so that its own bookkeeping (a step counter, a hidden
        state) stays in step with the model's. It gets the observation with missing entries set
        to zero, as the filters without an observation get theirs in a batch of sequences."""
        args = inputs.args
        y = args[0] if args else None
        if isinstance(y, Tensor) and y.is_floating_point():
            args = (torch.nan_to_num(y, nan=0.0),) + tuple(args[1:])
        with self.handlers(), state.locked():
            self.guide.step(state, *args, **inputs.kwargs)


def weigh(
    weights: ParticleWeights | None,
    terms: list[tuple[str, Tensor]],
    score: Tensor | None,
    layout: ParticleLayout,
    inputs: StepInputs,
    like: Tensor | None = None,
) -> ParticleWeights | None:
    """Reweights by the step's log-weight terms: ``log w_t = log w_{t-1} + log omega - log p_hat``.

    Args:
        weights: the previous weights (``None`` before the first scored step: equal weights).
        terms: the per-site terms ``(name, (B, N))`` of ``log omega``.
        score: score terms ``(B, N)`` (zero in value), or ``None``.
        layout: the particle dims.
        inputs: the step (its ``active`` mask and its name for messages).
        like: a state tensor, for the dtype of the first weights when nothing was scored.

    Returns:
        The new weights; ``None`` while there is nothing to weigh (no weights, no state).

    Raises:
        SMCFailedError: every particle of a filter has zero weight (naming the step and the site).
    """
    if not terms:
        # Nothing was scored (an init that only sets up bookkeeping, a predict-only step).
        if weights is None and like is not None:
            weights = ParticleWeights.uniform(layout.num_filters, layout.num_particles, like)
        if weights is not None and score is not None:
            weights = add_scores(weights, score)
        return weights
    increment, offset = centred_increment(terms, layout)
    if score is not None:
        # Zero in value (so the forward numbers are unchanged bit for bit), the scores in autograd.
        increment = increment + score
    if weights is None:
        weights = ParticleWeights.uniform(layout.num_filters, layout.num_particles, increment)
    joint = weights.log_weights + increment
    log_norm = torch.logsumexp(joint, dim=-1)
    if not all_finite(log_norm):
        raise failure(terms, layout, inputs.where)
    if inputs.active is not None:
        # A filter whose terms were all masked (no observation, and no other observed site, or
        # past its sequence's end) scored nothing: its log_norm is 0 up to rounding; exactly 0 in
        # value keeps its weights and evidence.
        scored = torch.stack([layout.batched(term).ne(0).any(-1) for _, term in terms]).any(0)
        log_norm = torch.where(scored, log_norm, log_norm - log_norm.detach())
    return weights.gain(joint - log_norm.unsqueeze(-1), log_norm + offset)


def summarise(state: SMCState, weights: ParticleWeights, layout: ParticleLayout, inputs: StepInputs) -> tuple[dict[str, Tensor], Tensor]:
    """The step's filtering means ``{key: (B, *event)}`` (none at ``init``) and ESS ``(B,)``.

    Raises:
        ValueError: a filtering mean is not finite (naming the step and the state key).
    """
    means, ess = moments(state, weights.log_weights, layout, with_means=inputs.t is not None)
    finite = [bool(torch.isfinite(mean).all()) for mean in means.values()] if means else [True]
    if not all(finite):
        bad = next(key for key, ok in zip(means, finite) if not ok)
        raise ValueError(
            f"at {inputs.where}: the filtering mean of state['{bad}'] is not finite: a particle's state holds NaN or inf "
            "(check the model's transition at that step)"
        )
    return means, ess


def moments(state: SMCState, log_weights: Tensor, layout: ParticleLayout, with_means: bool = True) -> tuple[dict[str, Tensor], Tensor]:
    """The filtering means ``{key: (B, *event)}`` and the ESS ``(B,)`` of normalised log-weights
    ``(B, N)``: tensor operations only (the compiled step records them; no check here)."""
    w = log_weights.exp()
    # ESS of normalised weights lies in [1, N] (Cauchy-Schwarz); rounding in the normalisation
    # may step past either end by an ulp, which a threshold comparison must not see.
    ess = ess_of_weights(w.detach()).clamp(1, layout.num_particles)
    means: dict[str, Tensor] = {}
    if not with_means:
        return means, ess
    for key, value in state.items():
        # Every key, labels included: the mean of a 0/1 label is its filtering probability.
        value = layout.batched_particles(value).to(w.dtype)
        if value.dim() == 2:
            means[key] = (w * value).sum(-1)  # two kernels, where a (1, N) @ (N, 1) product is several
        else:
            flat = value.reshape(value.shape[:2] + (-1,))
            means[key] = (w.unsqueeze(-2) @ flat).squeeze(-2).reshape((layout.num_filters,) + value.shape[2:])
    return means, ess


class Resampling(NamedTuple):
    """What a resampling of some filters did.

    Attributes:
        ancestors: the ancestor indices ``(B', N)`` of the ``B'`` filters resampled, ``None`` when
            the resampler draws none.
        converged: bool ``(B,)`` whether the resampler's inner solve converged (``True`` for the
            filters not resampled), ``None`` when it solved nothing.
    """

    ancestors: Tensor | None
    converged: Tensor | None


def maybe_resample(
    state: SMCState,
    weights: ParticleWeights,
    need: Tensor,
    resampler: Callable,
    discrete_keys: set[str],
    layout: ParticleLayout,
    where: str,
    flags: tuple[bool, bool] | None = None,
    report: ConvergenceReport | None = None,
) -> tuple[ParticleWeights, Resampling | None]:
    """Resamples the filters ``need`` ``(B,)``, writing their new particles into ``state``.

    ``flags``, when given, is ``(need.any(), need.all())`` already read from the device.
    ``report``, when given (within ``SMC.run``), collects the solver's convergence warnings
    after the run's first (:mod:`~pyro_smc.infer.smc.convergence`).

    A float-coded label (``dist.Bernoulli``'s 0./1.) in ``discrete_keys`` travels as an integer
    tensor, which every resampler copies from one ancestor instead of averaging.

    Returns:
        The new weights and the :class:`Resampling`, or the same weights and ``None`` when no
        filter needs it (or the state is empty).
    """
    any_need, all_need = flags if flags is not None else (bool(need.any()), None)
    if not state or not any_need:
        return weights, None
    if all_need is None:
        all_need = bool(need.all())
    particles = {key: layout.batched_particles(value) for key, value in state.items()}
    labels = {key: particles[key].dtype for key in discrete_keys if key in particles and particles[key].is_floating_point()}
    for key in labels:
        particles[key] = particles[key].long()
    log_w = weights.log_weights
    if all_need:
        out = _call_resampler(resampler, particles, log_w, where, report)
        new, new_log_w = out.particles, out.log_weights
    else:
        idx = need.nonzero().squeeze(-1)
        out = _call_resampler(resampler, {k: v[idx] for k, v in particles.items()}, log_w[idx], where, report)
        new = {k: particles[k].index_put((idx,), out.particles[k]) for k in particles}
        new_log_w = log_w.index_put((idx,), out.log_weights)
    restored = {key: value.to(labels[key]) if key in labels else value for key, value in new.items()}
    state.replace({key: value.squeeze(0) if layout.num_filters == 1 else value for key, value in restored.items()})
    converged = None
    if out.diagnostics is not None:
        # An iterative resampler (OTResampler) reports its solve, one entry per filter it saw.
        converged = torch.ones_like(need).masked_scatter(need, out.diagnostics.converged.reshape(-1).to(need.device))
    return weights._replace(log_weights=new_log_w), Resampling(out.ancestors, converged)


def _call_resampler(resampler: Callable, particles: dict[str, Tensor], log_weights: Tensor, where: str, report: ConvergenceReport | None = None) -> Resampled:
    """Calls the resampler, prefixing its Sinkhorn convergence warnings with ``where``.

    The solver cannot know the time step; the user needs it to find the hard step. Only resamplers
    that may emit such warnings are wrapped: ``catch_warnings`` costs a few microseconds and, by
    mutating the warning filters, resets Python's once-per-location bookkeeping of every warning.
    """
    if not (isinstance(resampler, Resampler) and resampler.reports_convergence):
        return resample(resampler, particles, log_weights)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SinkhornConvergenceWarning)
            return resample(resampler, particles, log_weights)
    finally:
        # Re-emitted after the block has restored the user's filters, so they apply (an "error"
        # filter raises here, pytest.warns sees them); also when the resampler raised.
        for record in caught:
            if issubclass(record.category, SinkhornConvergenceWarning):
                if report is None or report.add(where, str(record.message)):
                    warnings.warn(SinkhornConvergenceWarning(f"at {where}: {record.message}"), stacklevel=2)
            else:
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno, source=record.source)
