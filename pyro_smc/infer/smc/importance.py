r"""The incremental importance weight of one SMC step, read off the model's and guide's traces.

One step's weight is :math:`\log \omega = \log f(x_t \mid x_{t-1}) + \log g(y_t \mid x_t) - \log q(x_t \mid \dots)`:
observed sites give :math:`\log g`; latent sites the guide proposed give :math:`\log f - \log q`; a latent site
drawn from the model's own transition contributes :math:`f / f = 1` and is not scored. Every term is
reduced to one number per particle (the model's own plates summed) and centred per filter before
the terms are added, so a huge constant term cannot round the per-particle differences away.

With stop-gradient resampling the proposal draws are detached and :func:`score_terms` gives each
proposal site's :math:`\log q - \operatorname{stop\_grad}(\log q)`: zero in value, the score of the draw in autograd.
With marginal stop-gradient resampling :func:`pairwise_transition_log_density` gives
:math:`\log f(x_t^i \mid x_{t-1}^j)` for every pair of particles instead
(see ``docs/math/smc.md#marginal-stop-gradient``).

See ``docs/math/smc.md#one-step-of-the-filter`` and ``docs/math/smc.md#log-evidence-estimate``
and ``docs/math/smc.md#stop-gradient-resampling``.

Example:
    >>> import torch
    >>> layout = ParticleLayout(num_filters=2, num_particles=3, max_plate_nesting=0)
    >>> terms = [
    ...     (
    ...         "y_0",
    ...         torch.tensor([[1e8, 1e8 + 1, 1e8], [0.0, 0.0, 0.0]], dtype=torch.float64),
    ...     )
    ... ]
    >>> increment, offset = centred_increment(terms, layout)
    >>> increment.tolist(), offset.tolist()
    ([[-1.0, 0.0, -1.0], [0.0, 0.0, 0.0]], [100000001.0, 0.0])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from pyro.distributions import MaskedDistribution
from pyro.distributions.util import scale_and_mask
from pyro.infer.smcfilter import SMCFailed
from pyro.poutine.trace_struct import Trace
from torch import Tensor
from torch.distributions import Independent as TorchIndependent

from pyro_smc.tracing import is_latent, is_scored, missing_observation_sites, site_log_probs

__all__ = [
    "ParticleLayout",
    "SMCFailedError",
    "centred_increment",
    "failure",
    "log_density_against_parents",
    "log_weight_terms",
    "mask_missing_components",
    "pairwise_transition_log_density",
    "score_terms",
    "transition_site_problem",
]


class SMCFailedError(SMCFailed):
    """Every particle of a filter has zero weight (or the weights are NaN).

    A ``ValueError`` (through ``pyro.infer.smcfilter.SMCFailed``), so code that catches Pyro's
    exception catches this one too. :meth:`SMC.run <pyro_smc.SMC.run>` raises it with the time
    step and the site at which the weights collapsed.

    Example:
        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_smc import SMC
        >>> from pyro_smc.infer import SMCFailedError
        >>> class Impossible:
        ...     def init(self, state):
        ...         pass
        ...     def step(self, state, y=None):
        ...         state["x"] = pyro.sample("x", dist.Normal(0.0, 1.0))
        ...         pyro.factor("never", torch.tensor(float("-inf")))
        >>> try:
        ...     SMC(Impossible(), num_particles=4).run(torch.zeros(2))
        ... except SMCFailedError as error:
        ...     print(isinstance(error, ValueError), "time step 0" in str(error))
        True True
    """


@dataclass(frozen=True)
class ParticleLayout:
    """Where the particles sit in a site's batch shape.

    Attributes:
        num_filters: ``B`` independent filters (an outer plate when ``B > 1``).
        num_particles: ``N`` particles per filter.
        max_plate_nesting: plates the model nests inside a step, right of the particle dims.
    """

    num_filters: int
    num_particles: int
    max_plate_nesting: int

    @property
    def particle_shape(self) -> tuple[int, ...]:
        """``(B, N)``, or ``(N,)`` with one filter (exactly as under ``SMCFilter``)."""
        if self.num_filters > 1:
            return (self.num_filters, self.num_particles)
        return (self.num_particles,)

    def batched_particles(self, value: Tensor) -> Tensor:
        """A per-particle tensor ``(*particle_shape, *event)`` as ``(B, N, *event)`` (a view)."""
        return value if self.num_filters > 1 else value.unsqueeze(0)

    def batched(self, term: Tensor) -> Tensor:
        """A per-particle term as ``(B, N)``."""
        # Unconditional (a view when the shape already matches): a shape comparison would be a
        # Python branch on sizes, which the compiled step's recording must not contain.
        return term.expand(self.particle_shape).reshape(self.num_filters, self.num_particles)


def log_weight_terms(
    model_trace: Trace,
    guide_trace: Trace | None,
    layout: ParticleLayout,
    predict_only: bool = False,
    partial: tuple[Tensor, Tensor, str] | None = None,
    active: Tensor | None = None,
    ended: Tensor | None = None,
    observation: Tensor | None = None,
    where: str = "this step",
) -> list[tuple[str, Tensor]]:
    r"""Per-site contributions to :math:`\log \omega`, each reduced to the particle shape.

    Args:
        model_trace: the model's step, replayed on the guide's draws.
        guide_trace: the guide's step, or ``None`` for a bootstrap step.
        layout: the particle dims.
        predict_only: a step whose observation (the first argument) is missing for every filter:
            the observed site that takes it is not scored (:func:`missing_observation_sites`);
            every other observed site (a second observation, a ``pyro.factor``) is.
        partial: for a partly missing observation, ``(filled, observed, where)``: the observation
            as passed to the model (missing entries filled with zeros), the mask of its observed
            entries and the step's name; the observed site fed with it is scored on the observed
            entries only (:func:`mask_missing_components`).
        active: ``(B,)`` bool, the filters whose observation is present (``None``: all); for the
            others the term of the site that takes the observation is zero, as in a predict-only
            step, and so are their proposed sites' (those filters moved by the model's transition,
            ``q = f``; see ``docs/math/smc.md#batches-of-sequences``).
        ended: ``(B,)`` bool, the filters past the end of their sequence (``None``: none): every
            observed site's term is zero for them (their steps do not exist).
        observation: the first argument as the model was given it, to find the site that takes a
            missing observation; ``None`` when it was ``None`` (the model then sampled that site).
        where: the step, for the messages.

    Returns:
        ``[(site name, term)]`` in the model's order, each term of ``layout.particle_shape``.

    Raises:
        ValueError: the guide samples a site the model does not have, a site has batch dims left
            of the particle plate, or a missing observation's site cannot be told apart.
    """
    if guide_trace is not None:
        for name, site in guide_trace.nodes.items():
            if is_scored(site) and name not in model_trace.nodes:
                raise ValueError(f"guide samples site '{name}' that the model does not have")
    proposed = set() if guide_trace is None else {name for name, site in guide_trace.nodes.items() if is_scored(site)}
    # The site a missing observation feeds, where some filter is without it inside its sequence
    # (past a sequence's end every observed term is masked anyway).
    without = predict_only if active is None else bool((~active if ended is None else ~active & ~ended).any())
    missing = set(missing_observation_sites(model_trace, observation, where)) if without else set()
    skipped = missing if predict_only and active is None else set()
    scored = [
        name
        for name, site in model_trace.nodes.items()
        if is_scored(site) and ((site["is_observed"] and name not in skipped) or (not site["is_observed"] and name in proposed))
    ]
    if partial is not None:
        mask_missing_components(model_trace, *partial)
    log_p = site_log_probs(model_trace, scored)
    log_q = {} if guide_trace is None else site_log_probs(guide_trace, [name for name in scored if name in proposed])
    terms = []
    for name in scored:
        term = _per_particle(log_p[name], model_trace.nodes[name], layout)
        if name in log_q:
            term = term - _per_particle(log_q[name], guide_trace.nodes[name], layout)
        observed = model_trace.nodes[name]["is_observed"]
        # Filters that do not score this term: without the observation (its own site, and the
        # proposed sites of filters that moved by the model), or past their sequence's end.
        silent = None
        if active is not None and (name in missing or name in log_q):
            silent = ~active
        if ended is not None and observed:
            silent = ended if silent is None else silent | ended
        terms.append((name, _silenced(term, silent, layout)))
    for name in _rescaled_latents(model_trace, proposed):
        # Drawn from its own distribution, so its density cancels in the weight unless the model
        # scales or masks it: what is left is the scaled, masked density less the one it was
        # drawn from. Ignored before: poutine.scale(0.5) on a bootstrap filter's transition gave
        # the unscaled model's log Z (-29.5 where the scaled model's is -17.1).
        site = model_trace.nodes[name]
        log_p = site_log_probs(model_trace, [name])[name]
        drawn = _unmasked(site["fn"]).log_prob(site["value"], *site["args"], **site["kwargs"])
        terms.append((name, _silenced(_per_particle(log_p - drawn, site, layout), ended, layout)))
    return terms


def _silenced(term: Tensor, silent: Tensor | None, layout: ParticleLayout) -> Tensor:
    """``term`` (particle shape) with the filters ``silent`` ``(B,)`` set to zero (``None``: none)."""
    if silent is None:
        return term
    term = layout.batched(term)
    term = torch.where(silent.unsqueeze(-1), torch.zeros_like(term), term)
    return term.squeeze(0) if len(layout.particle_shape) == 1 else term


def _rescaled_latents(model_trace: Trace, proposed: set[str]) -> list[str]:
    """The latent sites the model draws itself (no guide proposes them) under a scale or a mask
    (``poutine.scale``, ``poutine.mask``, ``Distribution.mask``, a subsampled plate)."""
    return [
        name for name, site in model_trace.nodes.items() if is_scored(site) and not site["is_observed"] and name not in proposed and _is_rescaled(site)
    ]


def _is_rescaled(site: dict) -> bool:
    """Whether a site's scored density differs from the density it is drawn from."""
    scale, mask = site.get("scale", 1.0), site.get("mask")
    return isinstance(scale, Tensor) or scale != 1.0 or (mask is not None and mask is not True) or _unmasked(site["fn"]) is not site["fn"]


def _unmasked(fn: Any) -> Any:
    """The distribution a site draws from: ``fn`` without the ``MaskedDistribution`` wrappers of
    ``Distribution.mask`` (which scale the density, not the draw), through ``Independent``."""
    if isinstance(fn, MaskedDistribution):
        return _unmasked(fn.base_dist)
    if isinstance(fn, TorchIndependent):
        base = _unmasked(fn.base_dist)
        return fn if base is fn.base_dist else type(fn)(base, fn.reinterpreted_batch_ndims)
    return fn


def mask_missing_components(model_trace: Trace, filled: Tensor, observed: Tensor, where: str) -> None:
    r"""Scores the observed site fed with a partly missing observation on its observed entries.

    The site is the one whose value is the tensor the engine passed (or equals it, broadcast). Its
    distribution must factorise over the observation's entries: a univariate distribution, possibly
    reinterpreted by ``to_event`` (``Independent``); then :math:`\log p(y_{\mathrm{obs}})` is the sum of the
    entries' log-densities over the observed ones. The result is memoised on the trace
    (``unscaled_log_prob``/``log_prob``, scale and mask applied as Pyro does), where
    :func:`~pyro_smc.tracing.site_log_probs` finds it. See ``docs/math/smc.md#missing-observations``.

    Raises:
        ValueError: no single observed site takes the observation, or its distribution does not
            factorise over the entries (e.g. a ``MultivariateNormal``), naming the step.
    """
    sites = [site for site in model_trace.nodes.values() if is_scored(site) and site["is_observed"]]
    fed = [site for site in sites if site["value"] is filled]
    if not fed:
        fed = [
            site
            for site in sites
            if isinstance(site["value"], Tensor)
            and tuple(site["value"].shape[max(site["value"].dim() - filled.dim(), 0) :]) == tuple(filled.shape)
            and torch.equal(site["value"], filled.expand_as(site["value"]))
        ]
    if len(fed) != 1:
        raise ValueError(
            f"the observation at {where} is partly missing, and {len(fed)} observed sites take it as obs; "
            "pass it unchanged as obs= of exactly one site"
        )
    site = fed[0]
    fn, event_dims = site["fn"], 0
    while isinstance(fn, TorchIndependent):
        event_dims += fn.reinterpreted_batch_ndims
        fn = fn.base_dist
    if fn.event_shape != torch.Size():
        raise ValueError(
            f"the observation at {where} is partly missing, but site '{site['name']}' ({type(site['fn']).__name__}) does not "
            "factorise over its entries, so the missing ones cannot be left out; use a distribution of independent entries "
            "(e.g. Normal(loc, scale).to_event(1)), or mark the whole observation missing (all NaN)"
        )
    log_p = fn.log_prob(site["value"])
    log_p = torch.where(observed, log_p, torch.zeros_like(log_p))
    if event_dims:
        log_p = log_p.sum(tuple(range(-event_dims, 0)))
    site["unscaled_log_prob"] = log_p
    site["log_prob"] = scale_and_mask(log_p, site["scale"], site["mask"])


def score_terms(model_trace: Trace, guide_trace: Trace | None, layout: ParticleLayout, active: Tensor | None = None) -> Tensor | None:
    r"""The score-function terms of one step's proposal draws, summed per particle.

    The proposal is the guide's latent sites (density ``q``) and the model's latent sites the
    guide does not sample (drawn from the model itself: ``q = f``). Each contributes
    :math:`\log q(x) - \operatorname{stop\_grad}(\log q(x))`: zero in value, :math:`\nabla \log q(x)` in autograd, with the draw
    ``x`` itself detached. A non-finite ``log q`` contributes zero. With ``active`` ``(B,)`` (a
    batch of sequences at a step where some filters observe nothing) the other filters drew every
    site from the model, so their guide sites' scores are the model's, ``q = f``.
    See ``docs/math/smc.md#stop-gradient-resampling``.

    Returns:
        ``(B, N)``, zero in value, or ``None`` when the step drew nothing.
    """
    sources = [] if guide_trace is None else [(guide_trace, name) for name, site in guide_trace.nodes.items() if is_latent(site)]
    sources += [(model_trace, name) for name, site in model_trace.nodes.items() if is_latent(site) and (guide_trace is None or name not in guide_trace.nodes)]
    total = None
    for trace, name in sources:
        score = _score(trace, name, layout, drawn=trace is model_trace)
        if active is not None and trace is guide_trace:
            own = _score(model_trace, name, layout, drawn=True)
            if score is None and own is None:
                continue
            score = torch.where(active.unsqueeze(-1), 0.0 if score is None else score, 0.0 if own is None else own)
        if score is None:
            continue
        total = score if total is None else total + score
    return total


def pairwise_transition_log_density(model_trace: Trace, layout: ParticleLayout) -> Tensor | None:
    r""":math:`\log f(x_t^i \mid x_{t-1}^j)` for every pair ``(i, j)`` of particles of a filter.

    Each latent site's distribution ``fn`` has the particle shape as batch shape, its index being
    the parent ``j`` (the particle whose previous state built it); its value, index ``i``, is
    reshaped to broadcast against that batch (``(N_i, B, 1, *event)`` against ``(B, N_j)``), so one
    ``fn.log_prob`` call gives all pairs, with no loop over particles. The sites' terms are summed:
    several latent sites are fine as long as each depends on the previous state only (checked by
    the caller). Memory :math:`O(B N^2)` (times the event size inside ``log_prob``).
    See ``docs/math/smc.md#marginal-stop-gradient``.

    Returns:
        ``(B, N_i, N_j)``, or ``None`` when the step has no latent site.

    Raises:
        ValueError: a site whose batch shape is not the particle shape, or that is scaled or
            masked (naming the site).
    """
    total = None
    for name, site in model_trace.nodes.items():
        if not is_latent(site):
            continue
        problem = transition_site_problem(name, site, layout)
        if problem is not None:
            raise ValueError(f"marginal stop-gradient: {problem}")
        # The new particles i as the "draws" of log_density_against_parents: (N_i, B, *event).
        values = layout.batched_particles(site["value"]).movedim(1, 0)
        pairs = log_density_against_parents(site["fn"], values, layout).movedim(0, 1)  # (B, N_i, N_j)
        total = pairs if total is None else total + pairs
    return total


def transition_site_problem(name: str, site: dict, layout: ParticleLayout) -> str | None:
    """Why a latent site cannot serve as a transition density indexed by the parent particle
    (``None`` when it can): it must be unscaled, unmasked, of batch shape exactly the particle
    shape. The marginal stop-gradient estimator and particle smoothing both need this."""
    shape = layout.particle_shape
    fn = site["fn"]
    if tuple(fn.batch_shape) == shape and site.get("mask") is None and site.get("scale", 1.0) == 1.0:
        return None
    return (
        f"site '{name}' has batch shape {tuple(fn.batch_shape)}{' and a mask or scale' if tuple(fn.batch_shape) == shape else ''}; "
        f"every latent site of a step must be an unscaled, unmasked distribution of batch shape exactly {shape} "
        "(the particles), indexed by the parent"
    )


def log_density_against_parents(fn, values: Tensor, layout: ParticleLayout) -> Tensor:
    """``log f(values[s, b] | parent j)`` for every parent ``j`` of filter ``b``, one ``log_prob`` call.

    ``fn`` has the particle shape as batch shape, its index being the parent; ``values`` is
    ``(S, B, *event)`` and is broadcast against it. Returns ``(S, B, N)``.
    """
    if layout.num_filters > 1:
        return fn.log_prob(values.unsqueeze(2))  # (S, B, 1, *event) against (B, N)
    return fn.log_prob(values[:, 0].unsqueeze(1)).unsqueeze(1)  # (S, 1, *event) against (N,)


def _score(trace: Trace, name: str, layout: ParticleLayout, drawn: bool = False) -> Tensor | None:
    """``log q(x) - stop_grad(log q(x))`` of one site, ``(B, N)`` (zero where non-finite), or
    ``None`` when ``log q`` has no autograd graph. ``drawn``: a model site drawn from its own
    distribution, whose ``q`` is that distribution without the model's scale or mask."""
    site = trace.nodes[name]
    if drawn and _is_rescaled(site):
        log_q = _unmasked(site["fn"]).log_prob(site["value"], *site["args"], **site["kwargs"])
    else:
        log_q = site_log_probs(trace, [name])[name]
    log_q = _per_particle(log_q, site, layout)
    if not log_q.requires_grad:
        return None
    return layout.batched(torch.where(torch.isfinite(log_q), log_q - log_q.detach(), torch.zeros_like(log_q)))


def _per_particle(log_p: Tensor, site: dict, layout: ParticleLayout) -> Tensor:
    """A site's log-density summed over the model's own plates: one number per particle."""
    if not isinstance(log_p, Tensor):
        log_p = torch.as_tensor(log_p)
    mpn = layout.max_plate_nesting
    # The model's own plates sit right of the particle dims.
    if mpn and log_p.dim() > 0:
        log_p = log_p.reshape(log_p.shape[: max(log_p.dim() - mpn, 0)] + (-1,)).sum(-1)
    if log_p.dim() > len(layout.particle_shape):
        ones = ", 1" * mpn
        raise ValueError(
            f"site '{site['name']}' has batch shape {tuple(site['fn'].batch_shape)}: dims left of the particle plate. "
            f"Either max_plate_nesting (now {mpn}) is less than the number of plates the model nests inside a step, or "
            f"a tensor feeding the site lacks the plate dims: with max_plate_nesting={mpn} a per-particle tensor has "
            f"batch shape (*particles{ones}), so keep the state's event dims right of those"
        )
    return log_p


def centred_increment(terms: list[tuple[str, Tensor]], layout: ParticleLayout) -> tuple[Tensor, Tensor]:
    r""":math:`\log \omega` up to a constant per filter, and that constant.

    Each site's term is shifted by its per-filter maximum over particles before the terms
    are summed. A term that is large but (nearly) the same for every particle, e.g. a
    ``pyro.factor`` constant or an unnormalised density, would otherwise round away the
    per-particle differences of the others: the float32 spacing at ``1e8`` is 8. A constant
    per filter cancels in the normalised weights, so the shifts are needed only for the
    log-evidence, where the caller adds them back.

    The shifts are detached constants: :math:`\operatorname{logsumexp}(\log w + \sum_k (\mathrm{term}_k - m_k)) + \sum_k m_k`
    then has the value *and* the gradient of :math:`\operatorname{logsumexp}(\log w + \sum_k \mathrm{term}_k)`, the
    gradient flowing through the centred terms (adding back an un-detached ``m_k`` would
    count ``d m_k`` twice).

    Returns:
        ``(increment, offset)``: the centred sum ``(B, N)`` and the summed shifts ``(B,)``.
    """
    increment = offset = None
    for _, term in terms:
        term = layout.batched(term)
        shift = term.detach().amax(-1)
        # A row without a finite maximum (all -inf, NaN or +inf) stays unshifted, so the
        # failure check after the logsumexp still sees it.
        shift = shift.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        centred = term - shift.unsqueeze(-1)
        increment = centred if increment is None else increment + centred
        offset = shift if offset is None else offset + shift
    return increment, offset


def failure(terms: list[tuple[str, Tensor]], layout: ParticleLayout, where: str) -> SMCFailedError:
    """The error for a step after which a filter has no finite weight, naming the first site
    whose running sum of terms made it so."""
    total = 0
    culprit = terms[-1][0]
    for name, term in terms:
        total = total + layout.batched(term)
        bad = torch.isnan(total).any(-1) | ~(total.max(-1).values > -math.inf)
        if bool(bad.any()):
            culprit = name
            break
    return SMCFailedError(f"SMC failed at {where}: every particle of a filter has zero weight (or NaN weights) after site '{culprit}'")
