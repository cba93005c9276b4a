r"""The Hilbert space-filling curve: an order on points of :math:`\mathbb R^d` that keeps neighbours close.

Sequential quasi-Monte Carlo (``docs/math/smc.md#sequential-quasi-monte-carlo``) resamples along
one coordinate, so it needs the particles in an order in which consecutive particles are close in
the state space. The Hilbert curve of order ``b`` visits every cell of the ``2^b x ... x 2^b`` grid
of :math:`[0, 1]^d` once, and consecutive cells share a face. :func:`hilbert_index` computes the
position of integer grid cells along the curve (Skilling's transpose algorithm, vectorised over
points); :func:`hilbert_order` squashes real points into the unit cube by a logistic map of their
standardised coordinates and returns the permutation that sorts them along the curve. With
``d = 1`` the curve is the identity: the order is the plain sort.

Example:
    >>> import torch
    >>> cells = torch.tensor([[0, 0], [0, 1], [1, 1], [1, 0]])
    >>> hilbert_index(cells, bits=1).tolist()
    [0, 1, 2, 3]

Reference:
    Skilling (2004). Programming the Hilbert curve. AIP Conference Proceedings 707.

    Gerber, Chopin (2015). Sequential quasi Monte Carlo. JRSS B 77(3).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MAX_INDEX_BITS", "hilbert_index", "hilbert_order"]

#: The most bits a Hilbert index may have (it is held in an int64, whose sign bit stays clear).
MAX_INDEX_BITS = 62


def hilbert_index(cells: Tensor, bits: int) -> Tensor:
    """The position of integer grid cells along the Hilbert curve of order ``bits``.

    Args:
        cells: integer coordinates ``(..., d)`` in ``[0, 2^bits)``.
        bits: the curve's order, ``>= 1``, with ``d * bits <= 62``.

    Returns:
        int64 ``(...)``: each cell's index in ``[0, 2^(d bits))``; consecutive indices are cells
        that share a face.

    Raises:
        ValueError: ``bits < 1`` or ``d * bits > 62``.

    Example:
        >>> import torch
        >>> grid = torch.cartesian_prod(torch.arange(4), torch.arange(4))
        >>> sorted(hilbert_index(grid, bits=2).tolist()) == list(range(16))
        True
    """
    d = cells.shape[-1]
    if bits < 1 or d * bits > MAX_INDEX_BITS:
        raise ValueError(f"bits must be >= 1 with d * bits <= {MAX_INDEX_BITS}, got bits={bits} for d={d}")
    x = [cells[..., i].to(torch.int64) for i in range(d)]
    # Undo the excess work of the curve's recursion (the "inverse undo" of Skilling's algorithm):
    # at each level, reflect or exchange the low bits so that each sub-cube is entered correctly.
    q = 1 << (bits - 1)
    while q > 1:
        p = q - 1
        for i in range(d):
            high = (x[i] & q) != 0
            swap = (x[0] ^ x[i]) & p
            new0 = torch.where(high, x[0] ^ p, x[0] ^ swap)
            if i > 0:
                x[i] = torch.where(high, x[i], x[i] ^ swap)
            x[0] = new0
        q >>= 1
    # Gray encode.
    for i in range(1, d):
        x[i] = x[i] ^ x[i - 1]
    t = torch.zeros_like(x[0])
    q = 1 << (bits - 1)
    while q > 1:
        t = torch.where((x[d - 1] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    x = [xi ^ t for xi in x]
    # The transposed index holds the index's bits round-robin over the coordinates.
    index = torch.zeros_like(x[0])
    for level in range(bits - 1, -1, -1):
        for i in range(d):
            index = (index << 1) | ((x[i] >> level) & 1)
    return index


def hilbert_order(points: Tensor) -> Tensor:
    r"""The permutation that sorts each batch's points along the Hilbert curve.

    Each coordinate is standardised by the batch's mean and standard deviation and squashed into
    :math:`(0, 1)` by the logistic function, then cut into :math:`2^b` cells per coordinate with
    :math:`b = \min(\lfloor 62 / d \rfloor, \lceil (\log_2 N + 10) / d \rceil)`: about
    :math:`1000 N` cells, so that few points share one (those keep their input order). With
    ``d = 1`` this is ``argsort``; with ``d > 62`` the curve of the first 62 coordinates orders
    the points (one bit each).

    Args:
        points: ``(..., N, d)`` real points (or ``(..., N)``: ``d = 1``).

    Returns:
        int64 ``(..., N)``: the indices of the points in curve order.

    Example:
        >>> import torch
        >>> hilbert_order(torch.tensor([[0.3], [-1.0], [2.0]])).tolist()
        [1, 0, 2]
    """
    if points.dim() == 1 or points.shape[-1] == 1:
        return torch.argsort(points.reshape(points.shape[: points.dim() - (points.dim() > 1)]), dim=-1)
    points = points[..., :MAX_INDEX_BITS]
    d, n = points.shape[-1], points.shape[-2]
    # A grid of about 1000 N cells separates all but a few neighbours (which then keep their
    # input order); finer grids cost one pass per bit and order nothing more.
    bits = max(1, min(MAX_INDEX_BITS // d, math.ceil((math.log2(max(n, 2)) + 10) / d)))
    mean = points.mean(-2, keepdim=True)
    sd = points.std(-2, keepdim=True, correction=0)
    # A coordinate that does not vary gets sd 1: it has one cell, whatever its value.
    z = (points - mean) / torch.where(sd > 0, sd, torch.ones_like(sd))
    squashed = torch.sigmoid(z)
    side = float(2**bits)
    cells = (squashed * side).floor().clamp(0, side - 1).to(torch.int64)
    return torch.argsort(hilbert_index(cells, bits), dim=-1)
