"""Particle smoothing for :class:`~pyro_smc.infer.smc.engine.SMC`: the stored history and the backward passes.

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
* ``"rejection"``: the same backward kernel as ``"ffbs"``, sampled by rejection (Douc, Garivier,
  Moulines and Olsson 2011; the hybrid of Dau and Chopin 2022): propose a parent by the parent
  weights alone, accept with probability ``f(x_t | parent) / C_t`` where ``C_t`` is the largest
  density at the mean over the step's parents, and give the draws still pending after
  ``max_rounds`` rounds (or earlier, once few are pending) the exact ``O(N)`` FFBS draw. The
  output has exactly the FFBS distribution; a round costs ``O(1)`` per pending draw for Gaussian
  transitions (``Normal``, ``MultivariateNormal``, ``Independent`` of those), whose density is
  evaluated from the chosen parent's gathered ``loc`` and scale. A step with any other latent
  distribution takes the exact FFBS draw.
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
from torch.distributions import Distribution, Independent, MultivariateNormal, Normal

from pyro_smc.infer.smc.importance import ParticleLayout, log_density_against_parents, transition_site_problem
from pyro_smc.infer.smc.markov_checks import transition_problem
from pyro_smc.ops.resample import inverse_cdf, weighted_quantiles
from pyro_smc.progress import progress
from pyro_smc.tracing import is_latent

__all__ = ["SMOOTHING_METHODS", "backward_kernel_problem", "detached_record", "smooth", "step_record"]

#: The ``method=`` values of :func:`smooth`.
SMOOTHING_METHODS = ("ffbs", "rejection", "genealogy")

#: Default number of rejection rounds of ``method="rejection"`` before the exact fallback.
REJECTION_MAX_ROUNDS = 10

#: The rounds of ``method="rejection"`` stop early once the exact fallback of the pending draws
#: would evaluate at most this many densities (pending draws times ``N``): about the fixed cost of
#: a round on a CPU. Stopping on the number of pending draws keeps the draws exact (see
#: :func:`_backward_rejection`).
REJECTION_FALLBACK_WORK = 32768


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
        problem = transition_site_problem(name, site, layout)
        problem = None if problem is None else f"particle smoothing: {problem}"
        key = next((k for k, v in state.items() if v is value), None)
        sites.append({"name": name, "fn": fn, "value": layout.batched_particles(value.detach()), "key": key, "problem": problem})
    parent_state = parent_log_w = None
    if parent is not None:
        parent_state = {k: layout.batched_particles(v.detach()) for k, v in parent[0].items()}
        parent_log_w = parent[1].detach()
    return {"sites": sites, "parent_state": parent_state, "parent_log_weights": parent_log_w, "problem": None}


def backward_kernel_problem(program, proposal, before: tuple[dict, Any], state: dict, inputs, layout: ParticleLayout) -> str | None:
    """Why the step just traced gives ``"ffbs"`` and ``"rejection"`` no backward kernel (``None``
    when it does): a latent site that depends on another site of the step, or a state entry that
    depends on the previous state beyond the step's draws (:mod:`~pyro_smc.infer.smc.markov_checks`).
    ``"genealogy"`` needs neither."""
    problem = transition_problem(program, proposal, before, state, inputs, layout)
    if problem is None:
        return None
    return (
        f"particle smoothing at {inputs.where}: {problem}, so the backward kernel cannot be read off the stored "
        "distributions; method='ffbs' and 'rejection' need every latent site to depend on the previous state only "
        "and the state to be written from the step's draws alone (use method='genealogy')"
    )


def record_weighted(record: dict[str, Any], state: dict, log_weights: Tensor, layout: ParticleLayout) -> None:
    """Adds the weighted particles (before resampling) to a step's record."""
    record["state"] = {k: layout.batched_particles(v.detach()) for k, v in state.items()}
    record["log_weights"] = log_weights.detach()
    record["ancestors"] = None  # identity: not resampled
    record["transported"] = False


def record_resampling(record: dict[str, Any], need: Tensor, ancestors: Tensor | None, layout: ParticleLayout) -> None:
    """Adds a resampling of the filters ``need`` to a step's record.

    ``ancestors`` are the ancestors the resampler returned for those filters (``(len(need.nonzero()), N)``),
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
        total = total + log_density_against_parents(site["fn"], values[site["name"]], layout)
    return total


def _categorical(logits: Tensor, num_samples: int | None = None) -> Tensor:
    """One draw per row of unnormalised ``logits`` (``num_samples`` rows of draws if given), by
    the inverse CDF of :func:`~pyro_smc.ops.resample.inverse_cdf` (ten times faster than
    ``torch.distributions.Categorical`` on ``(100, 10, 1000)`` logits)."""
    if num_samples is not None:
        logits = logits.expand((num_samples,) + logits.shape)
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise ValueError(
            "particle smoothing: a backward step found no parent with a finite weight times transition density (every f(x_t | parent) is zero, or NaN)"
        )
    u = torch.rand(logits.shape[:-1] + (1,), dtype=logits.dtype, device=logits.device)
    return inverse_cdf(logits.log_softmax(-1), u).squeeze(-1)


def _backward_exact(record: dict[str, Any], values: dict[str, Tensor], layout: ParticleLayout) -> Tensor:
    """The FFBS draw of each trajectory's parent: ``(S, B)``, ``O(S B N)``."""
    logits = record["parent_log_weights"] + _log_transition(record, values, layout)
    return _categorical(logits)


class _Gaussian:
    """A step's Gaussian latent distribution with its parameters laid out as ``(B, N, ...)``, so that
    the density under one chosen parent per draw is a gather (``O(1)`` per draw), not ``O(N)``.

    Densities are kept up to the constant ``-(k/2) log(2 pi)`` (``k`` scalar components), which
    cancels both in the acceptance ratio (the bound omits it too) and in the exact fallback's
    categorical. ``kind`` is ``"normal"`` (``loc``, ``scale`` of the base batch shape) or ``"mvn"``
    (``loc`` with the event dim; ``scale`` the Cholesky factor, or its inverse ``(d, d)`` when one
    factor is shared by all parents); ``event_dims`` counts the base batch dims that ``Independent``
    reinterpreted; ``log_norm`` (``(B, N)``) is each parent's log-density at its mean.
    """

    def __init__(self, kind: str, loc: Tensor, scale: Tensor, event_dims: int, shared_scale: bool, log_norm: Tensor):
        self.kind, self.loc, self.scale, self.event_dims, self.shared_scale = kind, loc, scale, event_dims, shared_scale
        self.log_norm = log_norm

    @classmethod
    def of(cls, fn: Distribution, layout: ParticleLayout) -> _Gaussian | None:
        """The Gaussian view of ``fn`` (batch shape = the particles), or ``None`` for another family."""
        event_dims = 0
        while isinstance(fn, Independent):
            event_dims += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        # The exact log_prob: a subclass that changes the density is not the Gaussian below.
        if type(fn).log_prob is Normal.log_prob:
            loc, scale = (layout.batched_particles(x.expand(fn.batch_shape)) for x in (fn.loc, fn.scale))
            log_norm = _sum_last(-scale.log(), event_dims)
            return cls("normal", loc, scale, event_dims, False, log_norm)
        if type(fn).log_prob is MultivariateNormal.log_prob:
            tril = fn._unbroadcasted_scale_tril
            loc = layout.batched_particles(fn.loc.expand(fn.batch_shape + fn.event_shape))
            half_log_det = tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            log_norm = _sum_last(-half_log_det.expand(loc.shape[:-1]), event_dims)
            shared = tril.dim() == 2
            if shared:
                eye = torch.eye(tril.shape[-1], dtype=tril.dtype, device=tril.device)
                scale = torch.linalg.solve_triangular(tril, eye, upper=False)  # the inverse factor
            else:
                scale = layout.batched_particles(tril.expand(fn.batch_shape + tril.shape[-2:]))
            return cls("mvn", loc, scale, event_dims, shared, log_norm)
        return None

    def log_bound(self) -> Tensor:
        """``log sup_x max_j f(x | parent j)`` per filter, ``(B,)``: the largest density at the mean."""
        return self.log_norm.amax(-1)

    def log_prob(self, value: Tensor, filters: Tensor, parents: Tensor | None = None) -> Tensor:
        """``log f(value_p | parent)`` (up to the constant) for draws ``p`` of filters ``filters``
        (``(P,)``; ``value`` ``(P, *event)``): under the parent ``parents[p]`` (``(P,)`` out), or
        under every parent of the filter (``parents=None``: ``(P, N)`` out, the exact fallback)."""
        index = (filters,) if parents is None else (filters, parents)
        if parents is None:
            value = value.unsqueeze(1)
        diff = value - self.loc[index]
        if self.kind == "normal":
            quad = (diff / self.scale[index]).square()
        elif self.shared_scale:
            quad = (diff @ self.scale.transpose(-1, -2)).square().sum(-1)
        else:
            quad = torch.linalg.solve_triangular(self.scale[index], diff.unsqueeze(-1), upper=False).squeeze(-1).square().sum(-1)
        return self.log_norm[index] - 0.5 * _sum_last(quad, self.event_dims)


def _sum_last(x: Tensor, dims: int) -> Tensor:
    """``x`` summed over its last ``dims`` dims."""
    return x.sum(tuple(range(-dims, 0))) if dims else x


def _gaussian_sites(record: dict[str, Any], layout: ParticleLayout) -> list[tuple[str, _Gaussian]] | None:
    """The step's latent sites as :class:`_Gaussian` (``None`` if any site is of another family)."""
    out = []
    for site in record["sites"]:
        if site["problem"] is not None:
            raise ValueError(site["problem"])
        gaussian = _Gaussian.of(site["fn"], layout)
        if gaussian is None:
            return None
        out.append((site["name"], gaussian))
    return out


def _backward_rejection(
    record: dict[str, Any], values: dict[str, Tensor], layout: ParticleLayout, num_samples: int, max_rounds: int, stats: dict[str, int]
) -> Tensor:
    """The parents ``(S, B)`` drawn from the FFBS backward kernel by rejection, with the exact draw
    as the fallback after ``max_rounds`` rounds (see the module docstring).

    Each round proposes ``J ~ v`` for every pending draw and accepts with probability
    ``f(x_t | P^J) / C`` (``C`` the largest density at the mean over the filter's parents, an upper
    bound of every Gaussian ``f``): an accepted ``J`` has the law ``v_j f(x_t | P^j)``, normalised,
    whatever happened before. The rounds stop after ``max_rounds``, or earlier once the pending
    draws are few enough that their exact draw is cheaper than a round
    (:data:`REJECTION_FALLBACK_WORK`); that rule looks only at which draws are pending, so each
    draw, accepted in a round or drawn exactly by the fallback, still has the exact law.
    """
    gaussians = _gaussian_sites(record, layout)
    if gaussians is None:
        stats["exact_steps"] += 1
        return _backward_exact(record, values, layout)
    log_v = record["parent_log_weights"]  # (B, N)
    top = log_v.amax(-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return _backward_exact(record, values, layout)  # raises the FFBS error
    cdf = (log_v - top).exp().cumsum(-1)  # (B, N): proposals by inverse CDF, shared by the rounds
    num_filters = log_v.shape[0]
    log_bound = sum((g.log_bound() for _, g in gaussians), torch.zeros(num_filters, dtype=log_v.dtype, device=log_v.device))
    flat = {name: values[name].reshape((num_samples * num_filters,) + values[name].shape[2:]) for name, _ in gaussians}
    parent = torch.empty(num_samples * num_filters, dtype=torch.long, device=log_v.device)
    pending = torch.arange(num_samples * num_filters, device=log_v.device)  # index s * B + b
    stats["draws"] += pending.numel()
    for _ in range(max_rounds):
        if pending.numel() * cdf.shape[-1] <= REJECTION_FALLBACK_WORK:
            break
        # One proposal per draw and filter (cheap: a binary search each), kept for the pending ones.
        u = torch.rand((num_filters, num_samples), dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
        proposal = torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[-1] - 1).transpose(0, 1).reshape(-1)[pending]
        filters = pending % num_filters
        log_f = sum((g.log_prob(flat[name][pending], filters, proposal) for name, g in gaussians), torch.zeros_like(log_bound[filters]))
        accept = torch.rand(pending.shape, dtype=log_f.dtype, device=log_f.device).log() < log_f - log_bound[filters]
        stats["proposals"] += pending.numel()
        stats["accepted"] += int(accept.sum())
        parent[pending[accept]] = proposal[accept]
        pending = pending[~accept]
    if pending.numel():
        # The hybrid fallback: the exact O(N) draw for the draws that were not accepted.
        filters = pending % num_filters
        logits = log_v[filters] + sum((g.log_prob(flat[name][pending], filters) for name, g in gaussians), torch.zeros_like(log_v[filters]))
        parent[pending] = _categorical(logits)
        stats["fallback"] += pending.numel()
    return parent.reshape(num_samples, num_filters)


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
def smooth(
    history: list[dict[str, Any]],
    num_samples: int,
    method: str,
    layout: ParticleLayout,
    has_ancestors: bool,
    max_rounds: int = REJECTION_MAX_ROUNDS,
    stats: dict[str, int] | None = None,
    progress_bar: bool = False,
) -> dict[str, Tensor]:
    """Smoothed trajectories from an engine's stored history (see the module docstring).

    Args:
        history: one record per step (:func:`step_record` and the ``record_*`` helpers).
        num_samples: trajectories ``S`` per filter.
        method: ``"ffbs"``, ``"rejection"`` or ``"genealogy"``.
        layout: the particle dims.
        has_ancestors: whether the resampler draws ancestors (``Resampler.draws_ancestors``).
        max_rounds: ``"rejection"`` only: proposal rounds before the exact fallback (``0``: FFBS).
        stats: ``"rejection"`` only: a dict whose counts are set (or increased) by the run:
            ``draws`` (backward draws sampled by rejection), ``proposals`` (density evaluations
            in the rounds; ``proposals / draws`` is the mean number of rounds per draw),
            ``accepted``, ``fallback`` (exact ``O(N)`` draws after ``max_rounds``) and
            ``exact_steps`` (steps with a non-Gaussian latent site, drawn by FFBS).
        progress_bar: show a bar over the backward pass.

    Returns:
        ``{key: (S, T, B, *event)}`` for every state key, detached.

    Raises:
        ValueError: ``"genealogy"`` without ancestors; ``"ffbs"`` or ``"rejection"`` with a latent
            site that is not a per-particle distribution or that depends on another site of its
            step, with a state entry that depends on the previous state beyond the step's draws,
            or through a transport whose latent values are not in the state; a negative
            ``max_rounds``.
    """
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise ValueError(f"max_rounds must be a non-negative int, got {max_rounds!r}")
    if stats is None:
        stats = {}
    for key in ("draws", "proposals", "accepted", "fallback", "exact_steps"):
        stats.setdefault(key, 0)
    last = history[-1]
    keys = [k for k in last["state"] if all(k in rec["state"] for rec in history)]
    if method == "genealogy" and (not has_ancestors or any(rec["transported"] for rec in history)):
        raise ValueError(
            "method='genealogy' needs the ancestors an index resampler draws; this resampler moves the particles "
            "by a transport map (optimal transport) or a kernel and draws none: use method='ffbs'"
        )
    if method != "genealogy":
        problem = next((rec["problem"] for rec in history[1:] if rec.get("problem")), None)
        if problem is not None:
            raise ValueError(problem)
    index = _categorical(last["log_weights"], num_samples)  # (S, B)
    out = [{k: _pick(last["state"][k], index) for k in keys}]
    values = {site["name"]: _pick(site["value"], index) for site in last["sites"]}
    for t in progress(range(len(history) - 1, 0, -1), desc=f"SMC.smooth ({method})", enabled=progress_bar):
        record, previous = history[t], history[t - 1]
        if method == "genealogy":
            parent = index
        elif method == "rejection":
            parent = _backward_rejection(record, values, layout, num_samples, max_rounds, stats)
        else:
            parent = _backward_exact(record, values, layout)  # (S, B)
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



def filtering_quantiles(history: list[dict[str, Any]], probs: Tensor, key: str) -> Tensor:
    """Weighted quantiles (:func:`~pyro_smc.ops.resample.weighted_quantiles`) of the filtering
    particles of ``key`` at every stored step: ``(Q, T, B, *event)`` for levels ``probs (Q,)``."""
    return torch.stack([weighted_quantiles(rec["state"][key], rec["log_weights"], probs) for rec in history], 1)
