"""Step counters in a compiled step of :class:`~pyro_smc.SMC`: ``self.t``, kept to name sites.

``pyro.infer.SMCFilter`` models count their steps on ``self`` to name each step's sites
(``pyro.sample(f"x_{self.t}", ...)``, then ``self.t += 1``), and so do this package's own
models. A recording would freeze such a counter, so a step that changes an attribute is not
compiled (:mod:`~pyro_smc.infer.smc.compiled`): which left every model of that kind, the
package's own included, on Pyro's handlers. A counter read only to name sites changes no
number, though, and a replay can advance it itself.

So an integer attribute of the model or guide that the first regular step advances by exactly
one is a candidate counter (:func:`counters_of`). At the recorded step it is replaced by a
:class:`NameCounter`, which formats as the number and adds one but raises on any other use
(``if t >= 10``, ``covariates[t]``, ``t == 0``): a step that reads its counter as a number is
not compiled. A step that records with it only named its sites with it; each replayed step then
advances the counter by one (:func:`advance`), as the program would, and the checks of the
compiled step compare the program's state with the counters held one step back
(:func:`held_back`) and site names with the counter's digits masked (:func:`renamed`).

Example:
    >>> class Model:
    ...     def __init__(self):
    ...         self.t, self.scale = 0, 1.0
    >>> model, guide = Model(), None
    >>> before = ({"t": 0, "scale": 1.0}, {}), (None, {})
    >>> model.t = 1  # the first regular step advanced it
    >>> counters_of((model, guide), before)
    ((0, 't'),)
    >>> renamed("x_1", (1,)), renamed("x_12", (1,))
    ('x_{t}', 'x_12')
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["CounterUsed", "NameCounter", "Probe", "advance", "counters_of", "held_back", "named_beyond_sites", "paths", "probed", "renamed", "values"]

Counters = tuple[tuple[int, str], ...]
"""``(owner, name)`` pairs: ``owner`` 0 for the model, 1 for the guide."""

_OWNERS = ("the model's", "the guide's")


class CounterUsed(TypeError):
    """Raised by a :class:`NameCounter` read as a number."""


class NameCounter:
    """Stands in for a step counter (``self.t``, advanced by one per step, as
    ``pyro.infer.SMCFilter`` models keep to name their sites ``f"x_{t}"``) while a step is recorded.

    It formats as the number (site names come out as they would) and adds ``1`` (``self.t += 1``)
    but is no number: a comparison, an index, arithmetic, ``int()``, a hash or a truth test raises
    :class:`CounterUsed`. A step that records with it in place reads the counter for names only,
    so a replay, which advances the counter itself, computes what the handler path would; a step
    that reads it as a number (``if t >= 10``, ``covariates[t]``) is not compiled.

    Example:
        >>> t = NameCounter(3, "self.t")
        >>> f"x_{t}", (t + 1).value
        ('x_3', 4)
        >>> t >= 10  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        CounterUsed: self.t is read as a number, not only in site names
    """

    __slots__ = ("value", "name", "formatted")

    def __init__(self, value: int, name: str, formatted: list | None = None):
        self.value, self.name = value, name
        self.formatted = [] if formatted is None else formatted  # shared with its successors

    def __format__(self, spec: str) -> str:
        self.formatted.append(self.value)
        return format(self.value, spec)

    def __str__(self) -> str:
        self.formatted.append(self.value)
        return str(self.value)

    __repr__ = __str__

    def __add__(self, other: Any) -> NameCounter:
        if type(other) is not int:
            self._used()
        return NameCounter(self.value + other, self.name, self.formatted)

    __radd__ = __add__

    def _used(self, *args: Any) -> Any:
        raise CounterUsed(f"{self.name} is read as a number, not only in site names")


for _name in (
    "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __hash__ __bool__ __index__ __int__ __float__ __complex__ __round__ "
    "__sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ __rfloordiv__ __mod__ __rmod__ __divmod__ "
    "__pow__ __rpow__ __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__ "
    "__rshift__ __getitem__ __len__ __iter__ __contains__"
).split():
    setattr(NameCounter, _name, NameCounter._used)
del _name


def counters_of(owners: tuple[Any, Any], before: tuple) -> Counters:
    """The integer attributes of ``owners`` (model, guide) that went up by exactly one since
    ``before`` (:func:`~pyro_smc.infer.smc.static_checks.attribute_snapshot`)."""
    found = []
    for index, (owner, (attributes, _)) in enumerate(zip(owners, before)):
        if owner is None or not attributes:
            continue
        now = vars(owner)
        for key, old in attributes.items():
            new = now.get(key)
            if type(old) is int and type(new) is int and new == old + 1:
                found.append((index, key))
    return tuple(found)


def values(owners: tuple[Any, Any], counters: Counters) -> tuple:
    """The counters' current values."""
    return tuple(vars(owners[index]).get(key) for index, key in counters)


def advance(owners: tuple[Any, Any], counters: Counters, steps: int) -> None:
    """Advances each counter by ``steps``: what as many replayed steps of the program would do."""
    for index, key in counters:
        attributes = vars(owners[index])
        if type(attributes.get(key)) is int:
            attributes[key] += steps


@contextlib.contextmanager
def held_back(owners: tuple[Any, Any], counters: Counters) -> Iterator[None]:
    """The counters one step back while the body compares the program with its state before
    the step (the advance is the step's, not a side effect)."""
    saved = [(vars(owners[index]), key, vars(owners[index]).get(key)) for index, key in counters]
    for attributes, key, value in saved:
        if type(value) is int:
            attributes[key] = value - 1
    try:
        yield
    finally:
        for attributes, key, value in saved:
            attributes[key] = value


class Probe(NamedTuple):
    """What :func:`probed` saw: ``problems`` (a counter not advanced by exactly one) and, per
    counter, the values it was formatted with (one per site name it made, or it was put to
    another use)."""

    problems: list[str]
    formatted: list[list[int]]


@contextlib.contextmanager
def probed(owners: tuple[Any, Any], counters: Counters) -> Iterator[Probe]:
    """Each counter replaced by a :class:`NameCounter` while the body records the step; after,
    the counters are integers again, advanced by one when the step advanced its probe by one."""
    probe = Probe([], [])
    problems = probe.problems
    starts = []
    for index, key in counters:
        attributes = vars(owners[index])
        value = attributes.get(key)
        if type(value) is int:
            starts.append((attributes, key, value))
            attributes[key] = NameCounter(value, f"{_OWNERS[index]} self.{key}")
            probe.formatted.append(attributes[key].formatted)
    try:
        yield probe
    finally:
        for attributes, key, value in starts:
            now = attributes.get(key)
            if isinstance(now, NameCounter) and now.value == value + 1:
                attributes[key] = value + 1
            else:
                attributes[key] = value
                problems.append(f"its counter self.{key} did not advance by one at the recorded step")


def paths(counters: Counters) -> set[str]:
    """The counters' paths in a :func:`~pyro_smc.infer.smc.python_state.snapshot`."""
    return {f"{_OWNERS[index]} self.{key}" for index, key in counters}


def named_beyond_sites(probe: Probe, names: list[str], counted: tuple) -> str | None:
    """Whether a counter was formatted more often than the site and parameter ``names`` of the
    recorded step carry its value: a string made from it served something else (a key into the
    model's data, ``self.data[f"y_{t}"]``), which a recording would freeze."""
    carried = sum(renamed(name, counted) != name for name in names)
    if sum(len(values) for values in probe.formatted) > carried:
        return "the step formats its step counter into a string that is not a site name (a key into its data?), which a recording would freeze"
    return None


def renamed(name: str, counted: tuple) -> str:
    """``name`` with the counters' values (whole numbers only) masked: the same site at two steps."""
    for value in counted:
        if type(value) is int:
            name = re.sub(rf"(?<!\d){value}(?!\d)", "{t}", name)
    return name
