"""A step of :class:`~pyro_smc.SMC` traced once and replayed: the Pyro program at tensor speed.

Running the user's ``step`` through Pyro's handlers costs the same at every step: building the
distributions, the message stack of ``pyro.sample``, plate broadcasting, the trace and its
log-densities. For most state-space models that work is the same at every step; only the tensors
change. So at the first regular step (``docs/engines/smc.md#the-compiled-step``) the engine records
the step's tensor computation with ``torch.jit.trace``: a function of the particles, the step's
tensor arguments and the parameters it read, returning the new particles and the step's
log-weight terms. Later steps call that recording. The noise is drawn inside the recording by the
same generator calls as on the handler path, so a compiled run consumes the random stream exactly
as an uncompiled one and gives the same particles, log-evidence and gradients to rounding.

A recording is only valid for a program that does the same thing at every step. What is checked:

* while recording, no tensor is turned into a Python number or branch (``float(x)``, ``if x > 0``:
  the trace would freeze that value), no tensor that requires grad is missed as an input, and the
  model and guide change no attribute (a step counter on ``self`` would be frozen) and add to no
  list or dict attribute (a replay skips the program's Python side effects);
* at the next regular step the recording runs side by side with the handler path (the random
  state rewound in between): same sites, same shapes, same numbers, or the run falls back;
* at every later step the step must look the same from outside: the same state keys, shapes and
  dtypes, the same tensor argument shapes and equal non-tensor arguments, the same grad mode.
  A step that does not (a missing observation, a batch whose filters observe different steps)
  runs on the handler path, and the recording serves the next regular step;
* a replayed step whose particles or log-weight terms hold NaN is rewound and rerun on the
  handler path, with Pyro's validation, so a bad step reports the same error either way.

What is not compiled: ``store_history`` (the smoother keeps each step's distributions), the
stop-gradient estimators (``gradient="stop_gradient"`` and ``"marginal_stop_gradient"``), and a
program the checks above reject. A fallback is silent with ``compile=None`` (the default) and
warns once with ``compile=True``; either way :attr:`CompiledStep.reason` and the ``pyro_smc``
logger say why.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, NamedTuple

import pyro
import torch
from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes, restore_attributes, rng_state, set_rng_state
from pyro_smc.infer.smc.importance import log_weight_terms, score_terms
from pyro_smc.infer.smc.state import SMCState
from pyro_smc.infer.smc.step import Proposal, StepInputs, StepProgram
from pyro_smc.tracing import param_sites

__all__ = ["CompiledStep", "CompileFallbackWarning", "Replayed"]

logger = logging.getLogger("pyro_smc")


class CompileFallbackWarning(UserWarning):
    """``SMC(compile=True)`` could not compile a step and ran the handler path instead."""


class Replayed(NamedTuple):
    """What a compiled step made: the new particles and the step's log-weight terms.

    Attributes:
        state: ``{key: tensor}`` the particles the model wrote.
        terms: ``[(site, (particle shape))]`` as :func:`~pyro_smc.infer.smc.importance.log_weight_terms` returns them.
        score: the score-function terms, or ``None``.
        proposal: the traces, at the recorded step only (its checks need them); ``None`` after.
    """

    state: dict[str, Tensor]
    terms: list[tuple[str, Tensor]]
    score: Tensor | None
    proposal: Proposal | None = None


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
        """Forgets the recording: a new run records its own (the program may have changed)."""
        self.reason: str | None = "compile=False" if self.mode is False else None
        self.compiled_steps = 0
        self._recording: _Recording | None = None
        self._params: tuple[str, ...] | None = None
        self._pending: tuple | None = None
        self._before: tuple | None = None
        self._verified = False

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def give_up(self, reason: str) -> None:
        """Falls back to the handler path for the rest of the run."""
        self.reason, self._recording, self._pending = reason, None, None
        logger.info("SMC runs on Pyro's handlers, not compiled: %s", reason)
        if self.mode is True:
            warnings.warn(CompileFallbackWarning(f"SMC(compile=True) runs on Pyro's handlers: {reason}"), stacklevel=5)

    def eligible(self, store_history: bool, inputs: StepInputs, score_function: bool) -> bool:
        """Whether this step may run compiled (a run-wide reason gives up at once)."""
        if not self.enabled:
            return False
        if store_history:
            self.give_up("store_history=True keeps each step's distributions for the smoother")
            return False
        if score_function:
            # The score terms' checks read tensors as Python values: not recordable as they stand.
            self.give_up("the stop-gradient estimators are not compiled yet")
            return False
        return inputs.t is not None and not inputs.predict_only and inputs.observed is None and inputs.active is None

    def run(self, program: StepProgram, state: SMCState, model_fn: Callable, guide_fn: Callable | None, inputs: StepInputs, detach: bool, score: bool) -> Replayed | None:
        """Records or replays the step; ``None``: the caller runs it on the handler path (and
        passes what it made to :meth:`observe`)."""
        tensors, signature = _flatten(state, inputs, (detach, score, torch.is_grad_enabled(), _name(model_fn), _name(guide_fn)))
        if signature is None:
            return None
        if self._params is None:
            # The first regular step runs on the handlers; observe() reads what it changed.
            self._before = _attribute_snapshot(program)
            return None
        recording = self._recording
        if recording is None:
            return self._record(program, state, model_fn, guide_fn, inputs, detach, score, tensors, signature)
        extra = _module_tensors(program)
        if recording.signature != signature or len(extra) != recording.extra:
            return None
        if not self._verified:
            rng = rng_state()
            self._pending = self._call(recording, tensors + extra)
            set_rng_state(rng)
            return None
        return self._replay(recording, state, tensors + extra)

    def observe(self, program: StepProgram, proposal: Proposal, state: SMCState, terms: list[tuple[str, Tensor]]) -> None:
        """Reads a regular step the handler path took: the parameters it read (the first such
        step) or, at the verifying step, whether the replay agreed with it."""
        if not self.enabled:
            return
        if self._params is None:
            names = param_sites(proposal.model_trace) + ([] if proposal.guide_trace is None else param_sites(proposal.guide_trace))
            self._params = tuple(dict.fromkeys(names))
            # A step that changes the program's attributes is given up on before any recording
            # runs it a second time.
            problem = _side_effect(self._before, program) if self._before is not None else None
            if problem is not None:
                self.give_up(problem)
            return
        if self._pending is None:
            return
        replayed, self._pending = self._pending, None
        problem = _disagreement(self._recording, replayed, _sites(proposal), dict(state), terms)
        if problem is not None:
            self.give_up(f"the step is not static: {problem}")
        else:
            self._verified = True

    # --- record, replay ----------------------------------------------------------------------------
    def _record(self, program, state, model_fn, guide_fn, inputs, detach, score, tensors, signature) -> Replayed | None:
        before = _attribute_snapshot(program)
        keys = tuple(state)
        store = dict(pyro.get_param_store().named_parameters())
        params = tuple(name for name in self._params if name in store)
        extra = _module_tensors(program)
        captured: dict[str, Any] = {}

        def step_function(*values):
            return _run_step(program, keys, values[: len(tensors)], inputs, model_fn, guide_fn, detach, score, captured)

        rng = rng_state()
        try:
            function, problem = _trace(step_function, tensors + extra + tuple(store[name] for name in params))
        except Exception as error:  # noqa: BLE001 - whatever stops the recording means: do not compile
            function, problem = None, f"the step could not be traced ({type(error).__name__}: {_first_line(error)})"
        if problem is None and not _clean(captured["state"], captured["terms"]):
            # Recorded without validation: a NaN here is rerun on the handler path, which reports it.
            set_rng_state(rng)
            return None
        if problem is None:
            problem = _side_effect(before, program)
        if problem is not None:
            # Rewound: the handler path takes this step as if nothing had been tried.
            set_rng_state(rng)
            _restore(before, program)
            self.give_up(problem)
            return None
        new, terms, score_value = captured["state"], captured["terms"], captured["score"]
        names = tuple(name for name, _ in terms)
        self._recording = _Recording(function, signature, tuple(new), names, score_value is not None, params, len(extra), _sites(captured["proposal"]))
        state.replace(new)
        return Replayed(dict(new), terms, score_value, captured["proposal"])

    def _replay(self, recording: _Recording, state: SMCState, tensors: tuple) -> Replayed | None:
        rng = rng_state()
        new, terms, score_value = self._call(recording, tensors)
        if not _clean(new, terms):
            # Rewound and rerun with Pyro's validation: the handler path names what went wrong.
            set_rng_state(rng)
            return None
        state.replace(new)
        self.compiled_steps += 1
        return Replayed(new, terms, score_value)

    def _call(self, recording: _Recording, tensors: tuple) -> tuple[dict[str, Tensor], list[tuple[str, Tensor]], Tensor | None]:
        """Calls the recording on ``tensors`` (the step's, then the model's and guide's own) and
        the parameters read now from the param store."""
        store = dict(pyro.get_param_store().named_parameters())
        out = recording.function(*tensors, *(store[name] for name in recording.params))
        out = out if isinstance(out, tuple) else (out,)
        k, m = len(recording.out_keys), len(recording.term_names)
        return dict(zip(recording.out_keys, out[:k])), list(zip(recording.term_names, out[k : k + m])), (out[k + m] if recording.has_score else None)


class _Recording(NamedTuple):
    """A traced step and what it was traced for."""

    function: Callable
    signature: tuple
    out_keys: tuple[str, ...]
    term_names: tuple[str, ...]
    has_score: bool
    params: tuple[str, ...]
    extra: int
    sites: tuple


def _run_step(program, keys, values, inputs, model_fn, guide_fn, detach, score, captured) -> tuple[Tensor, ...]:
    """The step as a tensor function: the particles and tensor arguments in, the new particles,
    the log-weight terms and the score terms out (what :func:`torch.jit.trace` records)."""
    state = SMCState()
    state.replace(dict(zip(keys, values[: len(keys)])))
    args, kwargs = _unflatten(inputs, values[len(keys) :])
    step_inputs = inputs._replace(args=args, kwargs=kwargs)
    layout = program.layout
    proposal = program.propose(state, model_fn, guide_fn, step_inputs, detach=detach)
    terms = log_weight_terms(proposal.model_trace, proposal.guide_trace, layout)
    score_value = score_terms(proposal.model_trace, proposal.guide_trace, layout) if score else None
    captured.update(state=dict(state), terms=terms, score=score_value, proposal=proposal)
    return tuple(state.values()) + tuple(term for _, term in terms) + (() if score_value is None else (score_value,))


def _trace(function: Callable, flat: tuple) -> tuple[Callable | None, str | None]:
    """``torch.jit.trace`` of ``function`` without Pyro's validation, and the first sign that the
    recording would not generalise (a tensor read as a Python value), or ``None``."""
    with warnings.catch_warnings(record=True) as caught, pyro.validation_enabled(False):
        warnings.simplefilter("always")
        function = torch.jit.trace(function, flat, check_trace=False, strict=False)
    for record in caught:
        if issubclass(record.category, torch.jit.TracerWarning):
            if "registered as constants" not in str(record.message):  # Pyro's scalar parameters: constants indeed
                return None, f"it reads a tensor as a Python value ({_first_line(record.message)})"
        elif not (issubclass(record.category, DeprecationWarning) and "torch.jit" in str(record.message)):
            # The program's own warnings reach the user as on the handler path.
            warnings.warn_explicit(record.message, record.category, record.filename, record.lineno, source=record.source)
    return function, None


def _flatten(state: SMCState, inputs: StepInputs, settings: tuple) -> tuple[tuple[Tensor, ...], tuple | None]:
    """The step's tensors (the particles, then the tensor arguments) and what a recording must
    match: their shapes and dtypes, the other arguments' values, and ``settings``."""
    tensors, shape = [], []
    for key, value in state.items():
        if not isinstance(value, Tensor):
            return (), None
        tensors.append(value)
        shape.append((key, value.shape, value.dtype, value.device, value.requires_grad))
    others = []
    for position, value in list(enumerate(inputs.args)) + sorted(inputs.kwargs.items()):
        if isinstance(value, Tensor):
            tensors.append(value)
            shape.append((position, value.shape, value.dtype, value.device, value.requires_grad))
        elif value is None or isinstance(value, (bool, int, float, str)):
            others.append((position, value))
        else:
            return (), None  # an argument whose equality a recording cannot check
    return tuple(tensors), (tuple(shape), tuple(others), settings)


def _unflatten(inputs: StepInputs, tensors: tuple) -> tuple[tuple, dict]:
    """``inputs``' arguments with their tensors replaced, in :func:`_flatten`'s order."""
    it = iter(tensors)
    args = tuple(next(it) if isinstance(value, Tensor) else value for value in inputs.args)
    kwargs = {key: next(it) if isinstance(value, Tensor) else value for key, value in sorted(inputs.kwargs.items())}
    return args, kwargs


def _module_tensors(program: StepProgram) -> tuple[Tensor, ...]:
    """The model's and guide's own tensors, read afresh at every step: an ``nn.Module``'s
    parameters and buffers, and any tensor attribute (``model.A = theta``, which may require
    grad). Pyro sees only ``pyro.param``; the recording must take these as inputs too."""
    seen: dict[int, Tensor] = {}
    for owner in (program.model, program.guide):
        if owner is None:
            continue
        found = [v for v in vars(owner).values() if isinstance(v, Tensor)]
        if isinstance(owner, torch.nn.Module):
            found += list(owner.parameters()) + list(owner.buffers())
        for tensor in found:
            seen.setdefault(id(tensor), tensor)
    return tuple(seen.values())


def _sites(proposal: Proposal) -> tuple:
    """A trace's shape: each sample site's name, distribution type, value shape and observedness."""
    traces = [proposal.model_trace] + ([] if proposal.guide_trace is None else [proposal.guide_trace])
    return tuple(
        (name, type(site["fn"]).__name__, tuple(site["value"].shape), site["is_observed"])
        for trace in traces
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
    )


def _disagreement(recording: _Recording, replayed: tuple, sites: tuple, state: dict, terms: list) -> str | None:
    """What differs between a replayed step and the same step on the handler path, or ``None``."""
    if sites != recording.sites:
        return "its sample sites, their distributions or shapes changed between steps"
    new, replayed_terms, _ = replayed
    if tuple(state) != tuple(new) or [name for name, _ in terms] != [name for name, _ in replayed_terms]:
        return "its state keys or scored sites changed between steps"
    pairs = [(state[key], new[key], f"state['{key}']") for key in new] + [(a, b, f"site '{n}'") for (n, a), (_, b) in zip(terms, replayed_terms)]
    for eager, replay, what in pairs:
        if eager.shape != replay.shape or not torch.allclose(eager.detach(), replay.detach(), rtol=1e-5, atol=1e-6, equal_nan=True):
            return f"the replayed {what} differs from the handler path's"
    return None


def _attribute_snapshot(program: StepProgram) -> tuple:
    """The model's and guide's plain attributes and shallow copies of their list, dict and set
    attributes (a step that changes one has a side effect a replay would skip)."""
    owners = (program.model, program.guide)
    return tuple(
        (plain_attributes(owner), {k: v.copy() for k, v in vars(owner).items() if isinstance(v, (list, dict, set)) and not k.startswith("_")})
        if owner is not None
        else (None, {})
        for owner in owners
    )


def _side_effect(before: tuple, program: StepProgram) -> str | None:
    """What a step changed on the model or guide since :func:`_attribute_snapshot`, or ``None``."""
    for name, owner, (attributes, containers) in zip(("model", "guide"), (program.model, program.guide), before):
        if owner is None:
            continue
        now = plain_attributes(owner)
        for key in set(attributes) | set(now):
            a, b = attributes.get(key), now.get(key)
            if a is not b and not (isinstance(a, (bool, int, float, str)) and a == b):
                return f"the step changes the {name}'s attribute self.{key}; a replayed step would not"
        if any(len(vars(owner).get(key, ())) != len(saved) for key, saved in containers.items()):
            return f"the step adds to a list or dict attribute of the {name}; a replayed step would not"
    return None


def _restore(before: tuple, program: StepProgram) -> None:
    """Puts :func:`_attribute_snapshot` back (the step is rerun on the handlers)."""
    for owner, (attributes, containers) in zip((program.model, program.guide), before):
        if owner is None:
            continue
        restore_attributes(owner, attributes)
        for key, saved in containers.items():
            value = vars(owner).get(key)
            if isinstance(value, (list, dict, set)):
                value.clear()
                if isinstance(value, list):
                    value.extend(saved)
                else:
                    value.update(saved)


def _clean(state: dict[str, Tensor], terms: list[tuple[str, Tensor]]) -> bool:
    """No NaN in the particles or the terms (a term may be ``-inf``: a particle of zero weight)."""
    flags = [torch.isnan(value).any() for value in list(state.values()) + [term for _, term in terms] if value.is_floating_point()]
    # One device read for the whole step, not one per tensor.
    return not flags or not bool(torch.stack(flags).any())


def _name(fn: Callable | None) -> str | None:
    return None if fn is None else getattr(fn, "__qualname__", repr(fn))


def _first_line(message: Any) -> str:
    text = str(message)
    return text.splitlines()[0] if text else ""
