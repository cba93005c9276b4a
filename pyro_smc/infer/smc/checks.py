"""Input checks and warnings of the SMC engine, each naming the argument or the time step.

A step's observation is its first positional argument and follows the rule every engine follows
(:mod:`pyro_smc.observations`: ``None`` or all-NaN is predict-only, a partly-NaN observation is
scored on its observed entries, an ``inf`` is an error); a NaN in any other argument is an error
(:func:`check_finite_args`). What a run checks in each step's traces is in
:mod:`~pyro_smc.infer.smc.trace_checks`.

Example:
    >>> rest = dict(num_filters=1, max_plate_nesting=0, ess_threshold=0.5, resampler=None)
    >>> check_settings(num_particles=100, **rest)
    >>> check_settings(num_particles=0, **rest)
    Traceback (most recent call last):
        ...
    ValueError: num_particles must be an integer >= 1, got 0
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from pyro_smc.checks import boolean, int_at_least, positive_int, unit_interval
from pyro_smc.infer.smc.smoothing import SMOOTHING_METHODS
from pyro_smc.resamplers import GradientEstimator, IndexResampler, estimator_of

__all__ = [
    "DegeneracyMonitor",
    "ESTIMATOR_OPTION",
    "NonReparameterizedGradientWarning",
    "ParticleDegeneracyWarning",
    "check_finite_args",
    "check_first_stage",
    "check_marginal_supported",
    "check_resampler",
    "check_settings",
]


class NonReparameterizedGradientWarning(UserWarning):
    """A proposal site without ``rsample`` draws from a distribution whose parameters require grad.

    Its draws are not differentiable, and ``log_evidence`` carries no score-function terms for
    them, so parameters that act only through the site's distribution get no gradient (or a
    biased one). Emitted once per site-name prefix and run while grad mode is on. Not emitted
    with stop-gradient resampling, which adds those terms (see
    ``docs/math/smc.md#stop-gradient-resampling``).
    """


class ParticleDegeneracyWarning(UserWarning):
    """The weights of a run collapsed onto about one particle at many of its steps.

    The estimate then rests on one particle per step: ``log_evidence`` is typically far below the
    truth (its variance grows exponentially in the number of collapsed steps) and the filtering
    means follow a single path. Emitted once per run (at the end of :meth:`SMC.run <pyro_smc.SMC.run>`, or
    when ``log_evidence`` or ``result`` is read after :meth:`SMC.step <pyro_smc.SMC.step>` calls) when, in
    some filter, at least a fifth of the steps, and at least two, end with an effective sample
    size below 2 (with ``num_particles >= 4``), or when at one step at least half of the filters
    do so with ``num_particles >= 50`` (an observation far in the tail of the prediction). Remedies: more particles, a proposal that looks at the observation
    (a guide), or a less sharp observation model.

    Example:
        An observation noise of ``1e-6`` leaves one particle near each observation:

        >>> import warnings, torch, pyro, pyro.distributions as dist
        >>> from pyro_smc import SMC
        >>> from pyro_smc.infer import ParticleDegeneracyWarning
        >>> class Sharp:
        ...     def init(self, state):
        ...         self.t = 0
        ...     def step(self, state, y=None):
        ...         state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(torch.zeros(()), 1.0))
        ...         pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 1e-6), obs=y)
        ...         self.t += 1
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = SMC(Sharp(), num_particles=100).run(torch.randn(10))
        >>> [issubclass(w.category, ParticleDegeneracyWarning) for w in caught]
        [True]
    """


def check_resampler(resampler: Any) -> None:
    """A resampler is a callable instance ``resampler(particles, log_weights)``.

    Raises:
        ValueError: a class passed for an instance (``OTResampler`` for ``OTResampler()``), or a
            non-callable.
    """
    if isinstance(resampler, type):
        raise ValueError(f"resampler must be a resampler instance, got the class {resampler.__name__}; did you mean resampler={resampler.__name__}()?")
    if not callable(resampler):
        raise ValueError(f"resampler must be callable (particles, log_weights), got {resampler!r}")


# With at least this many particles, a step at which most filters' ESS falls below 2 is warned
# about on its own.
_TOGETHER_MIN_PARTICLES = 50


class DegeneracyMonitor:
    """Watches the effective sample sizes of a run's steps as they come and emits
    :class:`ParticleDegeneracyWarning`, once per run, when in some filter at least a fifth of the
    steps so far, and at least two, ended with ESS below 2, or when, with at least 50 particles,
    at least half of the filters ended one step with ESS below 2.

    :meth:`SMC.run <pyro_smc.SMC.run>` checks once, after its last step; a loop of
    :meth:`SMC.step <pyro_smc.SMC.step>` calls is checked whenever its ``log_evidence`` or its
    ``result`` is read, over the steps taken since the last check (a tally, so reading after every
    step costs a constant per step).

    Example:
        >>> import torch
        >>> monitor = DegeneracyMonitor(num_particles=100)
        >>> monitor.add(torch.tensor([[1.2], [80.0], [1.5]]))   # (steps, filters)
        >>> monitor.message() is not None                          # 2 of 3 steps collapsed
        True
    """

    def __init__(self, num_particles: int):
        self.num_particles = num_particles
        self.steps = 0
        self._counts: Tensor | None = None  # (B,) collapsed steps per filter
        self._first: Tensor | None = None  # (B,) first collapsed step per filter, -1 if none
        self._together: tuple[int, int, int] | None = None  # (step, collapsed filters, filters)
        self._warned = False

    def add(self, ess: Tensor) -> None:
        """Takes the ESS of the next steps, ``(k, B)``."""
        if ess.numel():
            collapsed = ess.detach() < 2
            # argmax gives the first maximum: each filter's first collapsed step of these.
            first = (self.steps + collapsed.int().argmax(0)).masked_fill(~collapsed.any(0), -1)
            if self._counts is None:
                self._counts, self._first = collapsed.sum(0), first
            else:
                self._counts = self._counts + collapsed.sum(0)
                self._first = torch.where(self._first >= 0, self._first, first)
            if self._together is None and self.num_particles >= _TOGETHER_MIN_PARTICLES:
                together = (collapsed.float().mean(1) >= 0.5).nonzero()
                if together.numel():
                    row = int(together[0, 0])
                    self._together = (self.steps + row, int(collapsed[row].sum()), collapsed.shape[1])
        self.steps += ess.shape[0]

    def message(self) -> str | None:
        """What the warning would say about the steps so far; ``None`` if nothing collapsed enough."""
        if self.num_particles < 4 or self._counts is None:
            return None
        worst = int(self._counts.argmax())
        count = int(self._counts[worst])
        # One collapsed step among a few is common with few particles; a fifth of a run is not.
        if count >= 2 and 5 * count >= self.steps:
            which = f" in filter {worst}" if self._counts.shape[0] > 1 else ""
            return (
                f"the weights collapsed onto about one particle (ESS < 2 of {self.num_particles}) at {count} of {self.steps} "
                f"steps{which}, first at time step {int(self._first[worst])}: log_evidence and the filtering means then rest on "
                "one particle per step and are unreliable (log_evidence typically far too low). Use more particles, a guide "
                "that proposes from the observation, or check the observation noise"
            )
        # Nor is one step at which most filters of many particles collapse at once: an observation
        # far in the tail of the prediction, whose increment then rests on one particle in every
        # filter (a float32 two-sensor model: log Z 82 nats low from one such step, with no warning).
        if self._together is not None:
            step, share, num_filters = self._together
            filters = f"{share} of {num_filters} filters" if num_filters > 1 else "the filter"
            return (
                f"at time step {step} the weights of {filters} collapsed onto about one particle (ESS < 2 of "
                f"{self.num_particles}): the observation lies far in the tail of the particles' prediction, and log_evidence "
                "rests on one particle there (typically far too low). Use more particles, a guide that proposes from the "
                "observation, or check the observation and its noise"
            )
        return None

    def warn(self, stacklevel: int) -> None:
        """Emits the warning of :meth:`message`, if any, unless this run has already had it;
        ``stacklevel`` as for :func:`warnings.warn`, counted from the caller of this method."""
        if self._warned:
            return
        text = self.message()
        if text is not None:
            self._warned = True
            warnings.warn(ParticleDegeneracyWarning(text), stacklevel=stacklevel + 1)


def check_marginal_supported(guide: Any, max_plate_nesting: int) -> None:
    """The marginal stop-gradient estimator's scope: a bootstrap filter without model plates.
    See ``docs/math/smc.md#marginal-stop-gradient``.

    Raises:
        ValueError: with a guide, or with ``max_plate_nesting > 0``.
    """
    if guide is not None:
        raise ValueError(
            "gradient='marginal_stop_gradient' supports the bootstrap filter only (guide=None): the marginal "
            f"proposal density of guide {type(guide).__name__} is not computed; use gradient='stop_gradient'"
        )
    if max_plate_nesting:
        raise ValueError(
            f"gradient='marginal_stop_gradient' needs max_plate_nesting == 0 (got {max_plate_nesting}): the "
            "pairwise transition densities are not computed for models with plates; use gradient='stop_gradient'"
        )


def check_settings(num_particles: Any, num_filters: Any, max_plate_nesting: Any, ess_threshold: Any, resampler: Any) -> None:
    """The settings of an ``SMC`` engine (and of ``SMCELBO``, which builds one per run).

    Raises:
        ValueError: naming the argument out of range (``resampler`` a class or not callable).
    """
    positive_int("num_particles", num_particles)
    positive_int("num_filters", num_filters)
    int_at_least("max_plate_nesting", max_plate_nesting, 0)
    unit_interval("ess_threshold", ess_threshold)
    if resampler is not None:
        check_resampler(resampler)


def check_first_stage(auxiliary: Any, qmc: Any, resampler: Any) -> None:
    """The ``auxiliary`` and ``qmc`` options of ``SMC`` against its resampler.

    Raises:
        ValueError: a flag that is not a bool; ``qmc=True`` with a resampler other than an index
            resampler; either with ``gradient="marginal_stop_gradient"``.
    """
    boolean("auxiliary", auxiliary)
    boolean("qmc", qmc)
    if qmc and resampler is not None and not isinstance(resampler, IndexResampler):
        raise ValueError(
            f"qmc=True resamples by the inverse CDF of its QMC points along the Hilbert curve; it takes an index resampler "
            f"(SystematicResampler, StratifiedResampler, MultinomialResampler) for its gradient= mode, got {type(resampler).__name__}"
        )
    if (auxiliary or qmc) and resampler is not None and estimator_of(resampler) is GradientEstimator.MARGINAL_SCORE:
        option = "auxiliary=True" if auxiliary else "qmc=True"
        raise ValueError(f'{option} does not support gradient="marginal_stop_gradient" (its mixture weights are the filtering weights); use "stop_gradient"')


def check_programs(model: Any, guide: Any) -> None:
    """The model and guide of an ``SMC`` engine have ``init`` and ``step`` methods."""
    for name, obj in (("model", model), ("guide", guide)):
        if obj is not None and not (callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))):
            raise ValueError(f"{name} must have init(state, ...) and step(state, ...) methods")


def check_smooth_request(store_history: bool, history: list, method: Any, num_samples: Any, max_plate_nesting: int) -> None:
    """The arguments of ``SMC.smooth``, against the engine's settings and the steps it took.

    Raises:
        RuntimeError: no history (``store_history=False``) or no step taken.
        ValueError: an unknown ``method``, ``num_samples < 1``, FFBS or rejection with model plates.
    """
    if not store_history:
        raise RuntimeError("SMC.smooth needs the particle history: build the engine with SMC(..., store_history=True)")
    if method not in SMOOTHING_METHODS:
        raise ValueError(f"method must be one of {SMOOTHING_METHODS}, got {method!r}")
    positive_int("num_samples", num_samples)
    if not history:
        raise RuntimeError("SMC has not taken a step; call run(observations) (or init() and step()) before smooth")
    if method in ("ffbs", "rejection") and max_plate_nesting:
        raise ValueError(f"method={method!r} needs max_plate_nesting == 0 (got {max_plate_nesting}): steps with model plates are not supported")


def check_finite_args(args: tuple, kwargs: dict, where: str, first: int = 0) -> None:
    """Rejects a NaN or infinite tensor argument of ``init`` or a step, naming it and the step.

    ``args`` are the positional arguments from position ``first`` on: a step's observation
    (position 0) has been checked already by :func:`pyro_smc.observations.step_observation`, so a
    step passes the rest with ``first=1``.
    """
    of = "of init" if where == "init" else f"of the step at {where}"
    named = [(f"argument {first + i} {of}", v) for i, v in enumerate(args)]
    named += [(f"keyword argument {k!r} {of}", v) for k, v in kwargs.items()]
    for name, value in named:
        if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            kind = "inf" if bool(torch.isinf(value).any()) else "NaN"
            raise ValueError(
                f"{name} contains {kind} (only the observation, the step's first argument, may be missing, as NaN)"
            )


#: Observation dtypes the engine refuses: log-weights and the running log-evidence accumulate over
#: steps, and half precision (3-4 significant digits, overflow at 65504) cannot hold them.
HALF_DTYPES = (torch.float16, torch.bfloat16)


#: The ``gradient=`` spelling of each score-function estimator, for messages.
ESTIMATOR_OPTION = {"score": "stop_gradient", "marginal_score": "marginal_stop_gradient"}


def check_quantile_request(store_history: bool, history: list, probs: Any, key: str | None) -> tuple[str, Tensor]:
    """The arguments of ``SMC.filtering_quantiles``: the state key and the levels as a tensor of
    the weights' dtype and device.

    Raises:
        RuntimeError: no history (``store_history=False``) or no step taken.
        ValueError: a level outside ``[0, 1]``, an unknown key (or none with several), labels.
    """
    if not store_history:
        raise RuntimeError("SMC.filtering_quantiles needs the particle history: build the engine with SMC(..., store_history=True)")
    if not history:
        raise RuntimeError("SMC.filtering_quantiles: nothing has been filtered yet; call run(observations)")
    last = history[-1]
    keys = list(last["state"])
    if key is None:
        if len(keys) != 1:
            raise ValueError(f"SMC.filtering_quantiles: the state has several keys {keys}; pass key=")
        key = keys[0]
    if key not in keys:
        raise ValueError(f"SMC.filtering_quantiles: unknown key {key!r}; the state holds {keys}")
    if not last["state"][key].is_floating_point():
        raise ValueError(f"SMC.filtering_quantiles: {key!r} holds labels; read their filtering probabilities from filtering_means")
    weights = last["log_weights"]
    levels = torch.as_tensor(list(probs), dtype=weights.dtype, device=weights.device)
    if levels.dim() != 1 or not bool(((levels >= 0) & (levels <= 1)).all()):
        raise ValueError(f"SMC.filtering_quantiles: probs must be levels in [0, 1], got {list(probs)}")
    return key, levels
