"""What a run checks in each step's Pyro traces, each check naming the time step.

The traces of a step tell what the engine cannot see from its arguments: a latent kept on the
model instead of in ``state`` (never resampled), a float-coded discrete label (to be copied, never
averaged), an observation or a guide's draw in another dtype than its site, a guide site the model lacks, and
proposal sites that cannot carry their parameters' gradient (warned about once per site).
:class:`TraceChecks` runs them all and remembers between steps what it has settled.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from pyro.poutine.trace_struct import Trace
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import lazy_property

from pyro_smc.infer.smc.checks import NonReparameterizedGradientWarning
from pyro_smc.tracing import check_observed_shapes, is_latent, is_scored

__all__ = [
    "TraceChecks",
    "check_guide_dtype",
    "check_observation_dtype",
    "constraints_hold",
    "discrete_state_keys",
    "latent_kept_outside_state",
    "warn_non_reparameterized",
    "warn_untrainable_proposal",
]


def discrete_state_keys(model_trace: Trace, state: dict[str, Tensor]) -> set[str]:
    """The floating-point state keys that hold the value of a latent site with discrete support.

    A regime label drawn from ``dist.Bernoulli`` is a float tensor of 0s and 1s; it must be
    resampled by copying an ancestor's value, never averaged (optimal transport) or jittered (a
    kernel). A key is matched to a site by identity (``state[key] = pyro.sample(...)``), as
    particle smoothing matches them. Integer and bool state tensors are discrete by dtype and not
    listed.
    """
    by_id = {id(site["value"]): site for site in model_trace.nodes.values() if is_latent(site)}
    keys = set()
    for key, value in state.items():
        site = by_id.get(id(value))
        if site is None or not value.is_floating_point():
            continue
        try:
            discrete = site["fn"].support.is_discrete
        except NotImplementedError:  # a distribution that declares no support
            discrete = False
        if discrete:
            keys.add(key)
    return keys


def latent_kept_outside_state(model_trace: Trace, state: dict[str, Tensor], model: Any) -> tuple[str, str] | None:
    """``(site, attribute)`` when the model keeps a latent site's value as an attribute
    (``self.x = pyro.sample(...)``) and not in ``state``; ``None`` otherwise.

    The engine resamples ``state`` only: a per-particle value kept elsewhere is never resampled,
    so after the first resampling it belongs to other particles than the weights say, and every
    estimate is wrong (with no error). Matched by identity, like the state keys.
    """
    attributes = getattr(model, "__dict__", None)
    if not attributes:
        return None
    in_state = {id(value) for value in state.values()}
    latent = {id(site["value"]): name for name, site in model_trace.nodes.items() if is_latent(site) and isinstance(site["value"], Tensor)}
    for attribute, value in attributes.items():
        if isinstance(value, Tensor) and id(value) in latent and id(value) not in in_state:
            return latent[id(value)], attribute
    return None


def warn_untrainable_proposal(guide_trace: Trace, estimator: str) -> bool:
    r"""Warns that a score-function estimator gives the guide's parameters no gradient.

    The Fisher identity differentiates :math:`\log p(x, y)` along the particles' paths: the proposal
    changes only which paths are drawn, so its parameters get exactly zero gradient, and a guide
    trained with this estimator ends where it started. The message names the guide's sites;
    :class:`~pyro_smc.SMCELBO`, which builds an engine per SVI step, shows it once per loss.

    Returns:
        Whether it warned (so the question is settled for the run). A step whose guide reads no
        trainable parameter settles nothing: a guide's ``init`` often samples the first state
        from a fixed prior and its ``step`` alone reads parameters (once, a guide like that was
        never warned about).
    """
    if not any(is_latent(site) for site in guide_trace.nodes.values()):
        return False
    params = [site["name"] for site in guide_trace.nodes.values() if site["type"] == "param" and getattr(site["value"], "requires_grad", False)]
    if not params:
        params = [
            site["name"]
            for site in guide_trace.nodes.values()
            if is_latent(site) and any(p.requires_grad for p in _distribution_parameters(site["fn"]))
        ]
    if params:
        warnings.warn(
            f"gradient={estimator!r} gives the guide's (proposal's) parameters exactly zero gradient (it differentiates "
            f"the model's log-density along the particles' paths; the proposal only chooses the paths), so training the "
            f"guide with it does nothing (guide sites/params with gradients: {', '.join(sorted(set(params))[:3])}). To learn "
            f"the proposal, use OTResampler() or an index resampler with the default gradient='detach'",
            UserWarning,
            stacklevel=4,
        )
    return bool(params)


def warn_non_reparameterized(model_trace: Trace, guide_trace: Trace | None, where: str, warned: set[str]) -> None:
    """Warns about proposal sites whose draws cannot carry the gradient of their parameters.

    The proposal is the guide's latent sites plus the model's latent sites the guide does not
    sample (those are drawn from the model's own transition). A bootstrap site contributes
    ``p / p = 1`` to the weight, so without ``rsample`` its parameters vanish from
    ``log_evidence`` entirely; a guide site keeps only its ``-log q`` term. Warned once per
    site-name prefix (``z_3`` and ``z_4`` are one site over time) per set ``warned``
    (one per run), which the function updates.
    """
    proposal = [] if guide_trace is None else list(guide_trace.nodes.values())
    proposal += [site for name, site in model_trace.nodes.items() if guide_trace is None or name not in guide_trace.nodes]
    for site in proposal:
        if not is_latent(site):
            continue
        fn = site["fn"]
        if getattr(fn, "has_rsample", True):
            continue
        prefix = re.sub(r"[_\d]+$", "", site["name"]) or site["name"]
        if prefix in warned or not any(p.requires_grad for p in _distribution_parameters(fn)):
            continue
        warned.add(prefix)
        warnings.warn(
            NonReparameterizedGradientWarning(
                f"at {where}: site '{site['name']}' ({_distribution_name(fn)}) is not reparameterised; "
                f"the gradient of log_evidence does not include the score-function terms of its draws, "
                f"so parameters that act only through this site get no (or a biased) gradient; use a resampler with "
                f'gradient="stop_gradient" (e.g. SystematicResampler(gradient="stop_gradient")), which adds the '
                f"score-function terms of every draw, a reparameterisable or relaxed proposal, or marginalise the "
                f"discrete variable"
            ),
            stacklevel=3,
        )


def _distribution_parameters(fn: Distribution) -> Iterator[Tensor]:
    """The parameter tensors of ``fn`` and of every distribution it wraps."""
    return (value for value, _ in _distribution_arguments(fn))


def _distribution_arguments(fn: Distribution) -> Iterator[tuple[Tensor, Any]]:
    """``(tensor, constraint)`` for each parameter of ``fn`` and of every distribution it wraps.

    Parameters are the tensors named by each distribution's ``arg_constraints``; wrappers
    (``Independent``, ``MaskedDistribution``, ``ExpandedDistribution``, transformed and mixture
    distributions) hold the distributions they wrap as attributes, which are searched in turn.
    """
    stack, seen = [fn], set()
    while stack:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        attributes = vars(d)
        try:
            arg_constraints = dict(d.arg_constraints)
        except NotImplementedError:
            arg_constraints = {}
        for name, constraint in arg_constraints.items():
            value = attributes.get(name)
            # A lazy property (Categorical.logits of a probs-built Categorical) is not computed
            # just to be looked at; its source parameter is in the instance dict.
            if value is None and not isinstance(getattr(type(d), name, None), lazy_property):
                try:
                    value = getattr(d, name, None)
                except Exception:  # a property that cannot be computed is not a parameter we can check
                    value = None
            if isinstance(value, Tensor):
                yield value, constraint
        stack.extend(value for value in attributes.values() if isinstance(value, Distribution))


def _checkable(constraint: Any) -> bool:
    """Whether a replayed step checks ``constraint`` itself: not a dependent one (no check), not
    a real one (a NaN already fails the step's finiteness check), not a positive-definite one (a
    factorisation per check; the distribution factorises the matrix anyway and fails loudly)."""
    while isinstance(constraint, constraints.independent):
        constraint = constraint.base_constraint
    if constraints.is_dependent(constraint) or constraint is constraints.real:
        return False
    return not isinstance(constraint, (type(constraints.positive_definite), type(constraints.positive_semidefinite)))


def constraints_hold(traces: Iterable[Trace | None]) -> Tensor | None:
    """Whether every parameter and observed value meets its distribution's constraints, over
    every sample site of ``traces``: a bool tensor of shape ``()``; ``None`` when there is nothing
    to check.

    Pyro validates them when a distribution is built or scores an observation; a replayed
    (compiled) step runs without Pyro and computes this instead, so that a step whose parameters
    leave their support (a rate that turns negative at step 6 of a Gamma model, a Dirichlet
    concentration fed by particles a jittering resampler moved off the simplex) is rerun on
    Pyro's handlers, which raise naming the parameter, instead of giving finite nonsense. One
    comparison per parameter and one reduction for all: a replay pays per operation.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> model = lambda rate: pyro.sample("x", dist.Gamma(2.0, rate), obs=torch.tensor(1.0))
        >>> with pyro.validation_enabled(False):
        ...     trace = pyro.poutine.trace(model).get_trace(torch.tensor([1.0, -1.0]))
        >>> bool(constraints_hold([trace]))
        False
    """
    checks = []
    for trace in traces:
        if trace is None:
            continue
        for site in trace.nodes.values():
            if site["type"] != "sample" or not isinstance(site["fn"], Distribution):
                continue
            checks.extend((value, c) for value, c in _distribution_arguments(site["fn"]) if _checkable(c))
            if site["is_observed"] and isinstance(site["value"], Tensor) and _checkable(site["fn"].support):
                checks.append((site["value"], site["fn"].support))
    if not checks:
        return None
    return torch.cat([constraint.check(value).reshape(-1) for value, constraint in checks]).all()


def _distribution_name(fn: Distribution) -> str:
    """``Categorical``, or ``Independent(Categorical)`` for a wrapper chain."""
    names = [type(fn).__name__]
    while isinstance(getattr(fn, "base_dist", None), Distribution):
        fn = fn.base_dist
        names.append(type(fn).__name__)
    return "(".join(names) + ")" * (len(names) - 1)


def check_observation_dtype(model_trace: Trace, y: Any, where: str) -> bool:
    """The observation has the dtype its observed site computes in.

    A float64 observation of a float32 model (or the reverse) would silently promote the step's
    arithmetic to the wider type; Pyro's distributions do not check it. The site observing ``y``
    is found by identity (``obs=y``); each floating parameter of its distribution must have
    ``y``'s dtype.

    Returns:
        Whether a site observing ``y`` was found (and checked).

    Raises:
        ValueError: naming the step, the site and both dtypes.
    """
    if not isinstance(y, Tensor) or not y.is_floating_point():
        return False
    found = False
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"] or site["value"] is not y:
            continue
        found = True
        for param in _distribution_parameters(site["fn"]):
            if param.is_floating_point() and param.dtype != y.dtype:
                raise ValueError(
                    f"the observation at {where} is {y.dtype}, but site '{name}' computes in {param.dtype}: pass observations "
                    f"of the model's dtype (ys.to({param.dtype})) or build the model in {y.dtype}"
                )
    return found


def check_guide_dtype(model_trace: Trace, guide_trace: Trace, where: str) -> bool:
    """Each floating latent the guide draws has the dtype its model site computes in.

    A float32 guide of a float64 model (a ``PyroModule`` proposal built under torch's default
    dtype) hands the model float32 particles, which silently narrow the model's arithmetic; the
    first sign was the observation check blaming the model for the guide's dtype.

    Returns:
        Whether a floating guide site was compared with its model site.

    Raises:
        ValueError: naming the step, the site and both dtypes.
    """
    compared = False
    for name, site in guide_trace.nodes.items():
        value = site.get("value")
        if not is_latent(site) or name not in model_trace.nodes or not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        for param in _distribution_parameters(model_trace.nodes[name]["fn"]):
            if not param.is_floating_point():
                continue
            compared = True
            if param.dtype != value.dtype:
                raise ValueError(
                    f"at {where}: the guide draws site '{name}' in {value.dtype}, but the model's site computes in "
                    f"{param.dtype}: build the guide in the model's dtype (a PyroModule guide: guide.to({param.dtype}))"
                )
    return compared


class TraceChecks:
    """What a run checks in each step's traces, and what it remembers between steps to do so.

    Remembered: the proposal sites already warned about, the state keys that hold a discrete
    site's value (float-coded labels, resampled by copying, never averaged: a label drawn once
    stays one for the run), whether the observation's dtype and the proposal's trainability were
    settled.

    Args:
        model: the model (a latent kept on it instead of in ``state`` is an error).
        particle_shape: the particle shape every state tensor leads with.
    """

    def __init__(self, model: Any, particle_shape: tuple[int, ...]):
        self.model = model
        self.particle_shape = particle_shape
        self.warned_sites: set[str] = set()
        self.discrete_keys: set[str] = set()
        self.dtype_checked = False
        self.guide_dtype_checked = False
        self.proposal_checked = False

    def check(self, proposal: Any, state: dict, inputs: Any, estimator_option: str | None) -> None:
        """Checks one step's traces; warns as :func:`warn_non_reparameterized` and
        :func:`warn_untrainable_proposal` do.

        Args:
            proposal: the step's :class:`~pyro_smc.infer.smc.step.Proposal`.
            state: the state the model wrote.
            inputs: the step's :class:`~pyro_smc.infer.smc.step.StepInputs`.
            estimator_option: the ``gradient=`` spelling of a score-function estimator, or ``None``.

        Raises:
            ValueError: naming the step: the guide samples a site the model lacks, an observed
                site's shape would broadcast, the model keeps a latent on ``self``, or the
                observation's dtype is not its site's.
        """
        model_trace, guide_trace, where = proposal.model_trace, proposal.guide_trace, inputs.where
        if torch.is_grad_enabled() and estimator_option is None:
            warn_non_reparameterized(model_trace, guide_trace, where, self.warned_sites)
        elif guide_trace is not None and torch.is_grad_enabled() and not self.proposal_checked:
            # Checked until a step's guide reads a trainable parameter (its init often reads none).
            self.proposal_checked = warn_untrainable_proposal(guide_trace, estimator_option)
        if guide_trace is not None:
            extra = [name for name, site in guide_trace.nodes.items() if is_scored(site) and name not in model_trace.nodes]
            if extra:
                own = [name for name, site in model_trace.nodes.items() if is_latent(site)]
                raise ValueError(
                    f"at {where}: the guide samples site '{extra[0]}', which the model's step does not have (its latent "
                    f"sites: {own}); the guide must name its sites as the model does at every step"
                )
            if not self.guide_dtype_checked:
                # Before the observation's check, which would blame the model for the guide's dtype.
                self.guide_dtype_checked = check_guide_dtype(model_trace, guide_trace, where)
        # A step's slice of a series (not a batch's (B, 1, ...) rows) has none of the engine's dims.
        check_observed_shapes(model_trace, self.particle_shape, where, inputs.args[0] if inputs.bare and inputs.args else None)
        self.discrete_keys |= discrete_state_keys(model_trace, state)
        kept = latent_kept_outside_state(model_trace, state, self.model)
        if kept is not None:
            site, attribute = kept
            raise ValueError(
                f"at {where}: the model keeps latent site '{site}' as self.{attribute}, not in state: SMC resamples only "
                f"state, so that value is never resampled with its particle and every estimate would be wrong; store it as "
                f"state['{attribute}'] = pyro.sample(...) and read it from state in the next step"
            )
        if not self.dtype_checked and inputs.t is not None and inputs.args:
            # Checked once, at the first step whose observation reaches a site (scored or not).
            self.dtype_checked = check_observation_dtype(model_trace, inputs.args[0], where)

    def check_state(self, state: dict, where: str) -> None:
        """Every state entry is a tensor with the particle dims in front.

        Raises:
            ValueError: naming the key and the step.
        """
        shape = self.particle_shape
        for key, value in state.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"state['{key}'] must be a tensor, got {type(value).__name__} at {where}")
            if tuple(value.shape[: len(shape)]) != shape:
                raise ValueError(
                    f"state['{key}'] has shape {tuple(value.shape)} at {where}, but every state tensor must have "
                    f"leading particle dims {shape}; sample it inside the particle plate (or expand it)"
                )
