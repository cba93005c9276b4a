r"""Conditional SMC with ancestor sampling over a Pyro ``init``/``step`` model.

Particle Gibbs (Andrieu, Doucet and Holenstein 2010) draws a state trajectory
:math:`x_{0:T}` from its smoothing distribution :math:`p_\theta(x_{0:T} \mid y_{0:T})` by a
Markov kernel: a particle filter in which one particle is fixed to the current trajectory, the
*reference* :math:`x^*_{0:T}`, and a new trajectory drawn from the filter's final weights by
following the ancestors back. Whatever the number of particles :math:`N \ge 2`, this kernel
leaves the smoothing distribution invariant.

One sweep of :class:`ConditionalSMC`, with the bootstrap proposal (the model's transition
:math:`f_\theta`) and resampling at every step:

1. run ``init`` on :math:`N` particles; particle :math:`N` takes the reference's values;
2. at step :math:`t`, draw ancestors :math:`a_t^i \sim \mathrm{Categorical}(w_{t-1})` for
   :math:`i < N` and move them by the model's ``step``; particle :math:`N` takes
   :math:`x^*_t`;
3. *ancestor sampling* (Lindsten, Jordan and Schön 2014): the reference's ancestor is drawn
   afresh, :math:`P(a_t^N = i) \propto w_{t-1}^i \, p_\theta(x^*_t, y_t \mid x_{t-1}^i)`, the
   density of the whole step (its latent and observed sites) at the reference's values, from
   each particle's state; for a state-space model the observation's factor is the same for every
   :math:`i` and this is :math:`w_{t-1}^i f_\theta(x^*_t \mid x_{t-1}^i)`;
4. weigh by the observation's density, :math:`w_t^i \propto g_\theta(y_t \mid x_t^i)`;
5. at the end draw :math:`b_T \sim w_T` and return the path :math:`b_{t-1} = a_t^{b_t}`.

Ancestor sampling lets the new trajectory leave the reference's early states, which plain
conditional SMC keeps with probability close to one (the particles' paths coalesce backwards):
with it the kernel mixes with a handful of particles even on long series.

The model is any program in the ``init``/``step`` protocol of :class:`~pyro_smc.SMC` whose steps
have a density: the latent sites of a step are named per step, the observation is passed as
``obs=``, the state dict holds per-particle tensors ``(N, ...)`` (the particles plate sits at dim
``-1 - max_plate_nesting``), and the state a step writes depends on that step's draws only (a
first-order Markov model, so that :math:`x_{t-1}^i` stands for the whole past of particle
:math:`i`). The first conditional sweep checks the last rule: the step, run from every candidate ancestor
with the reference's draws, must write one state for all of them.
Run it inside :meth:`StaticParameters.fixed <pyro_smc.infer.static_parameters.StaticParameters.fixed>`
for a model with static parameters.

Example:
    >>> import torch
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> _ = torch.manual_seed(0)
    >>> one = torch.eye(1)
    >>> ssm = LinearGaussianSSM(0.9 * one, one, one, one, torch.zeros(1), one)
    >>> _, ys = ssm.simulate(10)
    >>> csmc = ConditionalSMC(ssm, num_particles=5)
    >>> path = csmc.sweep(ys)                  # no reference yet: a plain particle filter
    >>> path = csmc.sweep(ys, reference=path)  # one step of the particle Gibbs chain
    >>> path.stacked()["x"].shape             # (T, d)
    torch.Size([10, 1])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, Iterator, NamedTuple

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.trace_struct import Trace
from torch import Tensor

from pyro_smc.checks import boolean, int_at_least
from pyro_smc.observations import row_status, step_observation
from pyro_smc.resamplers.base import gather
from pyro_smc.tracing import is_latent, is_scored, missing_observation_sites, module_context, site_log_probs

__all__ = ["ConditionalSMC", "Trajectory", "trajectory_log_density"]


class Trajectory(NamedTuple):
    """One path through the model: the latent sites' values and the state, per stage.

    Stage 0 is ``init``, stage ``t + 1`` is ``step`` at time step ``t``.

    Attributes:
        sites: per stage, ``{site name: value}``, each without the particle dim.
        states: per stage, the state dict after it, each tensor without the particle dim.
        log_density: the complete-data log-density of the path (latent and observed sites;
            observed sites of predict-only steps left out) under the model as it was swept, the
            value :func:`trajectory_log_density` computes; ``None`` when not known.

    Example:
        >>> import torch
        >>> path = Trajectory(
        ...     [{}, {"x_0": torch.zeros(2)}, {"x_1": torch.ones(2)}],
        ...     [{}, {"x": torch.zeros(2)}, {"x": torch.ones(2)}],
        ... )
        >>> path.stacked()["x"].shape  # (T, *event)
        torch.Size([2, 2])
    """

    sites: list[dict[str, Tensor]]
    states: list[dict[str, Tensor]]
    log_density: Tensor | None = None

    def stacked(self, keys: Sequence[str] | None = None) -> dict[str, Tensor]:
        """The state after each time step, stacked: ``{key: (T, *event)}``.

        Args:
            keys: the state keys (default: those every step's state holds).

        Raises:
            ValueError: a key is missing at a step, naming both.
        """
        steps = self.states[1:]
        if keys is None:
            keys = [k for k in steps[0] if all(k in s for s in steps)] if steps else []
        out = {}
        for key in keys:
            for t, state in enumerate(steps):
                if key not in state:
                    raise ValueError(f"trajectory key '{key}' is not in the state after time step {t}")
            out[key] = torch.stack([state[key] for state in steps])
        return out


class _ForceRows(Messenger):
    """Sets the particles from ``start`` on of each named latent site to the reference's value."""

    def __init__(self, values: dict[str, Tensor], start: int) -> None:
        super().__init__()
        self.values, self.start = values, start

    def _pyro_post_sample(self, msg: dict) -> None:
        if not is_latent(msg) or msg["name"] not in self.values:
            return
        value = msg["value"].clone()
        value[self.start :] = self.values[msg["name"]]
        msg["value"] = value


class ConditionalSMC:
    """Conditional SMC with (optional) ancestor sampling: the trajectory kernel of particle Gibbs.

    See the module docstring for the sweep and what it asks of the model. Each step runs the
    model's program once, on the :math:`N - 1` free particles and, with ancestor sampling, on
    all :math:`N` previous particles given the reference's draws (``2N - 1`` rows in all): the
    last rows give the ancestor-sampling weights, and the row of the drawn ancestor becomes the
    reference particle.

    Args:
        model: a program in the ``init``/``step`` protocol (``init(state, *args)``,
            ``step(state, y, *args)``).
        num_particles: ``N``, at least 2 (one of them is the reference).
        ancestor_sampling: redraw the reference's ancestor at each step (Lindsten et al.);
            ``False`` gives plain conditional SMC, which needs no Markov property but mixes poorly
            over the early states of a long series.
        max_plate_nesting: the plates the model nests inside a step (the particles plate sits
            left of them).

    Raises:
        ValueError: a bad argument, naming it.

    Example:
        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> one = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * one, one, one, one, torch.zeros(1), one)
        >>> ConditionalSMC(ssm, num_particles=10).sweep(torch.zeros(4, 1)).stacked()["x"].shape
        torch.Size([4, 1])
    """

    def __init__(self, model: Any, num_particles: int, *, ancestor_sampling: bool = True, max_plate_nesting: int = 0) -> None:
        for name in ("init", "step"):
            if not callable(getattr(model, name, None)):
                raise ValueError(f"model must have init(state, ...) and step(state, y, ...) methods; it has no {name}")
        self.model = model
        self.num_particles = int_at_least("num_particles", num_particles, 2)
        self.ancestor_sampling = boolean("ancestor_sampling", ancestor_sampling)
        self.max_plate_nesting = int_at_least("max_plate_nesting", max_plate_nesting, 0)
        self._plates: dict[int, Any] = {}  # built once per size and re-entered: building costs more
        # The Markov property is the model's structure: checked over the first conditional sweep.
        self._markov_checked = False
        self._checked: tuple | None = None

    # --- running the program -----------------------------------------------------------------

    @contextlib.contextmanager
    def _handlers(self, size: int) -> Iterator[None]:
        plate = self._plates.get(size)
        if plate is None:
            plate = self._plates[size] = pyro.plate("particles", size, dim=-1 - self.max_plate_nesting)
        with poutine.block(), module_context(self.model), plate:
            yield

    def _per_particle(self, log_p: Tensor, size: int, name: str, where: str) -> Tensor:
        mpn = self.max_plate_nesting
        if mpn and log_p.dim() > 0:
            log_p = log_p.reshape(log_p.shape[: max(log_p.dim() - mpn, 0)] + (-1,)).sum(-1)
        if log_p.dim() > 1 or (log_p.dim() == 1 and log_p.shape[0] not in (1, size)):
            raise ValueError(
                f"site '{name}' at {where} has log-density of shape {tuple(log_p.shape)}: dims left of the particles plate "
                f"(max_plate_nesting={mpn}); keep the state's event dims right of the plates"
            )
        return log_p.expand(size)

    def _log_density(self, trace: Trace, size: int, names: list[str], where: str) -> Tensor | None:
        """The per-particle sum of the named sites' log-densities ``(size,)``; ``None`` for none."""
        total = None
        for name, log_p in site_log_probs(trace, names).items():
            term = self._per_particle(log_p, size, name, where)
            total = term if total is None else total + term
        return total

    def _run(self, fn: Any, state: dict, size: int, args: tuple, kwargs: dict, force: dict | None, where: str) -> Trace:
        """Runs ``fn`` on ``size`` particles, the rows from ``N - 1`` on given ``force``'s values."""
        forcing = contextlib.nullcontext() if force is None else _ForceRows(force, self.num_particles - 1)
        with self._handlers(size), forcing, poutine.trace() as tracer:
            fn(state, *args, **kwargs)
        trace = tracer.trace
        latent = [n for n, s in trace.nodes.items() if is_latent(s)]
        for name in latent:
            value = trace.nodes[name]["value"]
            if value.dim() == 0 or value.shape[0] != size:
                raise ValueError(f"latent site '{name}' at {where} has shape {tuple(value.shape)}: it must lead with the particles ({size})")
        if force is not None and set(latent) != set(force):
            raise ValueError(f"at {where} the model samples the latent sites {latent}, but the reference has {sorted(force)}")
        for key, value in state.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != size:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"state['{key}'] after {where} is {shape}: every state entry must be a tensor leading with the particles ({size})")
        return trace

    def _check_markov(self, state: dict, log_as: Tensor, where: str) -> None:
        """Every candidate ancestor was given the reference's draws: a first-order Markov model
        then writes one state for all of them."""
        n = self.num_particles
        ok = torch.isfinite(log_as)
        for key, value in state.items():
            rows = value[n - 1 :][ok]
            if rows.shape[0] > 1 and not torch.allclose(rows, rows[:1].expand_as(rows), rtol=1e-4, atol=1e-6, equal_nan=True):
                raise ValueError(
                    f"at {where}, state['{key}'] depends on the particle's past beyond its previous state: ancestor "
                    "sampling needs a first-order Markov model (a state written from the step's draws only); use "
                    "ancestor_sampling=False"
                )

    def _step(self, state: dict, log_w: Tensor, y: Any, args: tuple, kwargs: dict, force: dict | None, missing: bool, where: str) -> _Stage:
        """One step: resample, propagate, condition the reference on its drawn ancestor."""
        n = self.num_particles
        free = torch.multinomial(log_w.exp(), n if force is None else n - 1, replacement=True)
        rows = free
        if force is not None:
            candidates = torch.arange(n if self.ancestor_sampling else 1, device=free.device)
            rows = torch.cat([free, candidates if self.ancestor_sampling else candidates + n - 1])
        batch = gather(state, rows)
        size = rows.shape[0]
        trace = self._run(self.model.step, batch, size, (y,) + args, kwargs, force, where)
        keep = torch.arange(n, device=free.device)
        log_obs, log_joint = self._stage_log_densities(trace, size, missing, y, where)
        if log_joint is None:
            log_joint = log_w.new_zeros(size)
        if force is not None and self.ancestor_sampling:
            # the step's density at the reference's draws from every previous particle
            log_as = log_w + log_joint[n - 1 :]
            if not self._markov_checked:
                self._check_markov(batch, log_as, where)
            keep[-1] = n - 1 + _categorical(log_as, where)
        values = gather(_latent_values(trace), keep)
        return _Stage(gather(batch, keep), values, rows[keep], None if log_obs is None else log_obs[keep], log_joint[keep])

    def _stage_log_densities(self, trace: Trace, size: int, missing: bool, y: Any, where: str) -> tuple[Tensor | None, Tensor | None]:
        """``(log g, log f + log g)`` per particle: the observed sites' log-density and the whole
        stage's (latent sites included), each ``None`` if no site of it is scored. At a missing
        observation ``y`` its own site is left out, the step's other observed sites are not."""
        scored = [name for name, site in trace.nodes.items() if is_scored(site)]
        skipped = set(missing_observation_sites(trace, y if isinstance(y, Tensor) else None, where)) if missing else set()
        observed = [name for name in scored if trace.nodes[name]["is_observed"] and name not in skipped]
        log_obs = self._log_density(trace, size, observed, where)
        log_latent = self._log_density(trace, size, [name for name in scored if not trace.nodes[name]["is_observed"]], where)
        if log_latent is None:
            return log_obs, log_obs
        return log_obs, log_latent if log_obs is None else log_obs + log_latent

    def log_density(self, trajectory: Trajectory, observations: Tensor | Sequence[Tensor | None], *args: Any, **kwargs: Any) -> Tensor:
        """:func:`trajectory_log_density` with this sampler's model and plates (built once).

        Example:
            >>> import torch
            >>> from pyro_smc.models import LinearGaussianSSM
            >>> one = torch.eye(1)
            >>> ssm = LinearGaussianSSM(one, one, one, one, torch.zeros(1), one)
            >>> csmc = ConditionalSMC(ssm, num_particles=5)
            >>> path = csmc.sweep(torch.zeros(3, 1))
            >>> bool(torch.isclose(csmc.log_density(path, torch.zeros(3, 1)), path.log_density))
            True
        """
        ys, missing = self._observations(observations)
        if len(trajectory.sites) != len(ys) + 1:
            raise ValueError(f"trajectory: {len(trajectory.sites) - 1} time steps, but the observations have {len(ys)}")
        state: dict = {}
        total = None
        with torch.no_grad(), self._handlers(1):
            for k, sites in enumerate(trajectory.sites):
                data = {name: value.unsqueeze(0) for name, value in sites.items()}
                fn = self.model.init if k == 0 else self.model.step
                step_args = args if k == 0 else (ys[k - 1],) + args
                with poutine.trace() as tracer:
                    poutine.condition(fn, data=data)(state, *step_args, **kwargs)
                trace = tracer.trace
                where = "init" if k == 0 else f"time step {k - 1}"
                unknown = [n for n, s in trace.nodes.items() if is_latent(s)]
                if unknown:
                    raise ValueError(f"at {where} the model samples latent sites {unknown} that the trajectory does not hold")
                # A missing observation's own site is left out; the step's other observed sites are not.
                skipped = set(missing_observation_sites(trace, ys[k - 1], where)) if k > 0 and missing[k - 1] else set()
                names = [n for n, s in trace.nodes.items() if is_scored(s) and (n in data or n not in skipped)]
                term = self._log_density(trace, 1, names, where)
                if term is not None:
                    total = term if total is None else total + term
        if total is None:
            raise ValueError("the model scores nothing along the trajectory")
        return total[0]

    def _observations(self, observations: Any) -> tuple[list, list[bool]]:
        """The checked observations; a chain passes the same tensor at every sweep, so its check
        is kept (keyed by the object and its in-place version counter)."""
        key = (id(observations), getattr(observations, "_version", None)) if isinstance(observations, Tensor) else None
        if key is not None and self._checked is not None and self._checked[0] == key:
            return self._checked[1]
        out = _check_observations(observations)
        if key is not None:
            self._checked = (key, out)
        return out

    # --- the sweep ------------------------------------------------------------------------------

    def sweep(self, observations: Tensor | Sequence[Tensor | None], *args: Any, reference: Trajectory | None = None, **kwargs: Any) -> Trajectory:
        """One conditional SMC sweep; returns a trajectory drawn from its final weights.

        Args:
            observations: ``(T, ...)``, or a sequence of ``T`` tensors or ``None``; an all-NaN
                step is predict-only, and a ``None`` one makes the observation site a latent site
                of the trajectory (imputed).
            *args: passed to ``init`` and after the observation to ``step``.
            reference: the trajectory to condition on (``None``: a plain bootstrap filter, to
                start a chain).
            **kwargs: passed to ``init`` and ``step``.

        Returns:
            The new :class:`Trajectory`, with its complete-data ``log_density``.

        Raises:
            ValueError: bad observations (no step, ``inf``, partly missing, naming the step), a
                reference of another length or other sites, a state or site without the
                particle dim, or a non-Markov state under ancestor sampling.
        """
        ys, missing = self._observations(observations)
        if reference is not None and len(reference.sites) != len(ys) + 1:
            raise ValueError(f"reference: a trajectory of {len(reference.sites) - 1} time steps, but the observations have {len(ys)}")
        n = self.num_particles
        with torch.no_grad():
            state: dict = {}
            trace = self._run(self.model.init, state, n, args, kwargs, None if reference is None else reference.sites[0], "init")
            log_obs, log_joint = self._stage_log_densities(trace, n, False, None, "init")
            stages = [_Stage(dict(state), _latent_values(trace), None, log_obs, log_joint)]
            for t, y in enumerate(ys):
                log_w = _shifted(stages[-1].log_w, n, ys, "init" if t == 0 else f"time step {t - 1}")
                force = None if reference is None else reference.sites[t + 1]
                stages.append(self._step(stages[-1].state, log_w, y, args, kwargs, force, missing[t], f"time step {t}"))
            if reference is not None and self.ancestor_sampling:
                self._markov_checked = True
            b = _categorical(_shifted(stages[-1].log_w, n, ys, f"time step {len(ys) - 1}"), "the end")
            sites, states, log_density = [], [], None
            for stage in reversed(stages):
                sites.append({name: value[b] for name, value in stage.values.items()})
                states.append({key: value[b] for key, value in stage.state.items()})
                if stage.log_joint is not None:
                    log_density = stage.log_joint[b] if log_density is None else log_density + stage.log_joint[b]
                if stage.ancestors is not None:
                    b = stage.ancestors[b]
        return Trajectory(sites[::-1], states[::-1], log_density)


class _Stage(NamedTuple):
    """One stage of a sweep, after its particles were chosen: ``(N, ...)`` tensors."""

    state: dict[str, Tensor]
    values: dict[str, Tensor]  # the latent sites' values
    ancestors: Tensor | None  # int64 (N,) into the previous stage; None at init
    log_w: Tensor | None  # the observed sites' log-density, the unnormalised weights
    log_joint: Tensor | None  # the stage's whole log-density (latent and observed sites)


def trajectory_log_density(
    model: Any, trajectory: Trajectory, observations: Tensor | Sequence[Tensor | None], *args: Any, max_plate_nesting: int = 0, **kwargs: Any
) -> Tensor:
    r"""The complete-data log-density :math:`\log p_\theta(x_{0:T}, y_{0:T})` along a trajectory.

    One run of ``init`` and every ``step`` with the latent sites conditioned on the trajectory's
    values (a particles plate of size 1), summing every site's log-density (observed sites of
    predict-only steps left out). Run it inside ``StaticParameters.fixed`` to evaluate it at given
    parameters: the Gibbs update of the parameters is Metropolis-Hastings on this plus the prior.
    :meth:`ConditionalSMC.log_density` is the same, for a sampler that calls it often.

    Args:
        model: the ``init``/``step`` program.
        trajectory: the path, e.g. from :meth:`ConditionalSMC.sweep`.
        observations: as for :meth:`ConditionalSMC.sweep`.
        max_plate_nesting: the plates the model nests inside a step.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: the trajectory's length or sites do not fit the model and the observations.

    Example:
        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> one = torch.eye(1)
        >>> ssm = LinearGaussianSSM(one, one, one, one, torch.zeros(1), one)
        >>> path = Trajectory([{}, {"x_0": torch.zeros(1)}], [{}, {"x": torch.zeros(1)}])
        >>> log_density = trajectory_log_density(ssm, path, torch.zeros(1, 1))
        >>> round(float(log_density), 4)  # 2 log N(0; 0, 1)
        -1.8379
    """
    csmc = ConditionalSMC(model, 2, ancestor_sampling=False, max_plate_nesting=max_plate_nesting)
    return csmc.log_density(trajectory, observations, *args, **kwargs)


def _latent_values(trace: Trace) -> dict[str, Tensor]:
    return {name: site["value"] for name, site in trace.nodes.items() if is_latent(site)}


def _shifted(log_w: Tensor | None, n: int, ys: list, where: str) -> Tensor:
    """The log-weights less their maximum (the sweep never needs them normalised), checked."""
    if log_w is None:
        like = next((y for y in ys if isinstance(y, Tensor) and y.is_floating_point()), None)
        dtype = like.dtype if like is not None else torch.get_default_dtype()
        device = like.device if like is not None else None
        return torch.zeros(n, dtype=dtype, device=device)
    return _less_max(log_w, f"at {where} every particle has zero (or infinite) weight: check the model and the observation")


def _categorical(log_w: Tensor, where: str) -> Tensor:
    message = f"at {where} every particle has zero weight: the model gives the observation (or the reference) zero density"
    return torch.multinomial(_less_max(log_w, message).exp(), 1).squeeze(-1)


def _less_max(log_w: Tensor, message: str) -> Tensor:
    """``log_w`` (NaN read as zero weight) less its maximum; ``message`` when no weight is left."""
    log_w = torch.nan_to_num(log_w, nan=-math.inf)
    top = log_w.max()
    if not bool(torch.isfinite(top)):
        raise ValueError(message)
    return log_w - top


def _check_observations(observations: Any) -> tuple[list, list[bool]]:
    if isinstance(observations, Tensor):
        if observations.dim() == 0:
            raise ValueError("observations must have a leading time dimension, got a scalar tensor")
        steps = list(observations.unbind(0))
    elif isinstance(observations, Sequence) and not isinstance(observations, str):
        steps = list(observations)
    else:
        raise ValueError(f"observations must be a tensor (T, ...) or a sequence of tensors and None, got {type(observations).__name__}")
    if not steps:
        raise ValueError("observations must have at least one time step")
    if isinstance(observations, Tensor) and observations.is_floating_point() and observations[0].numel():
        # the whole sequence at once, by the shared rule (inf is an error naming its step)
        status = row_status(observations.reshape(len(steps), -1))
        if not bool(status.partly.any()):
            return steps, status.missing.tolist()
    missing = []
    for t, y in enumerate(steps):
        status = step_observation(y, t)
        if status.observed is not None:
            raise ValueError(
                f"observation at time step {t} is partly missing: particle Gibbs scores whole observations only (give NaN for all or none of its entries)"
            )
        missing.append(status.missing)
    return steps, missing
