r"""The look-ahead of the auxiliary particle filter: how ``SMC(auxiliary=True)`` finds and calls it.

See ``docs/math/smc.md#auxiliary-particle-filter``. The guide (or, without one, the model) defines

.. code-block:: python

    def look_ahead(self, state, y, *args, **kwargs) -> Tensor:
        # log eta_t(x_{t-1}): how well each particle of state predicts y_t, shape (B, N)
        # or (N,) with one filter, the particle dims of state's tensors

It takes the arguments of ``step`` and returns, per particle, an auxiliary log-weight
:math:`\log \eta_t(x_{t-1})`: ideally the predictive log-likelihood :math:`\log p(y_t \mid x_{t-1})`,
any finite function of the particle and the data otherwise (the estimates stay unbiased; only
their variance depends on it). It runs inside the particle plates and the model's module context,
may not write ``state`` and may not sample. The engine resamples by :math:`w_{t-1} \eta_t` before it
moves the particles and divides the new weights by the ancestor's :math:`\eta_t`
(:mod:`~pyro_smc.infer.smc.first_stage`).

Example:
    >>> import torch
    >>> from pyro_smc.infer.smc.importance import ParticleLayout
    >>> from pyro_smc.infer.smc.step import StepInputs, StepProgram
    >>> class Guide:
    ...     def init(self, state):
    ...         pass
    ...     def step(self, state, y):
    ...         pass
    ...     def look_ahead(self, state, y):
    ...         return torch.distributions.Normal(state["x"], 1.0).log_prob(y)
    >>> layout = ParticleLayout(num_filters=1, num_particles=3, max_plate_nesting=0)
    >>> program = StepProgram(Guide(), None, layout)
    >>> state = {"x": torch.tensor([0.0, 1.0, 3.0])}
    >>> fn = look_ahead_of(Guide(), None)
    >>> log_eta = evaluate(program, fn, state, StepInputs((torch.tensor(1.0),), {}, t=0))
    >>> log_eta.shape, int(log_eta.argmax())
    (torch.Size([1, 3]), 1)
"""

from __future__ import annotations

from typing import Any, Callable

import pyro.poutine as poutine
import torch
from torch import Tensor

from pyro_smc.infer.smc.step import StepInputs, StepProgram

__all__ = ["LOOK_AHEAD", "evaluate", "look_ahead_of"]

#: The name of the method ``SMC(auxiliary=True)`` calls.
LOOK_AHEAD = "look_ahead"


def look_ahead_of(model: Any, guide: Any) -> Callable:
    """The look-ahead ``SMC(auxiliary=True)`` calls: the guide's, else the model's.

    Raises:
        ValueError: neither defines a callable ``look_ahead``.
    """
    for program in (guide, model):
        fn = getattr(program, LOOK_AHEAD, None) if program is not None else None
        if callable(fn):
            return fn
    raise ValueError(
        "auxiliary=True needs a look_ahead(state, y, *args) method on the guide (or on the model) returning the "
        "per-particle auxiliary log-weights log eta_t(x_{t-1}), e.g. the predictive log p(y_t | x_{t-1})"
    )


def evaluate(program: StepProgram, fn: Callable, state: Any, inputs: StepInputs) -> Tensor:
    """Calls the look-ahead on the particles and checks what it returns.

    Args:
        program: the engine's :class:`~pyro_smc.infer.smc.step.StepProgram` (its plates and module
            context).
        fn: the look-ahead.
        state: the particles of the previous step (locked while it runs, if an ``SMCState``).
        inputs: the step's arguments (the observation first).

    Returns:
        ``(B, N)`` the auxiliary log-weights, in the dtype of the result.

    Raises:
        ValueError: naming the step: the result is not a floating tensor of the particle shape, is
            NaN or ``+inf``, or the look-ahead sampled a site.
    """
    layout = program.layout
    locked = state.locked() if hasattr(state, "locked") else _nothing()
    with program.handlers(), locked, poutine.trace() as tracer:
        out = fn(state, *inputs.args, **inputs.kwargs)
    where = inputs.where
    if any(site["type"] == "sample" for site in tracer.trace.nodes.values()):
        raise ValueError(f"at {where}: look_ahead sampled a site; it must be a deterministic function of the particles and the data")
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise ValueError(f"at {where}: look_ahead must return a floating-point tensor of log-weights, got {type(out).__name__}")
    if tuple(out.shape) not in (layout.particle_shape, (layout.num_filters, layout.num_particles)):
        raise ValueError(
            f"at {where}: look_ahead returned shape {tuple(out.shape)}; it must return one log-weight per particle, "
            f"shape {layout.particle_shape} (the particle dims of the state)"
        )
    if bool(torch.isnan(out).any()) or bool((out == float("inf")).any()):
        raise ValueError(f"at {where}: look_ahead returned NaN or +inf log-weights; return finite values (or -inf to rule a particle out)")
    return out.reshape(layout.num_filters, layout.num_particles)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
