"""What a recorded step of :class:`~pyro_smc.SMC` must match to be replayed
(``docs/engines/smc.md#the-compiled-step``): the step's tensors and signature, the program's
constants, its sites, and the side effects a replay would skip.

Each function here is a check or a piece of bookkeeping of :mod:`~pyro_smc.infer.smc.compiled`;
none records or replays anything.
"""

from __future__ import annotations

from typing import Any

import pyro
import torch
from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes, restore_attributes
from pyro_smc.infer.smc import counters as step_counters
from pyro_smc.infer.smc.python_state import Snapshot, first_change, snapshot
from pyro_smc.infer.smc.state import SMCState
from pyro_smc.infer.smc.step import Proposal, StepInputs, StepProgram

__all__ = [
    "attribute_snapshot",
    "between_snapshot",
    "changes",
    "clean",
    "constants",
    "counted_constants",
    "disagreement",
    "flatten",
    "module_tensors",
    "owners",
    "renamed_sites",
    "restore",
    "shapes",
    "side_effect",
    "site_and_param_names",
    "sites",
    "step_snapshot",
    "structure",
    "unflatten",
]


def constants(program: StepProgram) -> tuple:
    """What a recording bakes in and a later run must match: the model's and guide's scalar
    attributes (tensors are inputs) and the names in the param store."""
    owners = [{k: v for k, v in (plain_attributes(o) or {}).items() if not isinstance(v, Tensor)} for o in (program.model, program.guide)]
    return tuple(sorted(owner.items()) for owner in owners) + (tuple(pyro.get_param_store().keys()),)


def structure(program: StepProgram) -> tuple:
    """What a recording made for another model object of the same classes must match beyond
    :func:`constants`: for the model, the guide and each of their submodules, its class, its
    public scalar attributes by value and its other public attributes (functions, containers,
    objects) by identity, so that two objects built with different callables or holding different
    containers (where a tensor may hide from the recording's inputs) never share a recording.
    Tensors are the recording's inputs; underscored attributes are torch's and Pyro's own. An
    identity the allocator reuses for a new object can match an old one: the verifying step,
    which every shared recording passes first, is what rules a wrong match out."""
    out = []
    for owner in (program.model, program.guide):
        if owner is None:
            out.append(None)
            continue
        objects = owner.named_modules() if isinstance(owner, torch.nn.Module) else [("", owner)]
        described = []
        for name, obj in objects:
            attributes = getattr(obj, "__dict__", {})
            public = sorted((k, v) for k, v in attributes.items() if not k.startswith("_") and not isinstance(v, Tensor))
            values = tuple((k, v if v is None or isinstance(v, (bool, int, float, str)) else ("id", id(v))) for k, v in public)
            described.append((name, type(obj), values))
        out.append((type(owner), tuple(described)))
    return tuple(out)


def shapes(tensors: tuple[Tensor, ...]) -> tuple:
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def flatten(state: SMCState, inputs: StepInputs, settings: tuple) -> tuple[tuple[Tensor, ...], tuple | None]:
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


def unflatten(inputs: StepInputs, tensors: tuple) -> tuple[tuple, dict]:
    """``inputs``' arguments with their tensors replaced, in :func:`flatten`'s order."""
    it = iter(tensors)
    args = tuple(next(it) if isinstance(value, Tensor) else value for value in inputs.args)
    kwargs = {key: next(it) if isinstance(value, Tensor) else value for key, value in sorted(inputs.kwargs.items())}
    return args, kwargs


def module_tensors(program: StepProgram) -> tuple[Tensor, ...]:
    """The model's and guide's own tensors, read afresh at every step: an ``nn.Module``'s
    parameters and buffers, and any tensor attribute of it or of its submodules
    (``model.A = theta``, ``model.obs.scale = s``, which may require grad). Pyro sees only
    ``pyro.param``; the recording must take these as inputs too, or a new value would be a
    constant of the recording (caught, but recorded afresh at every run)."""
    seen: dict[int, Tensor] = {}
    for owner in (program.model, program.guide):
        if owner is None:
            continue
        holders = list(owner.modules()) if isinstance(owner, torch.nn.Module) else [owner]
        found = [v for holder in holders for v in vars(holder).values() if isinstance(v, Tensor)]
        if isinstance(owner, torch.nn.Module):
            found += list(owner.parameters()) + list(owner.buffers())
        for tensor in found:
            seen.setdefault(id(tensor), tensor)
    return tuple(seen.values())


def sites(proposal: Proposal) -> tuple:
    """A trace's shape: each sample site's name, distribution type, value shape and observedness."""
    traces = [proposal.model_trace] + ([] if proposal.guide_trace is None else [proposal.guide_trace])
    return tuple(
        (name, type(site["fn"]).__name__, tuple(site["value"].shape), site["is_observed"])
        for trace in traces
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
    )


def disagreement(recorded: tuple, new: dict, replayed_terms: list, sites: tuple, state: dict, terms: list) -> str | None:
    """What differs between a replayed step (its particles ``new`` and terms, the recording's
    ``recorded`` sites) and the same step on the handler path, or ``None``."""
    if sites != recorded:
        return "its sample sites, their distributions or shapes changed between steps"
    if tuple(state) != tuple(new) or [name for name, _ in terms] != [name for name, _ in replayed_terms]:
        return "its state keys or scored sites changed between steps"
    pairs = [(state[key], new[key], f"state['{key}']") for key in new] + [(a, b, f"site '{n}'") for (n, a), (_, b) in zip(terms, replayed_terms)]
    for eager, replay, what in pairs:
        if eager.shape != replay.shape or not torch.allclose(eager.detach(), replay.detach(), rtol=1e-5, atol=1e-6, equal_nan=True):
            return f"the replayed {what} differs from the handler path's"
    return None


def attribute_snapshot(program: StepProgram) -> tuple:
    """The model's and guide's plain attributes and shallow copies of their list, dict and set
    attributes (a step that changes one has a side effect a replay would skip)."""
    owners = (program.model, program.guide)
    return tuple(
        (plain_attributes(owner), {k: v.copy() for k, v in vars(owner).items() if isinstance(v, (list, dict, set)) and not k.startswith("_")})
        if owner is not None
        else (None, {})
        for owner in owners
    )


def side_effect(before: tuple, program: StepProgram) -> str | None:
    """What a step changed on the model or guide since :func:`attribute_snapshot`, or ``None``."""
    for name, owner, (attributes, containers) in zip(("model", "guide"), (program.model, program.guide), before):
        if owner is None:
            continue
        now = plain_attributes(owner)
        for key in set(attributes) | set(now):
            a, b = attributes.get(key), now.get(key)
            if a is not b and not (isinstance(a, (bool, int, float, str)) and a == b):
                return f"the step changes the {name}'s attribute self.{key}; a replayed step would not"
        if any(len(vars(owner).get(key, ())) != len(saved) for key, saved in containers.items()):
            return f"the step changes a list, dict or set attribute of the {name}; a replayed step would not"
    return None


def restore(before: tuple, program: StepProgram) -> None:
    """Puts :func:`attribute_snapshot` back (the step is rerun on the handlers)."""
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


def clean(state: dict[str, Tensor], terms: list[tuple[str, Tensor]]) -> bool:
    """No NaN in the particles or the terms (a term may be ``-inf``: a particle of zero weight)."""
    flags = [torch.isnan(value).any() for value in list(state.values()) + [term for _, term in terms] if value.is_floating_point()]
    # One device read for the whole step, not one per tensor.
    return not flags or not bool(torch.stack(flags).any())


def step_snapshot(program: StepProgram, state: SMCState | None, inputs: StepInputs | None) -> Snapshot:
    """The Python state a step may change (:func:`~pyro_smc.infer.smc.python_state.snapshot`),
    with the versions of the particles and tensor arguments handed to it (``state`` and
    ``inputs``; ``None`` after the step, when the versions are read off the snapshot before)."""
    extra: list[tuple[str, Tensor]] = []
    if state is not None:
        extra += [(f"state[{key!r}]", value) for key, value in state.items() if isinstance(value, Tensor)]
    if inputs is not None:
        extra += [(f"the step's argument {position}", value) for position, value in enumerate(inputs.args) if isinstance(value, Tensor)]
        extra += [(f"the step's argument {key!r}", value) for key, value in inputs.kwargs.items() if isinstance(value, Tensor)]
    return snapshot((program.model, program.guide), tuple(extra))


def between_snapshot(program: StepProgram, inputs: tuple[Tensor, ...], counters: step_counters.Counters) -> Snapshot:
    """The Python state a recording bakes in, as compared from one step to the next: the
    recording's tensor ``inputs`` (which may change), the global random states (which code
    between steps may draw from) and the step ``counters`` (which the replays advance) left out."""
    taken = snapshot(owners(program), inputs=frozenset(map(id, inputs)), rng=False)
    skip = step_counters.paths(counters)
    if not skip:
        return taken
    leaves = {path: key for path, key in taken.leaves.items() if path not in skip}
    return taken._replace(leaves=leaves, checks=[check for check in taken.checks if check[0] not in skip])


def owners(program: StepProgram) -> tuple[Any, Any]:
    """``(model, guide)``."""
    return program.model, program.guide


def counted_constants(program: StepProgram, counters: step_counters.Counters) -> tuple:
    """:func:`constants` without the step ``counters``, whose
    values differ from run to run and step to step."""
    found = constants(program)
    names = [{key for index, key in counters if index == owner} for owner in (0, 1)]
    return tuple(tuple(item for item in attributes if item[0] not in skip) for attributes, skip in zip(found[:2], names)) + found[2:]


def site_and_param_names(proposal: Proposal) -> list[str]:
    """The names of a step's sample and param sites, model and guide."""
    traces = [proposal.model_trace] + ([] if proposal.guide_trace is None else [proposal.guide_trace])
    return [name for trace in traces for name, site in trace.nodes.items() if site["type"] in ("sample", "param")]


def renamed_sites(recorded: tuple, counted: tuple) -> tuple:
    """:func:`sites` with the counters' values masked in the names."""
    if not counted:
        return recorded
    return tuple((step_counters.renamed(name, counted), *rest) for name, *rest in recorded)


def changes(before: Snapshot, after: Snapshot) -> str | None:
    """What a step changed, as a reason not to compile it, or ``None``."""
    changed = first_change(before, after)
    if changed is None:
        return None
    hint = " (assign a new tensor instead)" if changed.endswith("written in place") else ""
    return f"the step changes {changed}{hint}; a replayed step would not"
