"""Input checks and warnings of the SMC engine, each naming the argument or the time step.

A step's observation is its first positional argument; ``None`` or an all-NaN tensor is a missing
observation (a predict-only step, the rule every engine follows); a partly-NaN observation has its
missing components masked (:func:`observed_components`); an infinite argument, or a NaN in any
other argument, is an error. Proposal sites that cannot carry their parameters' gradient are warned
about once per site.

Example:
    >>> import math, torch
    >>> is_missing((torch.full((2,), math.nan),)), is_missing((None,)), is_missing((torch.zeros(2),))
    (True, True, False)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from pyro.poutine.trace_struct import Trace
from torch import Tensor
from torch.distributions import Distribution
from torch.distributions.utils import lazy_property

from pyro_smc.tracing import is_latent

__all__ = [
    "NonReparameterizedGradientWarning",
    "check_finite_args",
    "check_marginal_supported",
    "check_positive_int",
    "is_missing",
    "observed_components",
    "warn_non_reparameterized",
]


class NonReparameterizedGradientWarning(UserWarning):
    """A proposal site without ``rsample`` draws from a distribution whose parameters require grad.

    Its draws are not differentiable, and ``log_evidence`` carries no score-function terms for
    them, so parameters that act only through the site's distribution get no gradient (or a
    biased one). Emitted once per site-name prefix and run while grad mode is on. Not emitted
    with stop-gradient resampling, which adds those terms (see
    ``docs/math/smc.md#stop-gradient-resampling``).
    """


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


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


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
                f"so parameters that act only through this site get no (or a biased) gradient; use a "
                f"reparameterisable or relaxed proposal, or marginalise the discrete variable"
            ),
            stacklevel=3,
        )


def _distribution_parameters(fn: Distribution) -> Iterator[Tensor]:
    """The parameter tensors of ``fn`` and of every distribution it wraps.

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
            names = list(d.arg_constraints)
        except NotImplementedError:
            names = []
        for name in names:
            value = attributes.get(name)
            # A lazy property (Categorical.logits of a probs-built Categorical) is not computed
            # just to be looked at; its source parameter is in the instance dict.
            if value is None and not isinstance(getattr(type(d), name, None), lazy_property):
                try:
                    value = getattr(d, name, None)
                except Exception:  # a property that cannot be computed is not a parameter we can check
                    value = None
            if isinstance(value, Tensor):
                yield value
        stack.extend(value for value in attributes.values() if isinstance(value, Distribution))


def _distribution_name(fn: Distribution) -> str:
    """``Categorical``, or ``Independent(Categorical)`` for a wrapper chain."""
    names = [type(fn).__name__]
    while isinstance(getattr(fn, "base_dist", None), Distribution):
        fn = fn.base_dist
        names.append(type(fn).__name__)
    return "(".join(names) + ")" * (len(names) - 1)


def check_finite_args(args: tuple, kwargs: dict, where: str) -> None:
    """Rejects a NaN or infinite tensor argument of a step, naming the step (the caller passes the
    observation with its missing components already filled in)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            if bool(torch.isinf(value).any()):
                raise ValueError(f"observation at {where} contains inf")
            raise ValueError(f"a step argument at {where} contains NaN (only the observation, the first argument, may be missing)")


def observed_components(args: tuple) -> Tensor | None:
    """For a partly-NaN observation (the first positional argument: some entries NaN, not all),
    the mask of its observed entries; ``None`` otherwise. See ``docs/math/smc.md#missing-observations``."""
    if not args or not isinstance(args[0], Tensor) or not args[0].is_floating_point():
        return None
    nan = torch.isnan(args[0])
    if not bool(nan.any()) or bool(nan.all()):
        return None
    return ~nan


def is_missing(args: tuple) -> bool:
    """Whether a step's observation (its first positional argument) is missing: ``None`` or all-NaN."""
    if not args:
        return False
    y = args[0]
    if y is None:
        return True
    return isinstance(y, Tensor) and y.is_floating_point() and y.numel() > 0 and bool(torch.isnan(y).all())
