"""Running Pyro programs in the ``init``/``step`` protocol: one layer for every engine.

`SMC`, the online variational filter, `StreamingFilterGuide` and the ArviZ export all run
user programs written with ``pyro.sample``/``pyro.param`` and read the same things off their
traces: which sites are latent, each site's scaled and masked log-density, and the parameters a
run touched. This module is the one place that does it, on top of Pyro's own machinery
(``poutine.trace``, and ``Trace.compute_log_prob``'s rule for a site's log-density), so every engine agrees on what a latent site
is and how a log-density is scaled.

The rules, the same as Pyro's inference algorithms:

* a *latent* site is a ``sample`` site that is not observed and not a subsample (plate index)
  site;
* a site's log-density is ``fn.log_prob(value)`` with the site's ``scale`` (``poutine.scale``,
  minibatch plates) and ``mask`` applied;
* a ``PyroModule``'s ``PyroParam``s resolve through the parameter store (and so reach SVI) only
  inside the module's context. Pyro enters it in ``forward`` and ``@pyro_method``s; ``init`` and
  ``step`` are plain methods, so the engines enter it with :func:`module_context`;
* under :func:`detach_latent_draws` the latent sites a program draws itself return detached
  values (score-function estimators, e.g. ``SMC`` with stop-gradient resampling).

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro_smc.tracing import latent_sites, site_log_probs, trace_program
    >>> def step(state, y):
    ...     state["x"] = pyro.sample("x_0", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    ...     pyro.sample("y_0", dist.Normal(state["x"], 1.0).to_event(1), obs=y)
    >>> trace = trace_program(step, {}, torch.zeros(3))
    >>> latent_sites(trace)
    ['x_0']
    >>> sorted(site_log_probs(trace))
    ['x_0', 'y_0']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pyro.poutine as poutine
import torch
from pyro.nn import PyroModule
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from torch import Tensor

__all__ = [
    "check_observed_shapes",
    "detach_latent_draws",
    "is_latent",
    "is_scored",
    "latent_sites",
    "missing_observation_sites",
    "module_context",
    "param_sites",
    "replay_where",
    "site_log_probs",
    "trace_program",
]


def is_scored(site: dict) -> bool:
    """Whether a trace node is a sample site with a log-density (not a plate's subsample site)."""
    return site["type"] == "sample" and not site_is_subsample(site)


def is_latent(site: dict) -> bool:
    """Whether a trace node is a latent sample site: scored and not observed."""
    return is_scored(site) and not site["is_observed"]


def latent_sites(trace: Trace) -> list[str]:
    """The names of a trace's latent sample sites, in the order the program sampled them."""
    return [name for name, site in trace.nodes.items() if is_latent(site)]


def param_sites(trace: Trace) -> list[str]:
    """The names of the ``pyro.param`` sites a traced run read, in order."""
    return [name for name, site in trace.nodes.items() if site["type"] == "param"]


def site_log_probs(trace: Trace, names: Iterator[str] | None = None) -> dict[str, Tensor]:
    """Scaled and masked log-densities of a trace's sample sites, by name.

    Computed as Pyro's ``Trace.compute_log_prob`` computes them (``fn.log_prob(value, *args)``,
    then Pyro's ``scale_and_mask``) and memoised on the trace in the same node fields
    (``unscaled_log_prob``, ``log_prob``), so a site's ``scale`` and ``mask`` are applied exactly as
    in Pyro's ELBOs. Unlike ``compute_log_prob`` it neither sums each site nor runs the
    validation-time NaN/inf warnings: those cost a device synchronisation per site per time step,
    and every engine checks its own weights (naming the site) instead.

    Args:
        trace: a Pyro trace.
        names: the sites to score; all scored sites (:func:`is_scored`) when ``None``.

    Returns:
        ``{name: log_prob}``, each of the site distribution's batch shape.

    Raises:
        ValueError: a distribution rejects its value (the message names the site and the trace's shapes).
    """
    wanted = None if names is None else set(names)
    out = {}
    for name, site in trace.nodes.items():
        if not is_scored(site) or (wanted is not None and name not in wanted):
            continue
        if "log_prob" not in site:
            try:
                log_p = site["fn"].log_prob(site["value"], *site["args"], **site["kwargs"])
            except ValueError as error:
                raise ValueError(f"Error while computing log_prob at site '{name}':\n{error}\n{trace.format_shapes(last_site=name)}") from error
            site["unscaled_log_prob"] = log_p
            site["log_prob"] = scale_and_mask(log_p, site["scale"], site["mask"])
        out[name] = site["log_prob"]
    return out


def check_observed_shapes(trace: Trace, leading: tuple[int, ...], where: str, bare: Any = None) -> None:
    """Every observed site sees each entry of its observation exactly once.

    Pyro broadcasts an observed value against its distribution. Against the engine's own leading
    dims (the particles, the filters, the online filter's Monte Carlo draws) that is how one
    observation scores every particle. Anywhere else it is a silent wrong answer: a scalar
    observation of a site with event shape ``(2,)`` (or of a model plate of size 2) scores the
    same number twice, and a ``(2,)`` observation of a one-coordinate site scores two numbers for
    one. So, with the site's shape ``batch + event`` written as ``leading + rest`` (``leading``
    the engine's dims, right-aligned after them any model plates and the event), the value must be
    ``rest`` exactly on its right-most ``len(rest)`` dims (size-1 dims of ``rest`` may be left out)
    and broadcast against ``leading`` without enlarging it.

    Args:
        trace: one run of a step.
        leading: the engine's batch dims left of the model's own (``()`` for none).
        where: the step, for the message.
        bare: the observation as the engine passed it when it carries none of the engine's dims
            (a step's slice of a series): a site that observes this very tensor must fit it
            without ``leading`` at all (a ``(2,)`` observation of a scalar site with 2 particles
            would otherwise pass as one value per particle).

    Raises:
        ValueError: naming the step, the site and both shapes.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro import poutine
        >>> def step(y):  # validate_args=False: torch checks nothing
        ...     fn = dist.Normal(torch.zeros(3, 2), 1.0, validate_args=False).to_event(1)
        ...     pyro.sample("y", fn, obs=y)
        >>> # fits
        >>> check_observed_shapes(poutine.trace(step).get_trace(torch.zeros(2)), (3,), "step 0")
        >>> try:
        ...     check_observed_shapes(
        ...         poutine.trace(step).get_trace(torch.tensor(0.5)), (3,), "step 0"
        ...     )
        ... except ValueError as error:
        ...     print(str(error).split(":")[0])
        the observation of site 'y' at step 0 has shape (), which does not fit the site (per sample (2,), leading (3,))
    """
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"] or not isinstance(site["value"], Tensor):
            continue
        fn, shape = site["fn"], tuple(site["value"].shape)
        full = tuple(fn.batch_shape) + tuple(fn.event_shape)
        lead = leading if full[: len(leading)] == tuple(leading) else ()
        rest = full[len(lead) :]
        # Plain tuples, not torch.broadcast_shapes: this runs at every step of every engine.
        own = shape[max(len(shape) - len(rest), 0) :]
        padded = (1,) * (len(rest) - len(own)) + own
        fits = len(shape) <= len(full) and all(v == r or (v == 1 and r == 1) for v, r in zip(padded, rest))
        fits = fits and all(v == f or v == 1 for v, f in zip(reversed(shape[: len(shape) - len(own)]), reversed(lead)))
        fits = fits and not (bare is not None and site["value"] is bare and len(shape) > len(own))
        if not fits:
            raise ValueError(
                f"the observation of site '{name}' at {where} has shape {shape}, which does not fit the site (per sample "
                f"{rest}, leading {tuple(lead)}): Pyro would broadcast it, scoring an entry more than once or one value for "
                f"several; pass an observation of shape {rest}"
            )


@contextlib.contextmanager
def module_context(*programs: Any) -> Iterator[None]:
    """Enters the ``PyroModule`` context of every program that is a ``PyroModule``.

    Inside it a module's ``PyroParam``s are ``pyro.param`` sites (visible to SVI and
    ``poutine.trace``) and are cached for the duration, as in ``PyroModule.__call__``.
    Non-modules (plain functions, ``None``) are skipped.
    """
    with contextlib.ExitStack() as stack:
        for program in programs:
            if isinstance(program, PyroModule):
                stack.enter_context(program._pyro_context)
        yield


def trace_program(fn: Callable, *args: Any, block: bool = True, **kwargs: Any) -> Trace:
    """Runs ``fn(*args, **kwargs)`` once under ``poutine.trace`` and returns its trace.

    Args:
        fn: a Pyro program (a model's ``init``/``step``, a whole-trajectory model, a guide).
        block: hide the run's sites from enclosing handlers (SVI, another trace), as a
            discovery run must; ``False`` lets enclosing handlers see them.

    Returns:
        The ``pyro.poutine.Trace`` of the run.
    """
    with poutine.block() if block else contextlib.nullcontext(), module_context(_owner(fn)):
        return poutine.trace(fn).get_trace(*args, **kwargs)


def _owner(fn: Callable) -> Any:
    """The ``PyroModule`` a bound method belongs to (``model.step`` -> ``model``), else ``fn``."""
    return getattr(fn, "__self__", fn)


class _DetachLatentDraws(Messenger):
    """Detaches the value of every latent site drawn inside it (see :func:`detach_latent_draws`)."""

    def __init__(self) -> None:
        super().__init__()
        self._drawn: set[str] = set()

    def _pyro_sample(self, msg: dict) -> None:
        # Runs before the draw; a value already set here was observed or replayed.
        if is_latent(msg) and msg["value"] is None:
            self._drawn.add(msg["name"])

    def _pyro_post_sample(self, msg: dict) -> None:
        if msg["name"] in self._drawn:
            self._drawn.discard(msg["name"])
            if isinstance(msg["value"], Tensor):
                msg["value"] = msg["value"].detach()


def detach_latent_draws() -> Messenger:
    """A handler under which the latent sites a program draws return detached values.

    Observed sites, plate subsample sites and values set by an inner handler (``replay``,
    ``condition``) are left alone. The draw itself is unchanged (``rsample`` where the
    distribution has it, so the random numbers consumed are the same), only its autograd graph
    is cut. Enter it *outside* ``poutine.trace`` so that the trace records the detached value, and
    inside any plates.

    Example:
        >>> import torch, pyro, pyro.distributions as dist
        >>> loc = torch.zeros(2, requires_grad=True)
        >>> def program():
        ...     return pyro.sample("x", dist.Normal(loc, 1.0).to_event(1))
        >>> with detach_latent_draws():
        ...     trace = poutine.trace(program).get_trace()
        >>> trace.nodes["x"]["value"].requires_grad, program().requires_grad
        (False, True)
    """
    return _DetachLatentDraws()


class _ReplayWhere(Messenger):
    """Replays a trace's latent values in the rows a mask selects (see :func:`replay_where`)."""

    def __init__(self, trace: Trace, mask: Tensor, dims_right: int) -> None:
        super().__init__()
        self.trace = trace
        self.mask = mask
        self.dims_right = dims_right

    def _pyro_post_sample(self, msg: dict) -> None:
        site = self.trace.nodes.get(msg["name"])
        if site is None or not is_latent(msg) or not is_latent(site):
            return
        value = msg["value"]
        trailing = self.dims_right + len(msg["fn"].event_shape)
        mask = self.mask.reshape(self.mask.shape + (1,) * trailing)
        mixed = torch.where(mask, site["value"], value)
        if mixed.shape != value.shape:
            raise ValueError(
                f"site '{msg['name']}' has shape {tuple(value.shape)}, which has no batch dim {-1 - trailing} of size "
                f"{self.mask.shape[0]} to choose the replayed value per row along"
            )
        msg["value"] = mixed


def replay_where(trace: Trace, mask: Tensor, dims_right: int) -> Messenger:
    """A handler under which each latent site takes ``trace``'s value in the rows ``mask`` selects.

    Unlike ``poutine.replay`` the program still draws every latent site itself; then, along the
    batch dim ``-1 - dims_right`` of the site's batch shape (of size ``mask.shape[0]``), the rows
    where ``mask`` is true take the value recorded in ``trace`` and the others keep the fresh draw.
    ``SMC`` uses it on a batch of sequences: the filters that observe at a step move by the guide,
    the others by the model's own transition. Enter it *outside* ``poutine.trace`` so that the
    trace records the chosen values.

    Args:
        trace: the trace whose latent values are replayed (a guide's).
        mask: bool ``(R,)``, the rows that take the replayed values.
        dims_right: batch dims right of the masked dim (for ``SMC``'s filters: ``1 +
            max_plate_nesting``, the particle dim and the model's plates).

    Raises:
        ValueError: (while the program runs) a site has no batch dim of size ``R`` at that place.

    Example:
        >>> import torch, pyro, pyro.distributions as dist
        >>> def program():
        ...     return pyro.sample("x", dist.Normal(torch.zeros(2, 3), 1.0))
        >>> recorded = poutine.trace(
        ...     lambda: pyro.sample("x", dist.Normal(torch.full((2, 3), 9.0), 1e-3))
        ... ).get_trace()
        >>> with replay_where(recorded, torch.tensor([True, False]), dims_right=1):
        ...     x = program()
        >>> bool((x[0] > 8).all()), bool((x[1] < 8).all())
        (True, True)
    """
    return _ReplayWhere(trace, mask, dims_right)


def missing_observation_sites(model_trace: Trace, observation: Tensor | None, where: str) -> list[str]:
    r"""The observed sites that take a missing observation (the step's first argument): every
    engine leaves them unscored and scores every other observed site of the step (a second
    observation, data the model holds, a ``pyro.factor``). See :mod:`pyro_smc.observations` and
    ``docs/math/smc.md#missing-observations``.

    An observation passed as ``None`` reaches the model as ``obs=None``, so its site is latent
    and none is missing. Otherwise a site takes it when its value is the tensor passed, or equals
    it (broadcast), or holds a NaN (an all-NaN observation the model reshaped or indexed; a
    ``pyro.factor`` computed from it); failing those, a step with a single observed site.

    Raises:
        ValueError: several observed sites and none of them recognisably the observation, naming
            the step: scoring them all, or none, could both be wrong.

    Example:
        >>> import math, torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> def step(y1, y2):
        ...     x = pyro.sample("x", dist.Normal(0.0, 1.0))
        ...     pyro.sample("y1", dist.Normal(x, 1.0), obs=y1)
        ...     pyro.sample("y2", dist.Normal(x, 1.0), obs=y2)
        >>> y1 = torch.tensor(math.nan)
        >>> trace = poutine.trace(step).get_trace(y1, torch.tensor(0.5))
        >>> missing_observation_sites(trace, y1, "time step 3")
        ['y1']
    """
    if observation is None:
        return []
    sites = {name: site for name, site in model_trace.nodes.items() if is_scored(site) and site["is_observed"]}
    if not sites:
        return []
    tests = (
        lambda site: site["value"] is observation,
        lambda site: _equal_broadcast(site["value"], observation),
        lambda site: _holds_nan(site),
    )
    for test in tests:
        found = [name for name, site in sites.items() if test(site)]
        if found:
            return found
    if len(sites) == 1:
        return list(sites)
    raise ValueError(
        f"at {where} the observation (the step's first argument) is missing, but none of the observed sites "
        f"{sorted(sites)} takes it as its value, so SMC cannot tell which one to leave unscored; "
        "observe it as given (pyro.sample(..., obs=y))"
    )


def _equal_broadcast(value, observation: Tensor) -> bool:
    """Whether ``value`` is ``observation`` broadcast to its shape (NaN equal to NaN)."""
    if not isinstance(value, Tensor) or value.dim() < observation.dim() or value.dtype != observation.dtype:
        return False
    if tuple(value.shape[value.dim() - observation.dim() :]) != tuple(observation.shape):
        return False
    expanded = observation.expand_as(value)
    return bool(((value == expanded) | (torch.isnan(value) & torch.isnan(expanded))).all()) if value.is_floating_point() else torch.equal(value, expanded)


def _holds_nan(site: dict) -> bool:
    """Whether an observed site's value, or a ``pyro.factor``'s log-factor, holds a NaN."""
    values = [site["value"], getattr(site["fn"], "log_factor", None)]
    return any(isinstance(v, Tensor) and v.is_floating_point() and bool(torch.isnan(v).any()) for v in values)
