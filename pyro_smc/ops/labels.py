r"""Particles grouped by a discrete label: class ids, class masses, within-class weights.

A particle filter whose state has a discrete part (a regime label, a count) and a continuous
part may only transport the continuous part between particles of the same label: a particle
moved to an average over particles of different labels fits none of them. Label-wise OT
resampling (:class:`~pyro_smc.resamplers.OTResampler`) therefore needs, per filter, which
particles share a label (:func:`label_classes`), each class's mass :math:`W_k = \sum_{i \in k} w_i`
and the weights renormalised within each class (:func:`class_weights`), and the cost of moving
between classes made prohibitive (:func:`separate_classes`). See
``docs/math/smc.md#discrete-labels-and-optimal-transport``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.labels import class_weights, label_classes
    >>> keys = torch.tensor([[7, 3, 7, 3, 5]]).unsqueeze(-1)  # 1 filter, 1 label each
    >>> classes = label_classes(keys)
    >>> classes.tolist()
    [[2, 0, 2, 0, 1]]
    >>> log_w = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]]).log()
    >>> within, log_share = class_weights(log_w, classes)
    >>> [round(v, 3) for v in within.exp()[0].tolist()]  # class k keeps mass n_k / N
    [0.1, 0.133, 0.3, 0.267, 0.2]
    >>> [round(v, 3) for v in log_share.exp()[0].tolist()]  # W_k / n_k
    [0.2, 0.3, 0.2, 0.3, 0.0]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["label_classes", "class_weights", "class_sums", "class_moments", "separate_classes"]


def label_classes(keys: Tensor) -> Tensor:
    """Class id of every particle: the rank of its label among the distinct labels of its filter.

    Two particles of one filter get the same id exactly when all their label entries agree. The
    ids of a filter with ``K`` distinct labels are ``0 .. K - 1`` (in the lexicographic order of
    the labels). Sorting, ``O(N log N)`` per filter and label entry; no ``N x N`` comparison.

    Args:
        keys: integer labels ``(..., N, L)``: ``L`` entries per particle (several discrete
            sites, or one site with an event shape, flattened).

    Returns:
        int64 class ids ``(..., N)``.

    Example:
        >>> import torch
        >>> keys = torch.tensor([[0, 1], [0, 0], [0, 1], [2, 0]])  # N = 4 particles, L = 2
        >>> label_classes(keys).tolist()
        [1, 0, 1, 2]
    """
    if keys.dim() < 2:
        raise ValueError(f"label_classes: keys must be (..., N, L), got shape {tuple(keys.shape)}")
    keys = keys.long()
    n = keys.shape[-2]
    # Lexicographic order by stable sorts from the last entry to the first.
    order = torch.arange(n, device=keys.device).expand(keys.shape[:-1])
    for column in range(keys.shape[-1] - 1, -1, -1):
        values = keys[..., column].gather(-1, order)
        order = order.gather(-1, values.sort(dim=-1, stable=True).indices)
    ordered = keys.gather(-2, order.unsqueeze(-1).expand(keys.shape))
    starts = (ordered[..., 1:, :] != ordered[..., :-1, :]).any(-1)
    ranks = torch.cat([starts.new_zeros(starts.shape[:-1] + (1,)), starts], -1).long().cumsum(-1)
    return torch.empty_like(ranks).scatter_(-1, order, ranks)


def class_weights(log_weights: Tensor, classes: Tensor) -> tuple[Tensor, Tensor]:
    r"""Weights renormalised within each class, and each particle's share of its class's mass.

    With :math:`W_k` the weight of class ``k`` and :math:`n_k` its number of particles, particle ``i``
    of class ``k`` gets :math:`w_i n_k / (N W_k)`: within the class the weights are the class's
    conditional distribution, and the class keeps the share :math:`n_k / N` of the total, so a
    transport plan from the uniform measure can stay within classes. A class of zero weight gets
    uniform weights (``1/N`` each): it is transported like any other and then given no
    offspring. Computed in the log domain, so a class whose weights underflow in ``exp`` keeps
    its mass.

    Args:
        log_weights: normalised log-weights ``(..., N)`` (``-inf`` allowed).
        classes: int64 class ids ``(..., N)`` in ``[0, N)`` (:func:`label_classes`).

    Returns:
        ``(within, log_share)``, both ``(..., N)`` and differentiable in ``log_weights``: the
        within-class log-weights (normalised over the particles) and :math:`\log (W_{k(i)} / n_{k(i)})`, the
        weight each particle of a class carries once the class is equally weighted within
        (normalised over the particles too).

    Example:
        >>> import torch
        >>> log_w = torch.tensor([0.5, 0.5, 0.0, 0.0]).log()
        >>> within, log_share = class_weights(log_w, torch.tensor([0, 0, 1, 1]))
        >>> within.exp().tolist(), log_share.exp().tolist()
        ([0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0])
    """
    n = log_weights.shape[-1]
    # Log-sum-exp per class, shifted by the class's largest log-weight.
    top = torch.full_like(log_weights, -math.inf).scatter_reduce(-1, classes, log_weights.detach(), "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    shifted = (log_weights - top.gather(-1, classes)).exp()
    total = torch.zeros_like(log_weights).scatter_add(-1, classes, shifted)
    # log(0) is -inf, but its derivative would turn the zero gradient of a class of zero mass
    # into NaN.
    empty = total == 0
    log_mass = torch.where(empty, -math.inf, total.masked_fill(empty, 1).log()) + top
    log_mass = log_mass.gather(-1, classes)
    log_counts = torch.zeros_like(log_weights).scatter_add_(-1, classes, torch.ones_like(log_weights)).gather(-1, classes).log()
    within = log_weights - log_mass + log_counts - math.log(n)
    # A class of zero mass: uniform (its -inf - -inf would be NaN).
    within = torch.where(torch.isfinite(log_mass), within, torch.full_like(within, -math.log(n)))
    return within, log_mass - log_counts


def class_sums(values: Tensor, classes: Tensor) -> Tensor:
    """For every particle, the sum of ``values`` over the particles of its class.

    Args:
        values: ``(..., N, D)``.
        classes: int64 class ids ``(..., N)``.

    Returns:
        ``(..., N, D)``, differentiable in ``values``.

    Example:
        >>> import torch
        >>> class_sums(torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([0, 1, 0])).tolist()
        [[5.0], [2.0], [5.0]]
    """
    index = classes.unsqueeze(-1).expand(values.shape)
    return torch.zeros_like(values).scatter_add(-2, index, values).gather(-2, index)


def class_moments(x: Tensor, classes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For every particle of ``x``: its offset from its class's mean, its class's (population)
    variance per coordinate and its class's size.

    Args:
        x: particles ``(..., N, D)``.
        classes: int64 class ids ``(..., N)``.

    Returns:
        ``(centred, var, counts)``: ``(..., N, D)``, ``(..., N, D)``, ``(..., N)``, differentiable
        in ``x``.

    Example:
        >>> import torch
        >>> x, classes = torch.tensor([[0.0], [2.0], [5.0]]), torch.tensor([0, 0, 1])
        >>> centred, var, counts = class_moments(x, classes)
        >>> centred.flatten().tolist(), var.flatten().tolist(), counts.tolist()
        ([-1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [2.0, 2.0, 1.0])
    """
    counts = class_sums(torch.ones_like(x[..., :1]), classes)
    centred = x - class_sums(x, classes) / counts
    return centred, class_sums(centred.square(), classes) / counts, counts.squeeze(-1)


def separate_classes(cost: Tensor, x: Tensor, classes: Tensor, scale2: Tensor | float, epsilon: float) -> float:
    r"""Sets, in place, the cost of every pair of different classes to a value whose kernel is
    exactly zero, and returns the mean cost over the pairs within classes.

    Within-class problems are balanced (:func:`class_weights`), so the entropic plan of the
    separated cost is block-diagonal: Sinkhorn runs each class on its own. The separating value
    is :math:`2 C_{\max} + 1500 \max(\epsilon, \bar C)`, with :math:`C_{\max}` a bound on the costs within
    classes and :math:`\bar C` their mean (above the first epsilon of any annealing schedule, a
    quarter of it). It keeps :math:`\exp((f_i + g_j - C_{ij}) / \epsilon)` below :math:`e^{-1000}`, zero in
    float64 as in float32, for potentials bounded by the within-class costs; a finite value
    keeps the solver's arithmetic free of ``inf - inf``.

    Both numbers come from the class moments, with no pass over the ``(N, N)`` cost: over the
    pairs of class ``k`` the cost :math:`\lVert x_i - x_j \rVert^2 / \delta_k^2` averages
    :math:`2 \operatorname{tr} \operatorname{Var}_k / \delta_k^2`, and each is at most
    :math:`4 \max_{i \in k} \lVert x_i - m_k \rVert^2 / \delta_k^2`. The mean feeds the annealing schedule: the
    mean over all pairs counted those across classes, switched annealing on at epsilon 0.5 and
    cost 1.6x.

    Args:
        cost: cost matrices ``(..., N, N)`` of ``x`` with itself, scaled by ``1 / scale2``.
        x: particles ``(..., N, D)``.
        classes: int64 class ids ``(..., N)``.
        scale2: the cost's divisor: a number, or each particle's class scale ``(..., N)``.
        epsilon: the final regularisation.

    Returns:
        The mean cost within classes (a float).

    Example:
        >>> import torch
        >>> x = torch.tensor([[0.0], [1.0], [3.0]])
        >>> cost = torch.cdist(x, x).square()
        >>> round(separate_classes(cost, x, torch.tensor([0, 0, 1]), torch.ones(3), 0.5), 6)
        0.4
        >>> cost[0].tolist()
        [0.0, 1.0, 752.0]
    """
    with torch.no_grad():
        centred, var, counts = class_moments(x, classes)
        mean_cost = float((counts * 2 * var.sum(-1) / scale2).sum() / counts.sum())
        largest = float((4 * centred.square().sum(-1) / scale2).amax())
    apart = classes.unsqueeze(-1) != classes.unsqueeze(-2)
    cost.masked_fill_(apart, 2 * largest + 1500 * max(epsilon, mean_cost))
    return mean_cost
