r"""The online filter's gradient stopping rule: stop a step once its Monte Carlo gradient cannot
tell it from optimal.

See ``docs/math/streaming.md#stopping-a-step``.

The step maximises :math:`F(w) = E[U_{t-1}(x_{t-1}) + \delta]` over the whitened variables ``w``
of :class:`~pyro_smc.guides.streaming.frame.StepFrame`, in which one unit of any coordinate is a
unit of Mahalanobis distance (or a factor ``e`` in a standard deviation) of the step's start, so
that the curvature of :math:`F` near a Gaussian optimum is of order one in every direction and the
squared gradient norm :math:`\|g\|^2` measures the distance to the optimum in the same units
whatever the model. Before the first iteration, and every :data:`CHECK_EVERY` iterations after,
:meth:`~pyro_smc.infer.online.objective.StepOptimiser.fit` draws ``M`` fresh reparameterised pairs (``M = num_regression_samples``,
the draws the step's estimate is then made from), splits them into ``K`` = :data:`CHECK_GROUPS`
groups and takes each group's whitened gradient :math:`G_k` (:func:`group_gradients`). With
:math:`\bar g` their mean and :math:`S` their sample covariance (``K - 1`` degrees of freedom),

.. math::

    \widehat{\|g\|^2} = \|\bar g\|^2 - \operatorname{tr} S / K,
    \qquad
    \operatorname{sd} = \sqrt{2 \operatorname{tr}(\Sigma^2) (1 + 1 / (K - 1))} / K,

the first unbiased for :math:`\|g\|^2` and the second its standard deviation at :math:`g = 0`
(:math:`\operatorname{tr}(\Sigma^2)` estimated without bias from ``S``, floored at
:math:`(\operatorname{tr} S)^2 / P`, its least value for ``P`` coordinates). The step stops when
:math:`z = \widehat{\|g\|^2} / \operatorname{sd} \le` ``stop_sigmas``: its gradient is not
detectably non-zero on the ``M`` draws its estimate is made from. At an optimal start (the
Laplace start of a linear-Gaussian step) that happens at the first check but for a fraction of
about the normal tail beyond ``stop_sigmas``, and the step runs no iteration.

Example:
    >>> import torch
    >>> G = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    >>> signal_to_noise(G) < 0, signal_to_noise(G + 10.0) > 10  # zero mean; far from zero
    (True, True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_smc.guides.streaming.frame import StepFrame

__all__ = ["CHECK_EVERY", "CHECK_GROUPS", "STOP_SIGMAS_DEFAULT", "group_gradients", "signal_to_noise", "squared_norm_estimate"]

CHECK_GROUPS = 16
"""``K``: the groups the check's draws are split into (a batched backward pass costs about 3
single ones at ``K = 16``, and ``K - 1 = 15`` degrees of freedom estimate the noise)."""

CHECK_EVERY = 10
"""Iterations between two checks of a step that did not stop at its start."""

STOP_SIGMAS_DEFAULT = 3.0
"""The default ``stop_sigmas``: an optimal start runs an iteration in about 1% of steps."""


def squared_norm_estimate(G: Tensor) -> tuple[float, float]:
    r"""From ``K`` independent estimates ``G`` ``(K, P)`` of a gradient ``g``: the unbiased estimate
    :math:`\|\bar g\|^2 - \operatorname{tr} S / K` of :math:`\|g\|^2` and its standard deviation at
    ``g = 0`` (exact for Gaussian estimates; see the module docstring).

    Raises:
        ValueError: fewer than 2 estimates.
    """
    K, P = G.shape
    if K < 2:
        raise ValueError(f"the gradient check needs at least 2 estimates, got {K}")
    nu = K - 1
    mean = G.mean(0)
    centred = G - mean
    tr_s = float(centred.square().sum()) / nu
    estimate = float(mean.square().sum()) - tr_s / K
    floor = tr_s**2 / P
    if nu >= 2:
        tr_s2 = float((centred @ centred.T).square().sum()) / nu**2
        tr_sigma2 = max(nu**2 / ((nu - 1) * (nu + 2)) * (tr_s2 - tr_s**2 / nu), floor)
    else:
        tr_sigma2 = floor
    return estimate, math.sqrt(2.0 * tr_sigma2 * (1.0 + 1.0 / nu)) / K


def signal_to_noise(G: Tensor) -> float:
    r""":math:`z = \widehat{\|g\|^2} / \operatorname{sd}` of :func:`squared_norm_estimate`: about
    standard normal at ``g = 0`` (skewed to the right for few coordinates), large when
    :math:`\|g\|^2` exceeds the estimates' noise.

    Raises:
        ValueError: fewer than 2 estimates.
    """
    estimate, sd = squared_norm_estimate(G)
    if sd <= 0.0:  # every estimate equal: no noise, so the estimate is the gradient
        return 0.0 if estimate <= 0.0 else math.inf
    return estimate / sd


def group_gradients(objective: Tensor, named: list[tuple[str, Tensor]], frame: StepFrame, w: dict[str, Tensor]) -> Tensor:
    """The whitened gradients of the means of the per-sample ``objective`` ``(M,)`` over ``K`` =
    ``min(CHECK_GROUPS, M)`` disjoint groups of draws, ``(K, P)``: two batched backward passes,
    to the family's parameters ``named`` and on through ``frame.parameters(w)`` to ``w``."""
    M = objective.shape[0]
    K = min(CHECK_GROUPS, M)
    group = torch.arange(M, device=objective.device) % K
    weights = torch.nn.functional.one_hot(group, K).T.to(objective.dtype)
    weights = weights / weights.sum(1, keepdim=True)  # row k: the mean over group k
    grads = torch.autograd.grad(objective, [p for _, p in named], weights, is_grads_batched=True, allow_unused=True)
    phi = frame.parameters(w)
    used = [(phi[name], g) for (name, _), g in zip(named, grads) if g is not None]
    w_grads = torch.autograd.grad([out for out, _ in used], list(w.values()), [g for _, g in used], is_grads_batched=True, allow_unused=True)
    return torch.cat([g.reshape(K, -1) for g in w_grads if g is not None], dim=1).detach()
