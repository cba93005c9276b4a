r"""The inner particle filters of :class:`~pyro_smc.infer.smc2.SMC2`: one per parameter particle,
run side by side as one batched :class:`~pyro_smc.SMC`.

With :math:`N_\theta` parameter particles and :math:`N_x` state particles each, the filters are a
single ``SMC(model, num_particles=N_x, num_filters=N_theta)``. Each static parameter reaches the
model as a plain tensor attribute (:meth:`StaticParameters.fixed
<pyro_smc.infer.static_parameters.StaticParameters.fixed>`) of shape ``(N_theta, 1, *shape)``,
``shape`` its prior's shape: the filter dimension first, then a dimension of one that broadcasts
against the particle dimension. That is the layout of the particles themselves,
``(N_theta, N_x, ...)``, so a model written with Pyro's broadcasting rules (batch dimensions on the left of event
dimensions) runs unchanged: ``self.rho * x`` for a scalar ``rho`` and a scalar state, and
``self.rho[..., None] * x`` for a scalar ``rho`` and a state vector ``x`` of shape ``(..., d)``.

Two more rules follow from sharing one model between the filters: the model reads its parameters
at every step rather than caching functions of them in ``init``, and it never turns a parameter
into a Python number.

Moving a filter from one parameter particle to another (resampling the parameter particles) or
replacing it by a filter run afresh (an accepted move) goes through the engine's public
checkpoint, :meth:`SMC.state_dict <pyro_smc.SMC.state_dict>`: the particles, weights and
log-evidence of every filter are indexed or merged along the filter dimension and loaded back.

Example:
    >>> import pyro, pyro.distributions as dist, torch
    >>> from pyro.nn import PyroModule, PyroSample
    >>> from pyro_smc.infer.static_parameters import StaticParameters
    >>> class AR1(PyroModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
    ...     def init(self, state):
    ...         state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))
    ...     def step(self, state, y=None):
    ...         state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], 1.0))
    ...         pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)
    >>> model = AR1()
    >>> params = StaticParameters(model)
    >>> filters = InnerFilters(params, model, None, num_filters=3, num_particles=50)
    >>> values = {"rho": torch.tensor([-0.5, 0.0, 0.5])}
    >>> smc = filters.start(values, (), {})
    >>> filters.advance(smc, values, torch.tensor(1.0), (), {})
    >>> log_evidence(smc).shape
    torch.Size([3])
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from pyro_smc.infer.smc import SMC, ParticleDegeneracyWarning
from pyro_smc.infer.static_parameters import StaticParameters

__all__ = ["InnerFilters", "log_evidence"]

_CONVENTION = (
    "SMC2 runs one filter per parameter particle as one batched SMC: each static parameter reaches "
    "the model with shape (num_parameter_particles, 1, *shape), which must broadcast against the "
    "particles (num_parameter_particles, num_particles, ...); e.g. write self.rho[..., None] * x "
    "for a scalar rho and a state vector x, and never turn a parameter into a Python number"
)


def log_evidence(smc: SMC) -> Tensor:
    r"""``(B,)``: the filters' :math:`\log \hat p(y_{1:t} \mid \theta)`, zeros before any weighing."""
    try:
        # Inner filters of implausible parameters collapse by design: SMC2 reweights them away.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ParticleDegeneracyWarning)
            return smc.log_evidence
    except RuntimeError:  # init scored nothing: no weights yet
        like = next(iter(smc.state.values()), None)
        dtype = like.dtype if isinstance(like, Tensor) and like.is_floating_point() else torch.get_default_dtype()
        return torch.zeros(smc.num_filters, dtype=dtype, device=None if like is None else like.device)


class InnerFilters:
    """Builds, steps, replays, reindexes and merges the batched inner filters.

    Args:
        params: the model's static parameters.
        model: the ``init``/``step`` Pyro model.
        guide: the filters' proposal, or ``None`` for the bootstrap filter.
        num_filters: ``N_theta``, one filter per parameter particle.
        num_particles: ``N_x``, the state particles of each filter.
        **options: further keyword arguments of :class:`~pyro_smc.SMC` (``resampler``,
            ``ess_threshold``, ``max_plate_nesting``, ``compile``).
    """

    def __init__(self, params: StaticParameters, model: Any, guide: Any, num_filters: int, num_particles: int, **options: Any) -> None:
        self.params, self.model, self.guide = params, model, guide
        self.num_filters, self.num_particles = num_filters, num_particles
        self.options = options
        self._cached: tuple | None = None

    def model_values(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: (B, *shape)}`` -> ``{name: (B, 1, *shape)}``, as the model receives them.

        The same values give the same tensor objects at every step: the filters' compiled step
        takes an attribute that changes identity between steps for a side effect of the step."""
        key = tuple(id(v) for v in values.values())
        if self._cached is None or self._cached[0] != key:
            # the values are kept too, so that their ids are not reused while cached
            self._cached = (key, dict(values), {n: v.unsqueeze(1) for n, v in values.items()})
        return self._cached[2]

    def _run(self, smc: SMC, values: Mapping[str, Tensor], call: str, *args: Any, **kwargs: Any) -> None:
        with self.params.fixed(self.model_values(values)):
            try:
                getattr(smc, call)(*args, **kwargs)
            except (RuntimeError, ValueError) as error:
                # torch's messages for tensors that do not broadcast or are not one number
                if any(word in str(error).lower() for word in ("size", "shape", "scalar", "broadcast")):
                    raise ValueError(f"{_CONVENTION}; the model raised: {error}") from error
                raise

    def start(self, values: Mapping[str, Tensor], args: Sequence[Any], kwargs: Mapping[str, Any]) -> SMC:
        """New filters at the parameters ``values`` ``{name: (B, *shape)}``, after ``init``."""
        smc = SMC(self.model, self.guide, self.num_particles, num_filters=self.num_filters, progress_bar=False, **self.options)
        self._run(smc, values, "init", *args, **kwargs)
        return smc

    def advance(self, smc: SMC, values: Mapping[str, Tensor], y: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """One step of every filter, on observation ``y``, at the parameters ``values``."""
        self._run(smc, values, "step", y, *args, **kwargs)

    def replay(self, values: Mapping[str, Tensor], init: tuple, steps: Sequence[tuple]) -> SMC:
        """Fresh filters at ``values`` run through ``init`` ``(args, kwargs)`` and every step
        ``(y, args, kwargs)`` so far: the likelihood estimates of a proposed move."""
        smc = self.start(values, *init)
        for y, args, kwargs in steps:
            self.advance(smc, values, y, args, kwargs)
        return smc

    @staticmethod
    def select(smc: SMC, index: Tensor) -> None:
        """Makes filter ``b`` a copy of filter ``index[b]`` (``index``: int64 ``(B,)``)."""
        checkpoint = smc.state_dict()
        _load(smc, checkpoint, {k: _map(lambda x: x[index], checkpoint[k]) for k in _FILTER_KEYS})

    @staticmethod
    def merge(smc: SMC, other: SMC, accept: Tensor) -> None:
        """Replaces the filters of ``smc`` where ``accept`` (bool ``(B,)``) by those of ``other``."""
        mine, theirs = smc.state_dict(), other.state_dict()
        merged = {k: _map2(lambda a, b: torch.where(_expand(accept, a), b, a), mine[k], theirs[k]) for k in _FILTER_KEYS}
        _load(smc, mine, merged)


# The checkpoint entries with a leading filter dimension.
_FILTER_KEYS = ("state", "weights", "ess", "weighted")


def _load(smc: SMC, checkpoint: dict, replaced: dict) -> None:
    # The step records and the smoothing history of the old filters no longer describe the new
    # ones: SMC2 keeps its own records. The model's attributes and the random stream stay as they
    # are (the filters share one model, and a rewound stream would repeat draws).
    new = {**checkpoint, **replaced, "records": [], "history": [], "model_attributes": None, "guide_attributes": None}
    smc.load_state_dict(new, restore_rng=False)


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    return mask.reshape(mask.shape + (1,) * (like.dim() - 1))


def _map(fn, x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return type(x)(*[_map(fn, v) for v in x]) if hasattr(x, "_fields") else type(x)(_map(fn, v) for v in x)


def _map2(fn, a: Any, b: Any) -> Any:
    if a is None and b is None:
        return None
    if a is None or b is None:  # an evidence term one side has not reported yet: zero
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
    if isinstance(a, Tensor):
        return fn(a, b)
    if isinstance(a, dict):
        return {k: _map2(fn, a[k], b[k]) for k in a}
    pairs = [_map2(fn, u, v) for u, v in zip(a, b)]
    return type(a)(*pairs) if hasattr(a, "_fields") else type(a)(pairs)
