r"""One step of the online variational filter: the model's ``step`` at fixed inputs.

See ``docs/math/streaming.md#per-step-elbo-increment``.

Within one observation :class:`~pyro_smc.OnlineVariationalFilter` re-runs ``model.step`` many times
(discovery, Newton steps, every optimisation iteration, the regression), each time from the same
starting point: the same model attributes, the same carried ``state``, the same observation and
arguments, only the values of ``x_{t-1}`` and ``x_t`` changing. :class:`StepContext` holds that
starting point, built once per step, and runs the model from it, returning log-densities read off
the trace by :mod:`pyro_smc.tracing` (latent-site selection and Pyro's scaled, masked
``Trace.compute_log_prob``).

Missing observations follow the rule of every engine: a ``None`` or all-NaN observation is
predict-only (no observed site is scored; with ``None`` the model samples its observation sites
itself, and those draws are not scored either), a partly-NaN one or one with an ``inf`` is an
error naming the step (:func:`observation_missing`), and so is an observation of another shape than
the site that observes it, which Pyro would broadcast (:func:`~pyro_smc.tracing.check_observed_shapes`).

Example:
    >>> import torch
    >>> from pyro_smc.infer.online.context import StepContext
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> state = {}
    >>> ssm.init(state)
    >>> ctx = StepContext(
    ...     ssm, dict(vars(ssm)), state, previous=None, y=torch.zeros(2), missing=False, t=0
    ... )
    >>> ctx, prior = ctx.discover(num_samples=4, state_dim=2)
    >>> ctx.site, ctx.state_key, prior.x_prior.shape
    ('x_0', 'x', torch.Size([1, 2]))
    >>> ctx.log_joint(None, torch.zeros(3, 2))[0].shape  # log f + log g per sample
    torch.Size([3])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyro.poutine as poutine
import torch
from pyro.distributions import TorchDistribution
from pyro.poutine.trace_struct import Trace
from torch import Tensor

from pyro_smc.observations import step_observation
from pyro_smc.tracing import check_observed_shapes, is_scored, latent_sites, missing_observation_sites, module_context, param_sites, site_log_probs

__all__ = ["Discovery", "StepContext", "observation_missing"]


def observation_missing(y: Any, t: int, expected_shape: torch.Size | None) -> bool:
    """Checks step ``t``'s observation by the rule of every engine
    (:func:`pyro_smc.observations.step_observation`); returns whether it is missing.

    The online filter scores whole observation sites, so a partly-NaN observation, which ``SMC``
    and the Gaussian engines condition on entry by entry, is an error here.

    Args:
        y: the observation, a tensor or ``None``.
        t: the 0-based time step, for the messages.
        expected_shape: the shape of earlier observations (``None`` before the first).

    Raises:
        ValueError: ``y`` is not a tensor or ``None``, has another shape than earlier
            observations, contains ``inf``, or is partly NaN, naming the time step.

    Example:
        >>> import math, torch
        >>> observation_missing(torch.full((2,), math.nan), 3, None)
        True
        >>> observation_missing(torch.tensor([math.nan, 1.0]), 3, None)
        Traceback (most recent call last):
            ...
        ValueError: observation at time step 3 is partly NaN; the online filter supports only a wholly missing (all-NaN) observation
    """
    status = step_observation(y, t, expected_shape)
    if status.observed is not None:
        raise ValueError(f"observation at time step {t} is partly NaN; the online filter supports only a wholly missing (all-NaN) observation")
    return status.missing


class Discovery(NamedTuple):
    """What a plain run of ``model.step`` from ``q_{t-1}`` draws tells the filter.

    Attributes:
        x_prev: the ``q_{t-1}`` draws ``(N, d)`` it ran from (``None`` at the first step).
        x_prior: the model's draws of ``x_t`` from them, ``(N, d)`` (``(1, d)`` at the first step).
        prior_fn: the distribution the latent site was drawn from (batch shape ``(N,)`` or ``()``).
        param_names: the ``pyro.param`` sites the run read, in order.
    """

    x_prev: Tensor | None
    x_prior: Tensor
    prior_fn: TorchDistribution
    param_names: list[str]


@dataclass(frozen=True)
class StepContext:
    """The fixed inputs of one step of ``model.step``, and runs of it at chosen ``x_{t-1}``, ``x_t``.

    Attributes:
        model: the ``init``/``step`` model.
        snapshot: the model's attributes at the start of the step, restored before every run so
            that a model counting steps in ``self._t`` sees the same count each time.
        state: the carried ``state`` before the step (each run works on a copy).
        previous: the frozen ``q_{t-1}(x_{t-1})``, event shape ``(d,)`` (``None`` at the first step).
        y: the observation (``None`` when missing).
        missing: whether the step is predict-only.
        t: the 0-based step index.
        args, kwargs: ``model.step``'s further arguments.
        site: the latent site's name (set by :meth:`discover`).
        state_key: the ``state`` entry holding ``x_t`` (set by :meth:`discover` when ``None``).
    """

    model: Any
    snapshot: dict[str, Any]
    state: dict[str, Any]
    previous: TorchDistribution | None
    y: Tensor | None
    missing: bool
    t: int
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    site: str | None = None
    state_key: str | None = None

    def run(self, x_prev: Tensor | None, condition: dict[str, Tensor] | None = None) -> tuple[Trace, dict]:
        """Runs ``model.step`` from ``x_{t-1} = x_prev`` with the sites in ``condition`` fixed.

        The run is blocked from enclosing handlers and inside the model's ``PyroModule`` context.

        Returns:
            The trace and the ``state`` after the run.
        """
        vars(self.model).update(self.snapshot)
        state = dict(self.state)
        if x_prev is not None:
            state[self.state_key] = x_prev
        step = poutine.condition(self.model.step, data=condition) if condition else self.model.step
        with poutine.block(), module_context(self.model):
            trace = poutine.trace(step).get_trace(state, self.y, *self.args, **self.kwargs)
        return trace, state

    def discover(self, num_samples: int, state_dim: int) -> tuple[StepContext, Discovery]:
        """One plain run from ``num_samples`` draws of ``q_{t-1}``: finds the latent site, the state
        entry holding it and the parameters read, and returns the model's draws of ``x_t``.

        Returns:
            This context with ``site`` and ``state_key`` set, and the :class:`Discovery`.

        Raises:
            ValueError: the step does not sample exactly one latent site of shape ``(d,)`` stored
                in one ``state`` entry; the observation would be broadcast into the site observing
                it (:func:`~pyro_smc.tracing.check_observed_shapes`); or ``model.step`` raised a ``ValueError`` (its
                message then names the step).
        """
        x_prev = None if self.previous is None else self.previous.sample((num_samples,))
        try:
            trace, state = self.run(x_prev)
        except ValueError as error:
            raise ValueError(f"model.step raised at step {self.t}: {error}") from error
        names = latent_sites(trace)
        if self.y is None and len(names) > 1:
            # Without an observation the model samples its observation sites too; the state's
            # site is the one whose value the model stores.
            stored = [state[self.state_key]] if self.state_key in state else list(state.values())
            names = [name for name in names if any(trace.nodes[name]["value"] is v for v in stored)]
        if len(names) != 1:
            raise ValueError(f"model.step at step {self.t} must sample exactly one latent site, got {names}")
        name, node = names[0], trace.nodes[names[0]]
        value = node["value"]
        if value.shape[-1:] != (state_dim,) or value.dim() > 2:
            raise ValueError(f"latent site '{name}' at step {self.t} has shape {tuple(value.shape)}; the guide's state_dim is {state_dim}")
        state_key = self.state_key
        keys = [k for k, v in state.items() if v is value]
        if state_key is None:
            if len(keys) != 1:
                raise ValueError(f"could not find the state entry holding '{name}'; pass state_key= to OnlineVariationalFilter")
            state_key = keys[0]
        elif state.get(state_key) is not value:
            # The filter would put x_{t-1} where the model never reads it (a silent wrong answer).
            raise ValueError(
                f"state_key={state_key!r} does not hold the latent site '{name}' after model.step at step {self.t}"
                f"{f' (the model stores it in state[{keys[0]!r}])' if keys else ''}"
            )
        if value.dim() > 1:
            # self.state_key is where run() put x_(t-1) (None before the first discovery).
            _check_state_is_the_latent(state, state_key, self.state_key, name, value.shape[0], self.t)
        context = dataclasses.replace(self, site=name, state_key=state_key)
        # The model's draws are batched over the Monte Carlo samples (a leading dim) after the first step.
        check_observed_shapes(trace, (num_samples,) if value.dim() > 1 else (), where=f"step {self.t}")
        return context, Discovery(x_prev, value.reshape(-1, state_dim), node["fn"], param_sites(trace))

    def log_joint(self, x_prev: Tensor | None, x_t: Tensor) -> tuple[Tensor, dict]:
        """``log f(x_t | x_prev) + log g(y_t | x_t)`` per sample (``log f`` alone when missing).

        Args:
            x_prev: ``(N, d)`` or ``None`` at the first step (then ``log f`` is the initial density).
            x_t: ``(N, d)``.

        Returns:
            The log-densities ``(N,)`` and the ``state`` after the step.
        """
        trace, state = self.run(x_prev, {self.site: x_t})
        return _sum_per_sample(trace, [self.site] + self._likelihood_sites(trace), x_t.shape[0], x_t), state

    def log_likelihood(self, x: Tensor, x_prev: Tensor | None) -> Tensor:
        """``log g(y_t | x)`` at one state ``x`` ``(d,)`` (from ``x_prev`` ``(1, d)``), a scalar."""
        trace, _ = self.run(x_prev, {self.site: x.unsqueeze(0)})
        return _sum_per_sample(trace, self._likelihood_sites(trace), 1, x).sum()

    def observes(self, prior: Discovery) -> bool:
        """Whether the step scores any observed site (at a missing observation: a second
        observation or a ``pyro.factor`` of the step), from one run at the discovery's draws."""
        x_prev = None if prior.x_prev is None else prior.x_prev[:1]
        trace, _ = self.run(x_prev, {self.site: prior.x_prior.reshape(-1, prior.x_prior.shape[-1])[:1]})
        return bool(self._likelihood_sites(trace))

    def _likelihood_sites(self, trace: Trace) -> list[str]:
        """The observed sites of a run that make ``g(y_t | x_t)``: all but the latent site (which
        the run conditions on) and, at a missing observation, the site that takes it; the step's
        other observed sites stay."""
        skipped = set(missing_observation_sites(trace, self.y, f"step {self.t}")) if self.missing else set()
        return [name for name, node in trace.nodes.items() if is_scored(node) and node["is_observed"] and name != self.site and name not in skipped]


def _sum_per_sample(trace: Trace, names: list[str], n: int, like: Tensor) -> Tensor:
    """The sum of the named sites' log-densities, ``(n,)``: a site batched over the ``n`` samples
    is summed over its other dims; an unbatched one (a global factor) counts for every sample."""
    total = like.new_zeros(n)
    for log_p in site_log_probs(trace, names).values():
        log_p = torch.as_tensor(log_p, dtype=like.dtype, device=like.device)
        if log_p.dim() and log_p.shape[0] == n:
            log_p = log_p.reshape(n, -1).sum(-1)
        else:
            log_p = log_p.sum().expand(n)
        total = total + log_p
    return total


def _check_state_is_the_latent(state: dict, state_key: str, injected: str | None, name: str, num_samples: int, t: int) -> None:
    """Refuses a ``state`` entry besides the latent's that varies over the Monte Carlo draws.

    Each step redraws :math:`x_{t-1}` from :math:`q_{t-1}` under ``state_key`` alone; an entry the model
    computed from the previous draws (a stored prior mean ``A x``, a lag ``x_{t-2}``) would stay
    paired with other draws, and the ELBO would silently be that of another model (a running
    ELBO 16 nats below the evidence on a 2-d model storing ``A x``, 8 standard errors low on an
    AR(2) latent written with a lag entry).
    """
    for key, entry in state.items():
        if key in (state_key, injected) or not isinstance(entry, Tensor) or entry.dim() == 0 or entry.shape[0] != num_samples:
            continue
        if not bool((entry == entry[:1]).all()):
            raise ValueError(
                f"state[{key!r}] varies with the draws of '{name}' at step {t}: the streaming filter's state is the latent "
                f"state[{state_key!r}] alone (each step redraws it from the previous filtering distribution, and cannot "
                "redraw what the model computed from it, so the ELBO would pair the entry with the wrong draws). Compute it "
                f"inside step from state[{state_key!r}], make it part of the latent (an augmented state), or use SMC"
            )
