"""Particle smoothing for :class:`~pyro_smc.infer.smc.SMC`: the stored history and the backward passes.

With ``SMC(..., store_history=True)`` the engine keeps one record per ``step`` (:func:`step_record`):
the weighted particles and normalised log-weights before resampling, the particles and log-weights
the step propagated from (its *parents*: the particles after the previous step's resampling, if
any), each latent site's distribution ``fn`` (batch index = the parent) and value (index = the new
particle), and, when the step resampled with an index resampler, the ancestors it drew. Memory is
``O(T B N)`` (plus what the ``fn`` objects hold: their parameters, and their autograd graph when
the run had one).

:func:`smooth` draws trajectories from that history:

* ``"ffbs"`` (forward filtering, backward sampling): the last particle by the final weights, then
  at each earlier step a parent ``j`` with probability proportional to
  ``w_parent^j f(x_t | parent j)``, evaluated for all parents at once with one ``fn.log_prob``
  per latent site. Works with any resampler: after an index resampling the parents are equally
  weighted copies of weighted particles (followed back through the ancestors); after an
  optimal-transport (or kernel) resampling they are the moved particles themselves. Cost
  ``O(S B N)`` per step for ``S`` trajectories.
* ``"genealogy"``: the last particle by the final weights, then its ancestral line (index
  resamplers only: an optimal-transport resampler moves particles by a map and draws no ancestors).

See ``docs/math/smc.md#particle-smoothing``.

Example:
    >>> import torch
    >>> from pyro_smc import SMC
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(10)
    >>> smc = SMC(ssm, num_particles=50, num_filters=3, store_history=True).run(ys)
    >>> smc.smooth(7)["x"].shape                                 # (S, T, B, d)
    torch.Size([7, 10, 3, 2])
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pyro.poutine.trace_struct import Trace
from torch import Tensor
from torch.distributions import Distribution

from pyro_smc.infer.smc_weights import ParticleLayout
from pyro_smc.tracing import is_latent

__all__ = ["SMOOTHING_METHODS", "detached_record", "smooth", "step_record"]

#: The ``method=`` values of :func:`smooth`.
SMOOTHING_METHODS = ("ffbs", "genealogy")


def _batched(value: Tensor, layout: ParticleLayout) -> Tensor:
    """A per-particle tensor with leading dims ``(B, N)`` (a view)."""
    return value if layout.num_filters > 1 else value.unsqueeze(0)


def step_record(model_trace: Trace, state: dict, parent: tuple[dict, Tensor] | None, layout: ParticleLayout) -> dict[str, Any]:
    """The part of one step's record known right after the step's model ran (before weighting).

    Args:
        model_trace: the step's model trace.
        state: the state the step wrote (each latent site is matched to the state key holding
            its value, by identity, for smoothing through transported particles).
        parent: ``(state, log_weights)`` the step read, or ``None`` (no weights yet).
        layout: the particle dims.
    """
    sites = []
    for name, site in model_trace.nodes.items():
        if not is_latent(site):
            continue
        fn, value = site["fn"], site["value"]
        problem = None
        if tuple(fn.batch_shape) != layout.particle_shape or site.get("mask") is not None or site.get("scale", 1.0) != 1.0:
            problem = (
                f"site '{name}' has batch shape {tuple(fn.batch_shape)} (or a mask or scale); FFBS needs every latent "
                f"site of a step to be an unscaled, unmasked distribution of batch shape exactly {layout.particle_shape} "
                "(the particles), indexed by the parent"
            )
        key = next((k for k, v in state.items() if v is value), None)
        sites.append({"name": name, "fn": fn, "value": _batched(value.detach(), layout), "key": key, "problem": problem})
    parent_state = parent_log_w = None
    if parent is not None:
        parent_state = {k: _batched(v.detach(), layout) for k, v in parent[0].items()}
        parent_log_w = parent[1].detach()
    return {"sites": sites, "parent_state": parent_state, "parent_log_weights": parent_log_w}


def record_weighted(record: dict[str, Any], state: dict, log_weights: Tensor, layout: ParticleLayout) -> None:
    """Adds the weighted particles (before resampling) to a step's record."""
    record["state"] = {k: _batched(v.detach(), layout) for k, v in state.items()}
    record["log_weights"] = log_weights.detach()
    record["ancestors"] = None  # identity: not resampled
    record["transported"] = False


def record_resampling(record: dict[str, Any], need: Tensor, ancestors: Tensor | None, layout: ParticleLayout) -> None:
    """Adds a resampling of the filters ``need`` to a step's record.

    ``ancestors`` are the resampler's ``last_ancestors`` for those filters (``(len(need.nonzero()), N)``),
    or ``None`` when the resampler draws none (optimal transport, kernel): then the particles were
    transported and the record says so.
    """
    if ancestors is None:
        record["transported"] = True
        return
    ancestors = ancestors.reshape(-1, layout.num_particles)
    if bool(need.all()):
        record["ancestors"] = ancestors
        return
    full = torch.arange(layout.num_particles, device=ancestors.device).expand(layout.num_filters, -1).clone()
    full[need.nonzero().squeeze(-1)] = ancestors
    record["ancestors"] = full


def _detached_fn(fn: Distribution) -> Distribution:
    """A shallow copy of a distribution with every tensor (and nested distribution) detached."""
    out = copy.copy(fn)
    for name, value in vars(fn).items():
        if isinstance(value, Tensor):
            setattr(out, name, value.detach())
        elif isinstance(value, Distribution):
            setattr(out, name, _detached_fn(value))
    return out


def detached_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record without autograd graph, for checkpoints."""
    out = dict(record)
    out["sites"] = [dict(site, fn=_detached_fn(site["fn"])) for site in record["sites"]]
    return out


def _pick(values: Tensor, index: Tensor) -> Tensor:
    """``values[b, index[s, b]]``: ``(B, N, *event)`` and ``(S, B)`` to ``(S, B, *event)``."""
    filters = torch.arange(values.shape[0], device=values.device)
    return values[filters, index]


def _log_transition(record: dict[str, Any], values: dict[str, Tensor], layout: ParticleLayout) -> Tensor | int:
    """``log f(x | parent j)`` of a step for the chosen values ``(S, B, *event)`` against all
    parents: ``(S, B, N)`` (``0`` for a step without latent sites)."""
    total: Tensor | int = 0
    for site in record["sites"]:
        if site["problem"] is not None:
            raise ValueError(site["problem"])
        value = values[site["name"]]
        if layout.num_filters > 1:
            log_f = site["fn"].log_prob(value.unsqueeze(2))  # (S, B, 1, *event) against (B, N)
        else:
            log_f = site["fn"].log_prob(value[:, 0].unsqueeze(1)).unsqueeze(1)  # (S, 1, *event) against (N,)
        total = total + log_f
    return total


def _categorical(logits: Tensor, num_samples: int | None = None) -> Tensor:
    """One draw per row of ``logits`` (``num_samples`` rows of draws if given), by inverse CDF:
    one ``exp``, a ``cumsum`` and a binary search per row (ten times faster than
    ``torch.distributions.Categorical`` on ``(100, 10, 1000)`` logits)."""
    if num_samples is not None:
        logits = logits.expand((num_samples,) + logits.shape)
    top = logits.amax(-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        raise ValueError(
            "particle smoothing: a backward step found no parent with a finite weight times transition density (every f(x_t | parent) is zero, or NaN)"
        )
    cdf = (logits - top).exp().cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), dtype=cdf.dtype, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def _site_values_from_state(record: dict[str, Any], parent_state: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """The latent values of transported parents, read from the state keys that hold them."""
    values = {}
    for site in record["sites"]:
        if site["key"] is None or site["key"] not in parent_state:
            raise ValueError(
                f"FFBS through an optimal-transport (or kernel) resampling needs each latent site's value to be "
                f"stored in the state (as state[key] = pyro.sample(...)); site '{site['name']}' is not"
            )
        values[site["name"]] = _pick(parent_state[site["key"]], index)
    return values


@torch.no_grad()
def smooth(history: list[dict[str, Any]], num_samples: int, method: str, layout: ParticleLayout, has_ancestors: bool) -> dict[str, Tensor]:
    """Smoothed trajectories from an engine's stored history (see the module docstring).

    Args:
        history: one record per step (:func:`step_record` and the ``record_*`` helpers).
        num_samples: trajectories ``S`` per filter.
        method: ``"ffbs"`` or ``"genealogy"``.
        layout: the particle dims.
        has_ancestors: whether the resampler reports ancestors (``last_ancestors``).

    Returns:
        ``{key: (S, T, B, *event)}`` for every floating-point state key, detached.

    Raises:
        ValueError: ``"genealogy"`` without ancestors; ``"ffbs"`` with a latent site that is not
            a per-particle distribution, or through a transport whose latent values are not in the state.
    """
    last = history[-1]
    keys = [k for k, v in last["state"].items() if v.is_floating_point() and all(k in rec["state"] for rec in history)]
    if method == "genealogy" and (not has_ancestors or any(rec["transported"] for rec in history)):
        raise ValueError(
            "method='genealogy' needs the ancestors an index resampler draws; this resampler moves the particles "
            "by a transport map (optimal transport) or a kernel and draws none: use method='ffbs'"
        )
    index = _categorical(last["log_weights"], num_samples)  # (S, B)
    out = [{k: _pick(last["state"][k], index) for k in keys}]
    values = {site["name"]: _pick(site["value"], index) for site in last["sites"]}
    for t in range(len(history) - 1, 0, -1):
        record, previous = history[t], history[t - 1]
        if method == "genealogy":
            parent = index
        else:
            logits = record["parent_log_weights"] + _log_transition(record, values, layout)
            parent = _categorical(logits)  # (S, B)
        if previous["transported"]:
            # The parents are the transported particles themselves.
            out.append({k: _pick(record["parent_state"][k], parent) for k in keys})
            values = _site_values_from_state(previous, record["parent_state"], parent) if t > 1 else {}
            continue
        ancestors = previous["ancestors"]
        index = parent if ancestors is None else ancestors.gather(1, parent.transpose(0, 1)).transpose(0, 1)
        out.append({k: _pick(previous["state"][k], index) for k in keys})
        values = {site["name"]: _pick(site["value"], index) for site in previous["sites"]}
    out.reverse()
    return {k: torch.stack([row[k] for row in out], dim=1) for k in keys}
