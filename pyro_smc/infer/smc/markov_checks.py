r"""Whether a step's transition density can be read off its latent sites: the checks behind the
marginal stop-gradient estimator and particle smoothing (``"ffbs"``, ``"rejection"``).

Both evaluate :math:`f(x_t^i \mid x_{t-1}^j)` for every parent ``j`` from the distributions the
step's latent sites were built with (batch index = the parent). That is the transition density
only when

1. no latent site's distribution depends on another latent site of the same step: the stored
   distribution of a site was built with its own particle's earlier draws of the step, not with
   the draws it is evaluated at (a switching model ``z_t``, then ``x_t`` given ``z_t``);
2. (smoothing) every state entry the step writes is a function of the step's draws alone: an
   entry copied or computed from the previous state (the lag of an AR(2) written as
   ``state["x_prev"] = x``, a per-particle parameter carried along) puts a point mass into the
   transition that no latent site shows, and a backward draw would join a particle to a parent
   its lag did not come from.

Each is checked by running the step once more from the state before it, conditioned on draws:
(1) with the step's draws rolled by one particle and the parents kept, comparing each site's
log-density at the original draws; (2) with the parents rolled by one particle and the draws
kept, comparing the state entries that do not hold a latent site's value. A step with a single
latent site skips (1), and one whose every state entry holds a latent site's value, or is the
same for every particle (a step counter), skips (2), so most models never pay for a second run.
The re-run draws no random numbers (every latent site is conditioned), and the state and the
model's plain attributes are restored afterwards.
See ``docs/math/smc.md#particle-smoothing``.

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro_smc import SMC
    >>> class AR2:                             # the state (x_t, x_{t-1}) carries a lag
    ...     def init(self, state):
    ...         state["x"] = pyro.sample("x_0", dist.Normal(0.0, 1.0))
    ...         state["lag"] = torch.zeros_like(state["x"])
    ...     def step(self, state, y):
    ...         loc = 0.5 * state["x"] + 0.3 * state["lag"]
    ...         x = pyro.sample("x", dist.Normal(loc, 1.0))
    ...         state["lag"], state["x"] = state["x"], x
    ...         pyro.sample("y", dist.Normal(x, 1.0), obs=y)
    >>> smc = SMC(AR2(), num_particles=20, store_history=True).run(torch.zeros(5))
    >>> smc.smooth(3, method="genealogy")["x"].shape                    # (S, T, B)
    torch.Size([3, 5, 1])
    >>> smc.smooth(3)                                                   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: particle smoothing at time step 1: state['lag'] depends on the previous state ...
"""

from __future__ import annotations

from typing import Any

import pyro.poutine as poutine
import torch
from pyro.poutine.trace_struct import Trace
from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes, restore_attributes
from pyro_smc.infer.smc.importance import ParticleLayout
from pyro_smc.tracing import is_latent

__all__ = ["dependent_site", "parent_dependent_key", "transition_problem"]


def _rerun(program, proposal, before: tuple[dict, Any], state: dict, inputs, data: dict[str, Tensor], parents: dict) -> tuple[Trace, dict]:
    """The step's model run again from the state ``parents`` (and the model's attributes of
    ``before``), conditioned on ``data``: its trace and the state it wrote. ``state`` and the
    model's attributes are left as they were."""
    model = program.model
    after = (dict(state), plain_attributes(model))
    try:
        dict.clear(state)
        dict.update(state, parents)
        restore_attributes(model, before[1])
        with program.handlers():
            trace = poutine.trace(poutine.condition(proposal.model_fn, data=data)).get_trace(state, *inputs.args, **inputs.kwargs)
        written = dict(state)
    finally:
        dict.clear(state)
        dict.update(state, after[0])
        restore_attributes(model, after[1])
    return trace, written


def _latent(trace: Trace) -> dict[str, Tensor]:
    return {name: site["value"] for name, site in trace.nodes.items() if is_latent(site)}


def dependent_site(program, proposal, before: tuple[dict, Any], state: dict, inputs, layout: ParticleLayout) -> str | None:
    """The first latent site of the step just traced whose distribution depends on another
    latent site of the same step, or ``None`` (check 1 of the module docstring).

    Args:
        program: the engine's :class:`~pyro_smc.infer.smc.step.StepProgram`.
        proposal: the step's traced proposal (``proposal.model_trace``, ``proposal.model_fn``).
        before: the state (a dict copy) and the model's plain attributes before the step.
        state: the state the step wrote (restored after the re-run).
        inputs: the step's :class:`~pyro_smc.infer.smc.step.StepInputs`.
        layout: the particle dims.
    """
    trace = proposal.model_trace
    draws = _latent(trace)
    if len(draws) < 2:
        return None
    dim = len(layout.particle_shape) - 1
    rolled = {name: value.roll(1, dims=dim) for name, value in draws.items()}
    check, _ = _rerun(program, proposal, before, state, inputs, rolled, before[0])
    for name, value in draws.items():
        if not torch.equal(check.nodes[name]["fn"].log_prob(value), trace.nodes[name]["fn"].log_prob(value)):
            return name
    return None


def _same(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    # Rows computed at another position of a batched op may differ in the last bits.
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)


def _shared(value: Tensor, dim: int) -> bool:
    """Whether every particle holds the same ``value`` (a step counter): the same point mass
    whichever parent, so no re-run is needed for it."""
    return value.shape[dim] < 2 or torch.equal(value, value.narrow(dim, 0, 1).expand_as(value))


def parent_dependent_key(program, proposal, before: tuple[dict, Any], state: dict, inputs, layout: ParticleLayout) -> str | None:
    """The first state entry the step wrote that depends on the previous state beyond the
    step's draws, or ``None`` (check 2 of the module docstring). Arguments as for
    :func:`dependent_site`."""
    draws = _latent(proposal.model_trace)
    dim = len(layout.particle_shape) - 1
    derived = [key for key, value in state.items() if not any(value is draw for draw in draws.values()) and not _shared(value, dim)]
    if not derived:
        return None
    parents = {key: value.roll(1, dims=dim) for key, value in before[0].items()}
    _, written = _rerun(program, proposal, before, state, inputs, draws, parents)
    for key in derived:
        if key not in written or not _same(written[key], state[key]):
            return key
    return None


def transition_problem(program, proposal, before: tuple[dict, Any], state: dict, inputs, layout: ParticleLayout) -> str | None:
    """Why the latent sites of the step just traced do not give its transition density (both
    checks of the module docstring), or ``None`` when they do. Arguments as for
    :func:`dependent_site`."""
    site = dependent_site(program, proposal, before, state, inputs, layout)
    if site is not None:
        return f"the distribution of site '{site}' depends on another latent site of the same step"
    key = parent_dependent_key(program, proposal, before, state, inputs, layout)
    if key is not None:
        return f"state['{key}'] depends on the previous state beyond the step's draws (a lag or a carried value)"
    return None
