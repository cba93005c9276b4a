"""The Python state a step of :class:`~pyro_smc.SMC` can read or change, for its compiled step.

A recording (:mod:`~pyro_smc.infer.smc.compiled`) is a tensor function: every Python value the
program read while it was recorded is baked in, and a replay runs none of the program's Python.
So a recording is only valid while that Python state stays put. Counting time on ``self`` is
the obvious way to break it, and :func:`~pyro_smc.infer.smc.static_checks.side_effect` sees
that; but a step can keep its clock anywhere it can reach: an entry of a dict attribute, an
attribute of a helper object, a closure variable, a module global, an ``itertools.count``, an
in-place counter tensor, Python's or NumPy's random state, or the particles it was handed
(``state["x"] += ...``). A user can also change a constant between two calls of
:meth:`~pyro_smc.SMC.step`. Each of those gave silently wrong answers when only ``self``'s
plain attributes were watched.

:func:`snapshot` walks what the model and guide reach: their attributes (into dicts, lists,
tuples, sets, plain objects and submodules), the closures and referenced globals of their
classes' functions and of every function found on the way, and the class attributes; it notes
scalars by value, tensors by identity and version (an in-place change moves the version),
iterators by their pickled position, and the global random states. :func:`first_change` names
the first difference between two snapshots. Objects of torch's and Pyro's own classes other than
modules are taken by identity only: their internals (lazily cached properties) change without
meaning anything. :class:`GradModeWatch` finds a step that switches autograd off or on inside
(``torch.no_grad()``): a trace records the operations, not the mode, so its replay would
differentiate through them.

Example:
    >>> class Clock:
    ...     def __init__(self):
    ...         self.t = 0
    >>> class Model:
    ...     def __init__(self):
    ...         self.clock = Clock()
    ...     def step(self, state, y=None):
    ...         self.clock.t += 1
    >>> model = Model()
    >>> before = snapshot((model, None))
    >>> model.step({})
    >>> first_change(before, snapshot((model, None)))
    "the model's self.clock.t"
"""

from __future__ import annotations

import collections
import functools
import os
import random
import sys
import sysconfig
import types
import warnings
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["GradModeWatch", "Snapshot", "first_change", "snapshot", "stale"]

# Beyond this many objects visited the walk stops and the snapshot says it could not check.
_MAX_NODES = 20000
_MAX_DEPTH = 8
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
# NumPy arrays up to this size are compared by content (hashed at every check), larger ones not.
_MAX_ARRAY_BYTES = 1 << 16
# The internals of torch's and Pyro's modules (hooks, Pyro's parameter bookkeeping and caches):
# the walk reads a module's buffers, submodules and the user's own attributes.
_MODULE_KEYS = {"_buffers", "_modules"}
_MODULE_INTERNALS: set[str] | None = None
# Objects of these packages' own classes are compared by identity, not walked.
_LIBRARIES = ("torch", "pyro", "numpy", "builtins", "functools", "collections", "typing", "abc", "weakref", "itertools")
# Functions of these packages are not walked: their globals are imports and constants.
_OWN_CODE = ("torch", "pyro", "pyro_smc", "numpy")


def _module_internals() -> set[str]:
    global _MODULE_INTERNALS
    if _MODULE_INTERNALS is None:
        from pyro.nn import PyroModule

        # Parameters are left out too: Pyro registers a PyroParam's unconstrained tensor at its
        # first read, and a recording takes every parameter as an input.
        _MODULE_INTERNALS = (set(vars(torch.nn.Module())) | set(vars(PyroModule()))) - _MODULE_KEYS
    return _MODULE_INTERNALS


class Snapshot(NamedTuple):
    """What :func:`snapshot` saw.

    Attributes:
        leaves: ``{path: key}``, ``path`` naming a value (``"the model's self.clock.t"``) and
            ``key`` what a change would alter (a scalar's value, an object's identity, a
            container's length, a tensor's identity and version).
        checks: ``(path, fetch, key)`` in the order walked (a container before its contents),
            ``fetch()`` reading the value at ``path`` now: :func:`stale` compares a snapshot
            with the program without walking it again.
        tensors: ``(path, tensor, version)`` of the tensors handed in as ``extra`` (the step's
            particles and arguments), whose version a step that writes into them moves.
        problem: what the walk could not check (an iterator without a readable position, too
            much state), or ``None``.
    """

    leaves: dict[str, Any]
    checks: list
    tensors: tuple
    problem: str | None


def snapshot(owners: tuple[Any, Any], extra: tuple[tuple[str, Tensor], ...] = (), inputs: frozenset[int] = frozenset(), rng: bool = True) -> Snapshot:
    """The Python state reachable from the model and guide ``owners``.

    Args:
        owners: ``(model, guide)``, either may be ``None``.
        extra: named tensors whose versions are noted too (the step's particles and arguments).
        inputs: ids of tensors to note without identity or version: the recording's inputs,
            which may be replaced or edited between steps.
        rng: whether Python's and NumPy's global random states are noted (a step that draws from
            them is not static; user code between steps may draw from them freely).

    Returns:
        A :class:`Snapshot`.
    """
    walker = _Walker(inputs)
    for name, owner in zip(("the model's", "the guide's"), owners):
        if owner is None:
            continue
        walker.walk(owner, f"{name} self", 0, lambda owner=owner: owner)
        for cls in type(owner).__mro__:
            if _library(cls):
                continue
            for key in list(vars(cls)):
                if not key.startswith("__"):
                    fetch = _attribute(cls, key, unwrap=True)
                    walker.walk(fetch(), f"{name} class attribute {cls.__name__}.{key}", 1, fetch)
    if rng:
        walker.leaves["Python's random module"] = hash(random.getstate())
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            _, keys, pos, has_gauss, cached = numpy.random.get_state()
            walker.leaves["NumPy's global random state"] = (pos, has_gauss, cached, hash(keys.tobytes()))
    tensors = tuple((path, t, t._version) for path, t in extra)
    return Snapshot(walker.leaves, walker.checks, tensors, walker.problem)


def first_change(before: Snapshot, after: Snapshot) -> str | None:
    """The first value that differs between two snapshots (by its path), or ``None``."""
    for path, tensor, version in before.tensors:
        if tensor._version != version:
            return f"{path}, written in place"
    if before.leaves == after.leaves:
        return None
    for path in list(before.leaves) + [p for p in after.leaves if p not in before.leaves]:
        old, new = before.leaves.get(path, _MISSING), after.leaves.get(path, _MISSING)
        if old != new:
            in_place = isinstance(old, tuple) and isinstance(new, tuple) and old[0] == new[0] == "tensor" and old[1] == new[1]
            return f"{path}, written in place" if in_place else path
    return None


def stale(before: Snapshot) -> str | None:
    """The first value of ``before`` that is no longer what it was, or ``None``: the check of
    :func:`first_change` against the program as it is now, in a few microseconds for a small
    model (no walk; a container replaced is caught before its old contents are read)."""
    for path, fetch, key in before.checks:
        value = fetch()
        kind = key[0]
        # The common cases without building a key: an object, a scalar, a tensor, an input.
        if kind == "object":
            same = value is key[1].obj
        elif kind is float or kind is int or kind is bool or kind is str:
            same = type(value) is kind and (value == key[1] or value != value and key[1] == "nan")
        elif kind == "tensor":
            same = value is key[1].obj and value._version == key[2]
        elif kind == "input":
            same = isinstance(value, Tensor)
        else:
            same = _key(value, False) == key
        if not same:
            return path
    return None


_MISSING = object()


class _Same:
    """An object compared by identity (and kept alive, so that its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _key(value: Any, is_input: bool) -> Any:
    """What a change of ``value`` itself (not of its contents) alters; ``None`` for an iterator
    whose position cannot be read."""
    if isinstance(value, _SCALARS):
        return (type(value), value if value == value else "nan")
    if isinstance(value, Tensor):
        return ("input",) if is_input else ("tensor", _Same(value), value._version)
    if _is_ndarray(value):
        # By content: an array written in place between steps keeps its identity.
        content = hash(value.tobytes()) if value.nbytes <= _MAX_ARRAY_BYTES else "too large"
        return ("ndarray", _Same(value), value.shape, str(value.dtype), content)
    if isinstance(value, (list, tuple, collections.deque)):
        if all(isinstance(v, _SCALARS) for v in value):
            return (type(value), _Same(value), hash(tuple(v if v == v else "nan" for v in value)))
        return (type(value), _Same(value), len(value))
    if isinstance(value, dict):
        return (type(value), _Same(value), len(value))
    if isinstance(value, (set, frozenset)):
        return (type(value), _Same(value), len(value), hash(frozenset(v for v in value if isinstance(v, _SCALARS))))
    if hasattr(type(value), "__next__") and not isinstance(value, torch.nn.Module):
        # An iterator's position, where pickling reveals it (itertools.count, list iterators);
        # a generator's cannot be read.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # itertools' pickling, from Python 3.12
                return ("iterator", _Same(value), repr(value.__reduce__()))
        except Exception:  # noqa: BLE001 - whatever cannot be pickled has no readable position
            return None
    return ("object", _Same(value))


def _attribute(obj: Any, key: str, unwrap: bool = False) -> Callable[[], Any]:
    def fetch() -> Any:
        value = vars(obj).get(key, _MISSING)
        return getattr(value, "__func__", value) if unwrap else value

    return fetch


def _item(container: Any, key: Any) -> Callable[[], Any]:
    if isinstance(container, dict):
        return lambda: container.get(key, _MISSING)
    return lambda: container[key] if key < len(container) else _MISSING


def _cell(cell: Any) -> Callable[[], Any]:
    def fetch() -> Any:
        try:
            return cell.cell_contents
        except ValueError:  # emptied
            return _MISSING

    return fetch


def _library(obj_type: type) -> bool:
    """Whether ``obj_type`` is a class of torch, Pyro or Python's own (C-level, underscored) modules."""
    top = (obj_type.__module__ or "").split(".")[0]
    return top in _LIBRARIES or (top.startswith("_") and top != "__main__")


class _Walker:
    def __init__(self, inputs: frozenset[int]):
        self.inputs = inputs
        self.leaves: dict[str, Any] = {}
        self.checks: list = []
        self.seen: set[int] = set()
        self.problem: str | None = None
        self.nodes = 0

    def walk(self, value: Any, path: str, depth: int, fetch: Callable[[], Any]) -> None:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            self.problem = self.problem or "the model reaches more Python state than a recording can check"
            return
        key = _key(value, isinstance(value, Tensor) and id(value) in self.inputs)
        if key is None:
            self.problem = self.problem or f"{path} is an iterator whose position a recording cannot check"
            return
        if key[0] == "ndarray" and key[-1] == "too large":
            self.problem = self.problem or f"{path} is a NumPy array too large to check between steps"
            return
        self.leaves[path] = key
        self.checks.append((path, fetch, key))
        if isinstance(value, (_SCALARS, Tensor)) or key[0] == "iterator" or id(value) in self.seen or depth > _MAX_DEPTH:
            return
        self.seen.add(id(value))
        if isinstance(value, (list, tuple, collections.deque)):
            if not all(isinstance(v, _SCALARS) for v in value):
                for i, item in enumerate(value):
                    self.walk(item, f"{path}[{i}]", depth + 1, _item(value, i))
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if not (isinstance(key, str) and key.startswith("__")):
                    self.walk(item, f"{path}[{key!r}]", depth + 1, _item(value, key))
        elif isinstance(value, types.FunctionType):
            self._function(value, path, depth)
        elif isinstance(value, types.MethodType):
            self._function(value.__func__, path, depth)
        elif isinstance(value, torch.nn.Module):
            internals = _module_internals()
            for key, item in list(vars(value).items()):
                if key in _MODULE_KEYS:  # buffers and submodules, by their attribute names
                    for name, member in list(item.items()):
                        self.walk(member, f"{path}.{name}", depth + 1, _item(item, name))
                elif key not in internals:
                    self.walk(item, f"{path}.{key}", depth + 1, _attribute(value, key))
        elif isinstance(value, functools.partial):
            self.walk(value.func, f"{path}.func", depth + 1, lambda: value.func)
            for i, item in enumerate(value.args):
                self.walk(item, f"{path}.args[{i}]", depth + 1, _item(value.args, i))
            for name, item in value.keywords.items():
                self.walk(item, f"{path}.keywords[{name!r}]", depth + 1, _item(value.keywords, name))
        elif isinstance(value, (set, frozenset, types.ModuleType, type)) or _library(type(value)):
            return  # by identity (sets: and their scalars)
        elif hasattr(value, "__dict__"):
            for key, item in list(vars(value).items()):
                self.walk(item, f"{path}.{key}", depth + 1, _attribute(value, key))

    def _function(self, fn: types.FunctionType, path: str, depth: int) -> None:
        """A function's closure variables and the globals its code names (recursively), and
        those of the function a decorator wraps (``functools.wraps``, Pyro's ``pyro_method``)."""
        wrapped = getattr(fn, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType) and id(wrapped) not in self.seen:
            self.seen.add(id(wrapped))
            self._function(wrapped, path, depth)
        if (fn.__module__ or "").split(".")[0] in _OWN_CODE:
            return
        for i, default in enumerate(fn.__defaults__ or ()):
            self.walk(default, f"default {i} of {fn.__qualname__}", depth + 1, _item(fn.__defaults__, i))
        for name, default in (fn.__kwdefaults__ or {}).items():
            self.walk(default, f"default {name!r} of {fn.__qualname__}", depth + 1, _item(fn.__kwdefaults__, name))
        if fn.__closure__:
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                fetch = _cell(cell)
                contents = fetch()
                if contents is not _MISSING:
                    self.walk(contents, f"closure variable {name!r} of {fn.__qualname__}", depth + 1, fetch)
        names = _global_names(fn.__code__)
        for name in names:
            if name in fn.__globals__:
                fetch = _item(fn.__globals__, name)
                value = fetch()
                self.walk(value, f"global {name!r} of {fn.__module__}", depth + 1, fetch)
                if isinstance(value, types.ModuleType) and _user_module(value):
                    # A user's module read as module.name: the names the code reads from it
                    # (co_names holds attribute names with the globals).
                    for attribute in sorted(names & vars(value).keys()):
                        self.walk(getattr(value, attribute), f"{name}.{attribute}", depth + 1, _attribute(value, attribute))


def _is_ndarray(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "ndarray" and cls.__module__ == "numpy"


def _user_module(module: types.ModuleType) -> bool:
    """Whether ``module`` is the user's own: neither the standard library's nor torch's, Pyro's,
    NumPy's or this package's, whose attributes are functions and constants."""
    top = module.__name__.split(".")[0]
    return top not in _LIBRARIES and top not in _OWN_CODE and not _standard_library(module) and not top.startswith("_")


def _standard_library(module: types.ModuleType) -> bool:
    names = getattr(sys, "stdlib_module_names", None)  # Python 3.10+
    if names is not None:
        return module.__name__.split(".")[0] in names
    # Python 3.9: by where the module lives (built-in modules have no file).
    path = getattr(module, "__file__", None)
    return path is None or os.path.realpath(path).startswith(os.path.realpath(sysconfig.get_paths()["stdlib"]))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


class GradModeWatch(TorchFunctionMode):
    """Active while a step is recorded: notes an operation run under another autograd mode than
    the step began in (``torch.no_grad()``, ``torch.enable_grad()``, inference mode), which a
    trace does not record.

    Example:
        >>> watch = GradModeWatch()
        >>> with watch:
        ...     with torch.no_grad():
        ...         _ = torch.ones(2) * 2
        >>> watch.switched
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.grad_enabled = torch.is_grad_enabled()
        self.switched = False
        # The first operation that read a tensor's values into a Python value without the
        # tracer's warning (torch.equal, torch.allclose, torch.is_nonzero), or None.
        self.value_read: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.switched and (torch.is_grad_enabled() != self.grad_enabled or torch.is_inference_mode_enabled()):
            self.switched = not _called_by_library()
        if self.value_read is None and getattr(func, "__name__", "") in _SILENT_VALUE_READS:
            # A Python truth value computed from tensors is a constant of the recording.
            self.value_read = func.__name__
        return func(*args, **(kwargs or {}))


# Operations that compute a Python truth value from tensors' values without the tracer's warning
# (bool(), item() and the like warn, which the recording's check reads).
_SILENT_VALUE_READS = frozenset({"equal", "allclose", "is_nonzero"})


# torch's wrappers between a caller and the operation it calls (Tensor's Python dunders).
_WRAPPERS = ("torch._tensor", "torch.overrides", "torch.utils._python_dispatch")


def _called_by_library() -> bool:
    """Whether the operation was called by torch's or Pyro's own code: ``Distribution.sample``
    draws under ``torch.no_grad()``, ``torch.broadcast_shapes`` computes under it, and neither is a
    switch of the program's gradients (a draw of a distribution without ``rsample`` carries none
    either way). An operation the program itself calls under ``no_grad`` is one."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_WRAPPERS):
        frame = frame.f_back
    module = "" if frame is None else frame.f_globals.get("__name__", "")
    return module.split(".")[0] in ("torch", "pyro")

