r"""Ancestor indices for unbiased resampling schemes.

Each scheme maps normalised log-weights ``(..., N)`` to ancestor indices ``(..., N)`` (int64)
such that :math:`\mathbb E[\#\{i : A^i = j\}] = N w_j`. The batch dimensions are independent filters.
Systematic resampling has the lowest variance in practice and is the default of ``SMC``;
residual resampling keeps :math:`\lfloor N w_j \rfloor` copies of each particle for certain and
draws the rest multinomially.
:func:`stop_gradient_log_weights` gives the new log-weights of stop-gradient resampling, and
:func:`log_mixture_density` the marginal (mixture) transition log-density of the marginal
stop-gradient estimator. :func:`kernel_mixture_log_density` is the log-density of a weighted
Gaussian kernel mixture, the ingredient of kernel (mixture) resampling.
See ``docs/math/smc.md#index-resampling`` and ``docs/math/smc.md#stop-gradient-resampling``
and ``docs/math/smc.md#marginal-stop-gradient`` and ``docs/math/smc.md#kernel-mixture-resampling``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.resample import systematic
    >>> lw = torch.tensor([0.0, -float("inf"), -float("inf"), -float("inf")])
    >>> systematic(lw).tolist()
    [0, 0, 0, 0]

Reference:
    Douc, Cappe, Moulines (2005). Comparison of resampling schemes for particle filtering.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from pyro_smc.ops.weights import check_log_weights

__all__ = ["SCHEMES", "resample_where", "multinomial", "residual", "stratified", "systematic", "inverse_cdf", "weighted_quantiles", "stop_gradient_log_weights", "log_mixture_density", "kernel_mixture_log_density"]


# Below this many weights the binary search of inverse_cdf is the faster systematic resampler
# (fewer kernel launches); measured on a CPU, N = 100 (B = 1) vs N = 1000.
_SEARCH_BELOW = 400


def inverse_cdf(log_weights: Tensor, uniforms: Tensor) -> Tensor:
    """Inverts the weights' CDF at sorted points ``uniforms`` in ``[0, 1)``.

    Args:
        log_weights: normalised log-weights, shape ``(..., N)``.
        uniforms: sorted points, shape ``(..., M)``.

    Returns:
        Indices ``(..., M)`` of the first particle whose cumulative weight exceeds each point.

    Example:
        >>> lw = torch.tensor([0.25, 0.5, 0.25]).log()
        >>> inverse_cdf(lw, torch.tensor([0.0, 0.3, 0.74, 0.8])).tolist()
        [0, 1, 1, 2]
    """
    cdf = torch.cumsum(torch.exp(log_weights), dim=-1)
    # The last cumulative weight can round below 1; clamp so no index falls off the end.
    index = torch.searchsorted(cdf.contiguous(), uniforms.contiguous(), right=True)
    return index.clamp_(max=log_weights.shape[-1] - 1)


def weighted_quantiles(values: Tensor, log_weights: Tensor, probs: Tensor) -> Tensor:
    """Quantiles of the weighted particles, entry by entry: at each level the smallest particle
    value whose cumulative normalised weight (over the particles sorted by that value) exceeds it.

    Args:
        values: particles ``(..., N, *event)``.
        log_weights: log-weights ``(..., N)`` (not necessarily normalised).
        probs: levels ``(Q,)`` in ``[0, 1]``.

    Returns:
        ``(Q, ..., *event)``.

    Example:
        >>> x = torch.tensor([3.0, 1.0, 2.0, 4.0])
        >>> weighted_quantiles(
        ...     x, torch.tensor([0.1, 0.4, 0.4, 0.1]).log(), torch.tensor([0.3, 0.5, 0.95])
        ... ).tolist()
        [1.0, 2.0, 4.0]
    """
    batch = log_weights.dim() - 1
    extra = values.dim() - batch - 1
    moved = values.movedim(batch, -1)  # (..., *event, N)
    log_w = torch.log_softmax(log_weights, -1)
    log_w = log_w.reshape(log_w.shape[:-1] + (1,) * extra + log_w.shape[-1:]).expand_as(moved)
    sorted_values, order = moved.sort(-1)
    levels = probs.to(moved.dtype).expand(moved.shape[:-1] + probs.shape)
    index = inverse_cdf(log_w.gather(-1, order), levels)
    return sorted_values.gather(-1, index).movedim(-1, 0)


def multinomial(log_weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Multinomial resampling: ``A^i ~ Categorical(w)`` i.i.d.

    Args:
        log_weights: normalised log-weights, shape ``(..., N)``.
        generator: optional random generator.

    Returns:
        Ancestor indices, shape ``(..., N)``.

    Raises:
        ValueError: as ``check_log_weights``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> idx = multinomial(
        ...     torch.tensor([[0.0, -float("inf")], [-float("inf"), 0.0]]), generator=g
        ... )
        >>> idx.tolist()  # each row has one particle of positive weight
        [[0, 0], [1, 1]]
    """
    check_log_weights(log_weights)
    return _multinomial(log_weights.detach(), generator)


def _multinomial(lw: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    # The draw of multinomial() without its check: TorchScript compiles it (resample_where).
    n = lw.shape[-1]
    index = torch.multinomial(torch.exp(lw).reshape(-1, n), n, replacement=True, generator=generator)
    return index.reshape(lw.shape)


def residual(log_weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    r"""Residual resampling: :math:`\lfloor N w_j \rfloor` copies of each particle, and the
    :math:`R = N - \sum_j \lfloor N w_j \rfloor` others drawn i.i.d. from the residual weights
    :math:`(N w_j - \lfloor N w_j \rfloor) / R` (Liu and Chen, 1998). Each particle's number of
    copies has mean :math:`N w_j` and lies between :math:`\lfloor N w_j \rfloor` and
    :math:`\lfloor N w_j \rfloor + R`; its variance is that of multinomial resampling of the
    residuals alone. See ``docs/math/smc.md#index-resampling``.

    Arguments, returns and errors as for :func:`~pyro_smc.ops.resample.multinomial`.

    Example:
        >>> lw = torch.tensor([0.5, 0.25, 0.25, 0.0]).log()
        >>> # N w is whole: the copies are certain
        >>> torch.bincount(residual(lw), minlength=4).tolist()
        [2, 1, 1, 0]
    """
    check_log_weights(log_weights)
    return _residual(log_weights.detach(), generator)


def _residual(lw: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    n = lw.shape[-1]
    expected = torch.exp(lw) * n
    copies = expected.floor()
    rest = expected - copies
    counts = copies.long()
    certain = counts.sum(-1, keepdim=True)  # (..., 1): positions below it are the certain copies
    position = torch.arange(n, device=lw.device).expand(lw.shape).contiguous()
    # Position k < certain copies the particle whose running count first exceeds k.
    kept = torch.searchsorted(counts.cumsum(-1), position, right=True)
    # The others: i.i.d. draws from the residual weights, the (k - certain)-th for position k.
    # A filter with no residual mass (every N w_j whole) uses none of them; its row is drawn
    # from equal weights so that torch.multinomial never sees an all-zero row.
    empty = rest.sum(-1, keepdim=True) <= 0
    rest = torch.where(empty, torch.ones_like(rest), rest)
    drawn = torch.multinomial(rest.reshape(-1, n), n, replacement=True, generator=generator).reshape(lw.shape)
    drawn = drawn.gather(-1, (position - certain).clamp(min=0))
    return torch.where(position < certain, kept, drawn).clamp(max=n - 1)


def stratified(log_weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Stratified resampling: one uniform in each stratum ``[(i-1)/N, i/N)``.

    Arguments, returns and errors as for :func:`~pyro_smc.ops.resample.multinomial`.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> lw = torch.tensor([0.5, 0.25, 0.25, 0.0]).log()
        >>> # the cumulative weights fall on the strata edges
        >>> stratified(lw, generator=g).tolist()
        [0, 0, 1, 2]
        >>> stratified(lw.expand(5, 4), generator=g).shape
        torch.Size([5, 4])
    """
    check_log_weights(log_weights)
    return _stratified(log_weights.detach(), generator)


def _stratified(lw: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    n = lw.shape[-1]
    u = torch.rand(lw.shape, dtype=lw.dtype, device=lw.device, generator=generator)
    grid = torch.arange(n, dtype=lw.dtype, device=lw.device)
    return inverse_cdf(lw, (grid + u) / n)


def systematic(log_weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Systematic resampling: one uniform ``u ~ U(0, 1/N)`` shared by all points ``u + (i-1)/N``.

    From 400 weights on, the ancestors come from the closed-form count of points below each
    cumulative weight (``O(N)``) instead of a binary search per point.
    See ``docs/math/smc.md#index-resampling``.

    Arguments, returns and errors as for :func:`~pyro_smc.ops.resample.multinomial`.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> idx = systematic(torch.tensor([0.5, 0.25, 0.25, 0.0]).log(), generator=g)
        >>> # exactly N w_j copies when N w_j is whole
        >>> torch.bincount(idx, minlength=4).tolist()
        [2, 1, 1, 0]
    """
    check_log_weights(log_weights)
    return _systematic(log_weights.detach(), generator, _SEARCH_BELOW)


def _systematic(lw: Tensor, generator: Optional[torch.Generator], search_below: int) -> Tensor:
    # The draw of systematic() without its check (TorchScript reads no module global: the
    # threshold comes in).
    n = lw.shape[-1]
    u = torch.rand(list(lw.shape[:-1]) + [1], dtype=lw.dtype, device=lw.device, generator=generator)
    if lw.numel() < search_below:
        grid = torch.arange(n, dtype=lw.dtype, device=lw.device)
        return inverse_cdf(lw, (grid + u) / n)
    # The points (i + u) / N are evenly spaced, so the number of them below each cumulative
    # weight is a closed form, ceil(N cdf_j - u); a point's ancestor is then the number of those
    # counts at or below its index (a scatter and a cumsum, O(N) against the O(N log N) search).
    # Same ancestors as inverse_cdf; 2x faster at (1, 1000), 10x at (32, 1000) on a CPU.
    cdf = torch.cumsum(torch.exp(lw), dim=-1)
    below = (cdf * n - u).ceil_().clamp_(0, n).long()
    marks = torch.zeros(list(lw.shape[:-1]) + [n + 1], dtype=torch.long, device=lw.device)
    marks.scatter_add_(-1, below, torch.ones_like(below))
    # As in inverse_cdf: the last cumulative weight can round below 1; no index falls off the end.
    return marks.cumsum(-1)[..., :n].clamp_(max=n - 1)


def stop_gradient_log_weights(log_weights: Tensor, index: Tensor) -> Tensor:
    r"""New log-weights after index resampling that keep the ancestors' weight gradient.

    :math:`\log w_{A_i} - \operatorname{stop\_grad}(\log w_{A_i}) - \log N` (Scibior and Wood, 2021): exactly
    :math:`-\log N` in value, with the gradient of :math:`\log w_{A_i}`. An ancestor of zero weight (only
    reachable through the clamp of :func:`inverse_cdf` when the cumulative weights round below
    one) gets :math:`-\log N` and no gradient rather than NaN.
    See ``docs/math/smc.md#stop-gradient-resampling``.

    Args:
        log_weights: normalised log-weights, shape ``(..., N)``.
        index: ancestor indices, shape ``(..., N)``.

    Returns:
        Log-weights ``(..., N)``, equal in value to ``-log N``.

    Example:
        >>> lw = torch.tensor([0.25, 0.75]).log().requires_grad_()
        >>> new = stop_gradient_log_weights(lw, torch.tensor([1, 1]))
        >>> new.exp().tolist(), torch.autograd.grad(new.sum(), lw)[0].tolist()
        ([0.5, 0.5], [0.0, 2.0])
    """
    chosen = log_weights.gather(-1, index)
    delta = chosen - chosen.detach()
    delta = torch.where(torch.isfinite(chosen), delta, torch.zeros_like(delta))
    return delta - math.log(log_weights.shape[-1])


#: The index schemes :func:`resample_where` draws by, and their codes.
SCHEMES = {"systematic": 0, "stratified": 1, "multinomial": 2, "residual": 3}


def resample_where(
    need: Tensor, every: bool, log_weights: Tensor, particles: List[Tensor], scheme: int, stop_gradient: bool, search_below: int = _SEARCH_BELOW
) -> Tuple[List[Tensor], Tensor]:
    """Index resampling of the filters ``need`` in tensor operations alone: a replayed step of
    ``SMC`` resamples by it without the Python of a resampler call and its checks
    (``docs/engines/smc.md#the-compiled-step``).

    The same draws, in the same order, as the engine's ``maybe_resample`` with an
    :class:`~pyro_smc.resamplers.IndexResampler`: all filters at once when all need it, else
    the sub-batch ``need`` alone. No check: the caller has checked the weights (finite
    normalisers) and that some filter needs resampling.

    Args:
        need: bool ``(B,)``, the filters to resample (at least one).
        every: ``need.all()``, as the caller read it.
        log_weights: normalised ``(B, N)``.
        particles: tensors ``(B, N, *event)`` (labels may be floats: they are copied).
        scheme: ``SCHEMES[name]``.
        stop_gradient: new log-weights by :func:`stop_gradient_log_weights`, else ``-log N``.
        search_below: systematic resampling searches below this many weights (``_SEARCH_BELOW``).

    Returns:
        The particles and the log-weights after resampling.

    Example:
        >>> lw = torch.tensor([[0.0, -float("inf")]])
        >>> new, new_lw = resample_where(
        ...     torch.tensor([True]), True, lw, [torch.tensor([[1.0, 2.0]])], 0, False
        ... )
        >>> new[0].tolist(), new_lw.exp().tolist()
        ([[1.0, 1.0]], [[0.5, 0.5]])
    """
    if every:
        index = _ancestors(log_weights.detach(), scheme, search_below)
        return [_gather(value, index) for value in particles], _new_log_weights(log_weights, index, stop_gradient)
    rows = need.nonzero().squeeze(-1)
    some = log_weights[rows]
    index = _ancestors(some.detach(), scheme, search_below)
    new = [value.index_put([rows], _gather(value[rows], index)) for value in particles]
    return new, log_weights.index_put([rows], _new_log_weights(some, index, stop_gradient))


def _ancestors(lw: Tensor, scheme: int, search_below: int) -> Tensor:
    if scheme == 0:
        return _systematic(lw, None, search_below)
    if scheme == 1:
        return _stratified(lw, None)
    if scheme == 3:
        return _residual(lw, None)
    return _multinomial(lw, None)


def _new_log_weights(log_weights: Tensor, index: Tensor, stop_gradient: bool) -> Tensor:
    if stop_gradient:
        return stop_gradient_log_weights(log_weights, index)
    return torch.full_like(log_weights, -math.log(log_weights.shape[-1]))


def _gather(value: Tensor, index: Tensor) -> Tensor:
    # resamplers.base.gather for one tensor, in TorchScript's terms.
    dim = index.dim()
    if value.dim() == dim:
        return value.gather(dim - 1, index)
    shape = list(index.shape)
    full = index.reshape(shape + [1] * (value.dim() - dim)).expand(shape + list(value.shape[dim:]))
    return value.gather(dim - 1, full)


def log_mixture_density(log_weights: Tensor, log_kernel: Tensor) -> Tensor:
    r""":math:`m_i = \log \sum_j w_j k(x_i \mid x'_j)`: each new point's log-density under the weighted mixture.

    Args:
        log_weights: normalised log-weights of the parents, shape ``(..., N_j)``.
        log_kernel: ``log k(x_i | x'_j)`` for every pair, shape ``(..., N_i, N_j)``.

    Returns:
        ``(..., N_i)``. Differentiable in both arguments; a row with no finite term (every
        parent of zero weight or zero density) gives ``-inf`` and a zero gradient, not NaN.
        Memory ``O(N_i N_j)`` per batch element.
        See ``docs/math/smc.md#marginal-stop-gradient``.

    Example:
        >>> lw = torch.tensor([0.25, 0.75]).log()
        >>> log_k = torch.tensor([[1.0, 1.0], [0.0, 2.0]]).log()
        >>> [round(v, 6) for v in log_mixture_density(lw, log_k).exp().tolist()]
        [1.0, 1.5]
    """
    joint = log_weights.unsqueeze(-2) + log_kernel
    dead = ~(joint.detach().amax(-1, keepdim=True) > -math.inf)
    # A row of -inf would give NaN gradients through logsumexp; it is masked and set back to -inf.
    safe = torch.where(dead, torch.zeros_like(joint), joint)
    out = torch.logsumexp(safe, dim=-1)
    return torch.where(dead.squeeze(-1), torch.full_like(out, -math.inf), out)


def kernel_mixture_log_density(points: Tensor, centres: Tensor, log_weights: Tensor, bandwidth: Tensor, allowed: Tensor | None = None) -> Tensor:
    r""":math:`\log m(x_i)`, :math:`m(x) = \sum_j w_j \mathcal N(x; c_j, \operatorname{diag}(h^2))`: a weighted Gaussian kernel mixture.

    Coordinates with bandwidth exactly ``0`` are point masses: they contribute no factor, which
    is exact only when every centre of positive weight has the same value there (as for a
    bandwidth proportional to the weighted standard deviation). All ``M N`` pairs are formed,
    by the expansion :math:`\lVert u\rVert^2 + \lVert v\rVert^2 - 2 u \cdot v` of the squared distance in scaled coordinates
    :math:`u = (x - \bar c) / h` centred at the (detached) weighted mean :math:`\bar c` of the centres, so
    memory is :math:`O(M N)` per batch element, not :math:`O(M N D)`; its rounding error is about
    :math:`\epsilon \max \lVert u\rVert^2` in the exponent (:math:`\epsilon` the dtype's rounding unit). See ``docs/math/smc.md#kernel-mixture-resampling``.

    Args:
        points: where to evaluate, shape ``(..., M, D)``.
        centres: kernel centres, shape ``(..., N, D)``.
        log_weights: normalised log-weights of the centres, shape ``(..., N)``.
        bandwidth: kernel standard deviations ``h >= 0``, broadcastable to ``(..., D)``.
        allowed: optional bool ``(..., M, N)``; ``False`` drops centre ``j`` from the mixture at
            point ``i`` (a point mass in some other coordinate that the two do not share).

    Returns:
        ``(..., M)``, differentiable in ``points``, ``centres``, ``log_weights`` and ``bandwidth``.
        A point with no allowed centre of positive weight gets ``-inf`` and a zero gradient.

    Example:
        >>> lw = torch.tensor([0.25, 0.75]).log()
        >>> c = torch.tensor([[0.0], [1.0]])
        >>> m = kernel_mixture_log_density(torch.tensor([[0.0]]), c, lw, torch.tensor(1.0))
        >>> ref = (
        ...     torch.distributions.Normal(c.squeeze(-1), 1.0)
        ...     .log_prob(torch.zeros(2))
        ...     .add(lw)
        ...     .logsumexp(-1)
        ... )
        >>> bool(torch.allclose(m, ref))
        True
    """
    h = torch.as_tensor(bandwidth, dtype=points.dtype, device=points.device)
    h = h.broadcast_to(torch.broadcast_shapes(h.shape, points.shape[:-2] + points.shape[-1:]))
    point = h == 0
    safe_h = torch.where(point, torch.ones_like(h), h)
    shift = (log_weights.detach().exp().unsqueeze(-1) * centres.detach()).sum(-2, keepdim=True)
    u = (points - shift) / safe_h.unsqueeze(-2)
    v = (centres - shift) / safe_h.unsqueeze(-2)
    if bool(point.any()):
        u = torch.where(point.unsqueeze(-2), torch.zeros_like(u), u)
        v = torch.where(point.unsqueeze(-2), torch.zeros_like(v), v)
    sq = (u * u).sum(-1, keepdim=True) + (v * v).sum(-1).unsqueeze(-2) - 2 * (u @ v.transpose(-1, -2))
    log_norm = torch.where(point, torch.zeros_like(h), safe_h.log() + 0.5 * math.log(2 * math.pi))
    log_kernel = -0.5 * sq.clamp(min=0) - log_norm.sum(-1)[..., None, None]
    if allowed is not None:
        log_kernel = log_kernel.masked_fill(~allowed, -math.inf)
    return log_mixture_density(log_weights, log_kernel)
