"""A step of :class:`~pyro_smc.SMC` traced once and replayed: the Pyro program at tensor speed.

Running the user's ``step`` through Pyro's handlers costs the same at every step: building the
distributions, the message stack of ``pyro.sample``, plate broadcasting, the trace and its
log-densities. For most state-space models that work is the same at every step; only the tensors
change. So at the first regular step (``docs/engines/smc.md#the-compiled-step``) the engine records
the step's tensor computation with ``torch.jit.trace``: a function of the particles, the step's
tensor arguments, the previous log-weights and the parameters it read, returning the new
particles, the step's log-weight terms and its reweighting and summary (log-weights, evidence
increment, ESS, filtering means). Later steps call that recording. The noise is drawn inside the recording by the
same generator calls as on the handler path, so a compiled run consumes the random stream exactly
as an uncompiled one and gives the same particles, log-evidence and gradients to rounding.

A recording is only valid for a program that does the same thing at every step. What is checked:

* while recording, no tensor is turned into a Python number or branch (``float(x)``, ``if x > 0``:
  the trace would freeze that value), no tensor that requires grad is missed as an input, the
  grad mode is not switched inside the step (:class:`~pyro_smc.infer.smc.python_state.GradModeWatch`),
  and at the first regular step and at the recorded one the step changes none of the Python
  state it can reach (:mod:`~pyro_smc.infer.smc.python_state`: the model's and guide's
  attributes, their contents, the closures and globals of their functions, tensors written in
  place, the global random states), since a replay skips the program's Python side effects and
  would freeze a counter kept anywhere there;
* a step counter that only names sites (``self.t``, as ``pyro.infer.SMCFilter`` models keep) is
  carried instead (:mod:`~pyro_smc.infer.smc.counters`): recorded behind a stand-in that refuses
  any numeric use, and advanced by each replay;
* before every replayed step, the Python values the verified recording read are still what they
  were (:func:`~pyro_smc.infer.smc.python_state.stale`): a constant set on the model between two
  calls of ``SMC.step`` sends the rest of the run to the handler path;
* at the next regular step the recording runs side by side with the handler path (the random
  state rewound in between): same sites, same shapes, same numbers, or the run falls back;
* at every later step the step must look the same from outside: the same state keys, shapes and
  dtypes, the same tensor argument shapes and equal non-tensor arguments, the same grad mode.
  A step that does not (a missing observation, a batch whose filters observe different steps)
  runs on the handler path, and the recording serves the next regular step;
* a replayed step whose normaliser or filtering means are not finite, or whose distributions'
  parameters or observations break their constraints (what Pyro's validation checks, and a
  replay counts instead: :func:`~pyro_smc.infer.smc.trace_checks.constraints_hold`), is
  rewound and rerun on the handler path, with Pyro's validation, so a bad step reports the same
  error either way.

A recording is kept with its model and guide (weakly) for their later runs (``SMCELBO`` builds an
``SMC`` per SVI step): a run whose step looks the same (signature, scalar attributes, param names)
verifies it again at its first regular step and replays from the next; a disagreement there (a
frozen constant that changed, such as a global) makes the run record afresh. The last few are
also kept by the model's and guide's classes and structure
(:func:`~pyro_smc.infer.smc.static_checks.structure`), for a new model object of the same
classes, verified the same way.

What is not compiled: ``store_history`` (the smoother keeps each step's distributions), the
marginal stop-gradient estimator (``gradient="marginal_stop_gradient"``, whose terms pair every
particle with every parent), and a program the checks above reject. The stop-gradient estimator
(``gradient="stop_gradient"``) is: its score terms are part of the recording. A fallback is silent with ``compile=None`` (the default) and
warns once with ``compile=True``; either way :attr:`CompiledStep.reason` and the ``pyro_smc``
logger say why.

The recording is simplified once and each call run by the fastest executor that gives the same
values (:mod:`~pyro_smc.infer.smc.replay`); a replayed step with an index resampler resamples
in tensor operations alone (:func:`~pyro_smc.ops.resample.resample_where`, called by
:mod:`~pyro_smc.infer.smc.advance`).
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import pyro
import torch
from torch import Tensor

from pyro_smc.infer.model_state import rng_state, set_rng_state
from pyro_smc.infer.smc import counters as step_counters
from pyro_smc.infer.smc.importance import centred_increment, log_weight_terms, score_terms
from pyro_smc.infer.smc.python_state import GradModeWatch, Snapshot, stale
from pyro_smc.infer.smc.replay import execute, ignore_jit_deprecation, simplified
from pyro_smc.infer.smc.state import SMCState
from pyro_smc.infer.smc.step import Proposal, StepInputs, StepProgram, moments
from pyro_smc.infer.smc.trace_checks import constraints_hold
from pyro_smc.infer.smc.static_checks import (
    attribute_snapshot,
    clean,
    disagreement,
    flatten,
    between_snapshot,
    changes,
    counted_constants,
    module_tensors,
    owners,
    renamed_sites,
    restore,
    shapes,
    side_effect,
    site_and_param_names,
    sites,
    step_snapshot,
    structure,
    unflatten,
)
from pyro_smc.tracing import param_sites

__all__ = ["CompiledStep", "CompileFallbackWarning", "Replayed", "Weighed"]

logger = logging.getLogger("pyro_smc")


class CompileFallbackWarning(UserWarning):
    """``SMC(compile=True)`` could not compile a step and ran the handler path instead."""


class Weighed(NamedTuple):
    """The reweighting and summary a replayed step recorded with the program (what
    :func:`~pyro_smc.infer.smc.step.weigh` and :func:`~pyro_smc.infer.smc.step.summarise` make).

    Attributes:
        log_weights: ``(B, N)`` the new normalised log-weights.
        increment: ``(B,)`` the step's ``log p_hat(y_t | y_{1:t-1})``.
        means: ``{key: (B, *event)}`` the filtering means.
        ess: ``(B,)`` the ESS after the reweighting.
        need: bool ``(B,)`` the filters whose ESS is below the threshold.
        flags: ``(need.any(), need.all())``, read from the device with the step's check.
    """

    log_weights: Tensor
    increment: Tensor
    means: dict[str, Tensor]
    ess: Tensor
    need: Tensor
    flags: tuple[bool, bool]


class Replayed(NamedTuple):
    """What a compiled step made: the new particles and the step's log-weight terms.

    Attributes:
        state: ``{key: tensor}`` the particles the model wrote.
        terms: ``[(site, (particle shape))]`` as :func:`~pyro_smc.infer.smc.importance.log_weight_terms` returns them.
        score: the score-function terms, or ``None``.
        proposal: the traces, at the recorded step only (its checks need them); ``None`` after.
        weighed: the step's reweighting and summary, at a replayed step only; ``None`` at the
            recorded step (the handler path's phases weigh it).
    """

    state: dict[str, Tensor]
    terms: list[tuple[str, Tensor]]
    score: Tensor | None
    proposal: Proposal | None = None
    weighed: Weighed | None = None


class CompiledStep:
    """Records one regular step of an ``SMC`` run and replays it at the steps after.

    The first regular step runs on Pyro's handlers and names the parameters a step reads; the
    second is recorded; the third is replayed and rerun on the handler path from the same random
    state, and the two must agree; from the fourth on the recording runs alone.

    Args:
        mode: ``None`` compile when safe, silently falling back; ``True`` the same, warning
            (:class:`CompileFallbackWarning`) when it falls back; ``False`` never compile.

    Attributes:
        reason: why this run is not compiled (``None`` while it is, or has not yet decided).
        compiled_steps: the steps this run replayed.
    """

    def __init__(self, mode: bool | None):
        self.mode = mode
        self.reset()

    def reset(self) -> None:
        """Starts a run. An earlier run's recording of the same model and guide is reused if the
        program looks the same (:func:`constants`), after it is verified again at this run's
        first regular step (the model may have changed since)."""
        self.reason: str | None = "compile=False" if self.mode is False else None
        self.compiled_steps = 0
        self._recording: _Recording | None = None
        self._params: tuple[str, ...] | None = None
        self._pending: tuple | None = None
        self._before: tuple | None = None
        self._deep: Snapshot | None = None  # the Python state before the step being checked
        self._between: Snapshot | None = None  # the Python state the verified recording bakes in
        self._counters: step_counters.Counters = ()  # step counters the replays advance (counters.py)
        self._counted_at: tuple = ()  # their values at the verifying step
        self._rerecorded = False  # whether the recording was made again at a later step
        self._verified = False

    @property
    def enabled(self) -> bool:
        return self.reason is None

    @property
    def verified(self) -> bool:
        """Whether this run replays a verified recording (the steps after may run as a loop)."""
        return self.reason is None and self._verified and self._recording is not None

    def give_up(self, reason: str) -> None:
        """Falls back to the handler path for the rest of the run."""
        self.reason, self._recording, self._pending = reason, None, None
        logger.info("SMC runs on Pyro's handlers, not compiled: %s", reason)
        if self.mode is True:
            warnings.warn(CompileFallbackWarning(f"SMC(compile=True) runs on Pyro's handlers: {reason}"), stacklevel=5)

    def eligible(self, store_history: bool, inputs: StepInputs, marginal: bool) -> bool:
        """Whether this step may run compiled (a run-wide reason gives up at once); ``marginal``:
        the marginal stop-gradient estimator, whose terms need the previous step's particles."""
        if not self.enabled:
            return False
        if store_history:
            self.give_up("store_history=True keeps each step's distributions for the smoother")
            return False
        if marginal:
            self.give_up("the marginal stop-gradient estimator is not compiled (its terms pair each particle with every parent)")
            return False
        return inputs.t is not None and not inputs.predict_only and inputs.observed is None and inputs.active is None

    def run(
        self,
        program: StepProgram,
        state: SMCState,
        log_weights: Tensor | None,
        threshold: float,
        model_fn: Callable,
        guide_fn: Callable | None,
        inputs: StepInputs,
        detach: bool,
        score: bool,
    ) -> Replayed | None:
        """Records or replays the step from the previous ``log_weights`` ``(B, N)``, resampling
        below an ESS of ``threshold``; ``None``: the caller runs it on the handler path (and passes
        what it made to :meth:`observe`)."""
        tensors, signature = _step_signature(state, inputs, log_weights, threshold, model_fn, guide_fn, detach, score)
        if signature is None:
            return None
        tensors += (log_weights,)
        if self._recording is None and (log_weights is not None or self._params is None):
            # An earlier run's recording: verified at this step if the program looks the same.
            earlier = _kept(program)
            if earlier is not None and earlier.signature == signature and earlier.constants == counted_constants(program, earlier.counters):
                self._recording, self._params, self._before = earlier, earlier.params, attribute_snapshot(program)
                self._counters = earlier.counters
        if self._params is None:
            # The first regular step runs on the handlers; observe() reads what it changed.
            self._before, self._deep = attribute_snapshot(program), step_snapshot(program, state, inputs)
            if self._deep.problem is not None:
                self.give_up(self._deep.problem)
            return None
        recording = self._recording
        if log_weights is None:
            return None  # nothing weighed yet: the recording weighs from the previous weights
        if recording is None:
            return self._record(program, state, model_fn, guide_fn, inputs, (detach, score, threshold, _listed(state, program.layout)), tensors, signature)
        extra = module_tensors(program)
        if recording.signature != signature or shapes(extra) != recording.extra:
            if self._verified or recording.runs > 0 or self._rerecorded:
                return None
            # Recorded where the particles did not yet require grad (drawn from a prior without
            # parameters) and these do: recorded again, once, at this step.
            self._rerecorded, self._recording = True, None
            return self._record(program, state, model_fn, guide_fn, inputs, (detach, score, threshold, _listed(state, program.layout)), tensors, signature)
        if not self._verified:
            if self._changed_between_steps():
                return None
            # What the handler path changes at this step is read against the program as it is now
            # (a tensor attribute replaced since the recording is an input, not a side effect).
            self._before, self._deep = attribute_snapshot(program), step_snapshot(program, state, inputs)
            self._counted_at = step_counters.values(owners(program), self._counters)
            rng = rng_state()
            self._pending = self._call(recording, tensors + extra)
            set_rng_state(rng)
            return None
        if self._changed_between_steps():
            return None
        return self._replay(program, recording, state, tensors + extra)

    def observe(self, program: StepProgram, proposal: Proposal, state: SMCState, terms: list[tuple[str, Tensor]]) -> None:
        """Reads a regular step the handler path took: the parameters it read (the first such
        step) or, at the verifying step, whether the replay agreed with it."""
        if not self.enabled:
            return
        if self._params is None:
            names = param_sites(proposal.model_trace) + ([] if proposal.guide_trace is None else param_sites(proposal.guide_trace))
            self._params = tuple(dict.fromkeys(names))
            # A step that changes the program's attributes is given up on before any recording
            # runs it a second time; a step counter it advanced by one is carried instead.
            if self._before is not None:
                self._counters = step_counters.counters_of(owners(program), self._before)
            with step_counters.held_back(owners(program), self._counters):
                problem = side_effect(self._before, program) if self._before is not None else None
                if problem is None and self._deep is not None:
                    problem = changes(self._deep, step_snapshot(program, None, None))
            if problem is not None:
                self.give_up(problem)
            return
        if self._pending is None:
            return
        replayed, self._pending = self._pending, None
        with step_counters.held_back(owners(program), self._counters):
            changed = side_effect(self._before, program) if self._before is not None else None
            if changed is None and self._deep is not None:
                changed = changes(self._deep, step_snapshot(program, None, None))
        # Site names that carry a step counter differ by its value: compared with it masked.
        recorded, now = self._recording.counted, self._counted_at
        problem = changed or disagreement(
            renamed_sites(self._recording.sites, recorded),
            replayed[0].state,
            [(step_counters.renamed(name, recorded), term) for name, term in replayed[0].terms],
            renamed_sites(sites(proposal), now),
            dict(state),
            [(step_counters.renamed(name, now), term) for name, term in terms],
        )
        if problem is not None and self._recording.runs > 0:
            # An earlier run's recording no longer fits (a constant the program reads changed):
            # this run records afresh, from its next regular step.
            _keep(program, None)
            self._recording, self._params = None, None
        elif problem is not None:
            self.give_up(f"the step is not static: {problem}")
        else:
            self._verified = True
            self._recording = self._recording._replace(runs=self._recording.runs + 1)
            self._between = between_snapshot(program, module_tensors(program), self._counters)
            _keep(program, self._recording)

    def loop_inputs(self, program: StepProgram, state: SMCState, log_weights: Tensor, threshold: float, model_fn: Callable, guide_fn: Callable | None, inputs: StepInputs, detach: bool, score: bool):
        """The verified recording and its inputs at the regular step ``inputs``, laid out for
        :func:`~pyro_smc.infer.smc.replay_loop.run_replayed`; ``None`` where the step would not
        replay (not verified yet, a different signature) or the loop cannot take it (the step
        changes the state's keys, the observation is not a tensor)."""
        recording = self._recording
        if not (self.enabled and self._verified and recording is not None) or recording.out_keys != tuple(state):
            return None
        if not inputs.args or not isinstance(inputs.args[0], Tensor):
            return None
        tensors, signature = _step_signature(state, inputs, log_weights, threshold, model_fn, guide_fn, detach, score)
        extra = module_tensors(program)
        if signature != recording.signature or shapes(extra) != recording.extra or self._changed_between_steps():
            return None
        return recording, tensors + (log_weights,) + extra + _parameters(recording), len(state), len(tensors)

    def _changed_between_steps(self) -> bool:
        """Gives up when the Python state the recording baked in changed since it was verified
        (a constant set on the model between two calls of ``SMC.step``): the handler path takes
        this step and the rest."""
        if self._between is None:
            return False
        changed = stale(self._between)
        if changed is not None:
            self.give_up(
                f"{changed} changed between steps, and a recording bakes in the Python values it read; "
                "pass a value that changes as a tensor argument of step() instead"
            )
        return changed is not None

    # --- record, replay ----------------------------------------------------------------------------
    def _record(self, program, state, model_fn, guide_fn, inputs, settings, tensors, signature) -> Replayed | None:
        before = attribute_snapshot(program)
        keys = tuple(state)
        store = dict(pyro.get_param_store().named_parameters())
        params = tuple(name for name in self._params if name in store)
        extra = module_tensors(program)
        captured: dict[str, Any] = {}

        def step_function(*values):
            return _run_step(program, keys, values[: len(tensors)], inputs, model_fn, guide_fn, settings, captured)

        deep = step_snapshot(program, state, inputs)
        pair, counters = owners(program), self._counters
        counted = step_counters.values(pair, counters)
        rng = rng_state()
        with step_counters.probed(pair, counters) as probe:
            try:
                function, problem = _trace(step_function, tensors + extra + tuple(store[name] for name in params))
            except step_counters.CounterUsed as error:
                function, problem = None, f"{error} (a recording would freeze it)"
            except Exception as error:  # noqa: BLE001 - whatever stops the recording means: do not compile
                function, problem = None, f"the step could not be traced ({type(error).__name__}: {_first_line(error)})"
        counter_problems = probe.problems
        problem = problem or (counter_problems[0] if counter_problems else None)
        if problem is None and counters and "proposal" in captured:
            problem = step_counters.named_beyond_sites(probe, site_and_param_names(captured["proposal"]), counted)
        with step_counters.held_back(pair, () if counter_problems else counters):
            changed = changes(deep, step_snapshot(program, None, None))
        if changed is not None and "proposal" in captured:
            # A side effect of the recorded run (a counter kept out of self's plain attributes,
            # a write into the particles) cannot be rewound: that run, the program's own, is the
            # step's result, so the effect happens once.
            self.give_up(changed)
            new = captured["state"]
            state.replace(new)
            return Replayed(dict(new), captured["terms"], captured["score"], captured["proposal"])
        if problem is None and not clean(captured["state"], captured["terms"]):
            # Recorded without validation: a NaN here is rerun on the handler path, which reports it
            # (with the program's attributes, its step counters among them, as before the step).
            set_rng_state(rng)
            restore(before, program)
            return None
        if problem is None:
            with step_counters.held_back(pair, counters):
                problem = side_effect(before, program)
        if problem is not None:
            # Rewound: the handler path takes this step as if nothing had been tried.
            set_rng_state(rng)
            restore(before, program)
            self.give_up(problem)
            return None
        new, terms, score_value = captured["state"], captured["terms"], captured["score"]
        names = tuple(name for name, _ in terms)
        recorded = sites(captured["proposal"])
        self._recording = _Recording(
            function, signature, tuple(new), names, score_value is not None, params, shapes(extra), recorded, counted_constants(program, counters), int(captured["checks"]), {},
            counters=counters, counted=counted,
        )
        self._between = between_snapshot(program, extra, counters)
        state.replace(new)
        return Replayed(dict(new), terms, score_value, captured["proposal"])

    def _replay(self, program: StepProgram, recording: _Recording, state: SMCState, tensors: tuple) -> Replayed | None:
        rng = rng_state()
        replayed, total = self._call(recording, tensors)
        if not math.isfinite(total):
            # Rewound and rerun with Pyro's validation: the handler path names what went wrong.
            set_rng_state(rng)
            return None
        state.replace(replayed.state)
        self.compiled_steps += 1
        step_counters.advance(owners(program), self._counters, 1)
        return replayed

    def advance_counters(self, program: StepProgram, steps: int) -> None:
        """Advances the program's step counters (:mod:`~pyro_smc.infer.smc.counters`) by the
        ``steps`` the compiled loop replayed."""
        step_counters.advance(owners(program), self._counters, steps)

    def _call(self, recording: _Recording, tensors: tuple) -> tuple[Replayed, float]:
        """Calls the recording on ``tensors`` (the step's, then the model's and guide's own) and
        the parameters read now from the param store; returns what it made and the status's
        check value (not finite: the step failed; :func:`_run_step`), run by
        :func:`~pyro_smc.infer.smc.replay.execute`."""
        out = iter(execute(recording.function, recording.executors, tensors + _parameters(recording)))
        new = {key: next(out) for key in recording.out_keys}
        terms = [(name, next(out)) for name in recording.term_names]
        score_value = next(out) if recording.has_score else None
        log_weights, increment, ess, need = next(out), next(out), next(out), next(out)
        means = {key: next(out) for key in recording.out_keys}
        # The step's one device read: its check and which filters resample.
        status = next(out).tolist()
        total, flags = sum(status[: recording.checks]), status[recording.checks :]
        resampling = sum(flags)
        weighed = Weighed(log_weights, increment, means, ess, need, (resampling > 0, resampling == len(flags)))
        return Replayed(new, terms, score_value, weighed=weighed), total


class _Recording(NamedTuple):
    """A traced step and what it was traced for."""

    function: Callable
    signature: tuple
    out_keys: tuple[str, ...]
    term_names: tuple[str, ...]
    has_score: bool
    params: tuple[str, ...]
    extra: tuple
    sites: tuple
    constants: tuple
    checks: int = 1  # the status's leading check values (summed on the host)
    executors: dict | None = None  # replay.execute's calls and static-runtime module
    runs: int = 0  # the runs that verified it before this one
    counters: tuple = ()  # the step counters it names sites by (counters.py), advanced by each replay
    counted: tuple = ()  # their values when it was recorded


# Verified recordings by model (and guide), so that a new SMC of the same program (SMCELBO builds
# one per SVI step) reuses one; weak, so a recording goes with its model.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# And by the model's and guide's classes and structure (static_checks.structure), so that a new
# model object of the same classes (``SMC(MyModel(), ...)`` in a loop) reuses one too; the
# verifying step then checks it against that object's own handler path. The last few only.
_SHARED: OrderedDict = OrderedDict()
_MAX_SHARED = 16


def _step_signature(state, inputs, log_weights, threshold, model_fn, guide_fn, detach, score) -> tuple[tuple[Tensor, ...], tuple | None]:
    """The step's tensors and what a recording of it must match (:func:`flatten` with the
    run's settings). The weights' requires_grad is left out: it flips with resampling, and a
    recording serves both (the executor's autograd follows its inputs)."""
    weights = None if log_weights is None else (log_weights.shape, log_weights.dtype)
    settings = (detach, score, torch.is_grad_enabled(), _name(model_fn), _name(guide_fn), threshold, weights)
    return flatten(state, inputs, settings)


def _parameters(recording: _Recording) -> tuple[Tensor, ...]:
    """The parameters ``recording`` reads, as the param store holds them now."""
    if not recording.params:
        return ()
    store = dict(pyro.get_param_store().named_parameters())
    return tuple(store[name] for name in recording.params)


def _kept(program: StepProgram) -> _Recording | None:
    """The recording :func:`_keep` kept for ``program``'s model and guide, else one kept for
    another model object of the same classes and structure, or ``None``."""
    try:
        guide, recording = _KEPT.get(program.model, (None, None))
    except TypeError:  # a model that takes no weak reference is not kept
        guide, recording = None, None
    if recording is not None and guide() is program.guide:
        return recording
    return _SHARED.get(structure(program))


def _keep(program: StepProgram, recording: _Recording | None) -> None:
    """Keeps ``recording`` (``None``: forgets) for later runs of ``program``'s model and guide,
    and of other model objects of the same classes and structure."""
    key = structure(program)
    _SHARED.pop(key, None)
    if recording is not None:
        _SHARED[key] = recording
        while len(_SHARED) > _MAX_SHARED:
            _SHARED.popitem(last=False)
    try:
        guide = (lambda: None) if program.guide is None else weakref.ref(program.guide)
        if recording is None:
            _KEPT.pop(program.model, None)
        else:
            _KEPT[program.model] = (guide, recording)
    except TypeError:
        pass


def _run_step(program, keys, values, inputs, model_fn, guide_fn, settings, captured) -> tuple[Tensor, ...]:
    """The step as a tensor function (what :func:`torch.jit.trace` records).

    In: the particles, the tensor arguments and the previous log-weights. Out, in this order:
    the new particles, the log-weight terms, the score terms (if any), then the reweighting and
    summary of :class:`Weighed` (log-weights, increment, ESS, need, means) and a status: the
    normalisers and means, or for more than ``_LISTED`` of them their sum (not finite: the step
    failed), then ``need`` as 0/1.
    """
    detach, score, threshold, listed = settings
    state = SMCState()
    state.replace(dict(zip(keys, values[: len(keys)])))
    args, kwargs = unflatten(inputs, values[len(keys) : -1])
    log_weights = values[-1]
    step_inputs = inputs._replace(args=args, kwargs=kwargs)
    layout = program.layout
    proposal = program.propose(state, model_fn, guide_fn, step_inputs, detach=detach)
    terms = log_weight_terms(proposal.model_trace, proposal.guide_trace, layout)
    score_value = score_terms(proposal.model_trace, proposal.guide_trace, layout) if score else None
    captured.update(state=dict(state), terms=terms, score=score_value, proposal=proposal)
    # weigh() and summarise() without their checks, which read the device; the status carries
    # them out instead, and a failed step is rerun on the handler path, which raises.
    increment, offset = centred_increment(terms, layout)
    if score_value is not None:
        increment = increment + score_value
    joint = log_weights + increment
    log_norm = torch.logsumexp(joint, dim=-1)
    new_log_weights = joint - log_norm.unsqueeze(-1)
    means, ess = moments(state, new_log_weights, layout)
    need = ess < threshold
    checked = [log_norm] + [mean.reshape(-1) for mean in means.values()]
    if not listed:
        # One number is finite exactly when every normaliser and mean is, unless finite ones
        # overflow in the sum; that case is rerun on the handler path, which decides.
        checked = [sum((mean.sum() for mean in means.values()), log_norm.sum()).reshape(1)]
    hold = constraints_hold((proposal.model_trace, proposal.guide_trace))
    if hold is not None:
        # Pyro's validation, which the recording runs without: log 1 = 0 while every parameter
        # and observation meets its constraints, log 0 = -inf (a failed step, rerun on the
        # handlers, which raise naming the parameter) otherwise.
        checked.append(hold.to(log_norm.dtype).log().reshape(1))
    status = torch.cat(checked + [need.to(log_norm.dtype)])
    captured["checks"] = status.shape[0] - need.shape[0]
    head = tuple(state.values()) + tuple(term for _, term in terms) + (() if score_value is None else (score_value,))
    return head + (new_log_weights, log_norm + offset, ess, need) + tuple(means.values()) + (status,)


# Up to this many normalisers and means, the status lists them and the host sums them (one
# concatenation); beyond, the recording sums them (a few ops, and a short read).
_LISTED = 64


def _listed(state: SMCState, layout) -> bool:
    """Whether the status lists the normalisers and means (``_LISTED``), from the particles'
    shapes before the step (read here, not in the trace, where sizes are traced values)."""
    dims = len(layout.particle_shape)
    return layout.num_filters * (1 + sum(math.prod(value.shape[dims:]) for value in state.values())) <= _LISTED


def _trace(function: Callable, flat: tuple) -> tuple[Callable | None, str | None]:
    """``torch.jit.trace`` of ``function`` without Pyro's validation, and the first sign that the
    recording would not generalise (a tensor read as a Python value, a switch of autograd's
    mode), or ``None``."""
    watch = GradModeWatch()
    with warnings.catch_warnings(record=True) as caught, pyro.validation_enabled(False):
        warnings.simplefilter("always")
        ignore_jit_deprecation()
        with watch:
            function = torch.jit.trace(function, flat, check_trace=False, strict=False)
    if watch.switched:
        # The recording would differentiate through what the program computed without
        # gradients (or the reverse): a trace records operations, not the grad mode.
        return None, "it switches autograd off or on inside the step (torch.no_grad(), torch.enable_grad(), inference mode)"
    if watch.value_read is not None:
        return None, f"it reads a tensor as a Python value ({watch.value_read})"
    for record in caught:
        if issubclass(record.category, torch.jit.TracerWarning):
            if "registered as constants" not in str(record.message):  # Pyro's scalar parameters: constants indeed
                return None, f"it reads a tensor as a Python value ({_first_line(record.message)})"
        else:
            # The program's own warnings reach the user as on the handler path.
            warnings.warn_explicit(record.message, record.category, record.filename, record.lineno, source=record.source)
    try:
        return simplified(function), None
    except Exception as error:  # noqa: BLE001 - a simplification that fails leaves the recording as traced
        logger.info("SMC's recording is replayed as traced: its simplification failed (%s)", _first_line(error))
        return function, None


def _name(fn: Callable | None) -> str | None:
    # repr() only when needed: it is the step's cost when every step asks.
    return None if fn is None else getattr(fn, "__qualname__", None) or repr(fn)


def _first_line(message: Any) -> str:
    text = str(message)
    return text.splitlines()[0] if text else ""
