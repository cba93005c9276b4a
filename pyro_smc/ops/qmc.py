r"""Randomised quasi-Monte Carlo points and the resampling step of sequential quasi-Monte Carlo.

See ``docs/math/smc.md#sequential-quasi-monte-carlo``. :func:`sobol_points` draws independent
scrambled Sobol point sets, one per filter: each point is uniform on :math:`[0, 1)^s` while the set
fills the cube far more evenly than independent draws. :func:`qmc_resample` is the resampling of
SQMC (Gerber and Chopin, 2015): the particles in Hilbert-curve order (:mod:`~pyro_smc.ops.hilbert`),
the points sorted by their first coordinate, the ancestor of the ``n``-th point the inverse of the
weights' CDF (in curve order) at that coordinate, and the point's other coordinates returned with it
to drive the move by inverse CDFs.

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> like = torch.zeros((), dtype=torch.float64)
    >>> u = sobol_points(num_points=8, dim=2, batch=3, like=like)
    >>> u.shape, bool(((u > 0) & (u < 1)).all())
    (torch.Size([3, 8, 2]), True)

Reference:
    Gerber, Chopin (2015). Sequential quasi Monte Carlo. JRSS B 77(3).

    Owen (1995). Randomly permuted (t, m, s)-nets and (t, s)-sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.ops.resample import inverse_cdf

__all__ = ["qmc_resample", "sobol_points"]


def sobol_points(num_points: int, dim: int, batch: int, like: Tensor) -> Tensor:
    r"""``batch`` independent scrambled Sobol point sets of ``num_points`` points in :math:`(0, 1)^{dim}`.

    Each set is the first ``num_points`` points of a Sobol sequence with a random linear matrix
    scramble and digital shift (as ``torch.quasirandom.SobolEngine(scramble=True)`` makes them),
    drawn from torch's global generator, so ``torch.manual_seed`` makes the points reproducible. The points
    are kept a rounding step away from 0 and 1, where inverse CDFs are infinite. Balance is best
    when ``num_points`` is a power of 2.

    Args:
        num_points: points per set, ``>= 1``.
        dim: their dimension, ``>= 1`` (at most 21201).
        batch: the number of independent sets, ``>= 1``.
        like: a tensor whose dtype and device the points take.

    Returns:
        ``(batch, num_points, dim)``.

    Example:
        >>> import torch
        >>> u = sobol_points(16, 1, 1, torch.zeros(()))
        >>> cells = (u[0, :, 0] * 16).floor().long()  # one point per stratum
        >>> sorted(cells.tolist()) == list(range(16))
        True
    """
    u = _scrambled_sobol(num_points, dim, batch).to(dtype=like.dtype, device=like.device)
    tiny = torch.finfo(like.dtype).eps
    return u.clamp(tiny, 1 - tiny)


#: Below this many coordinates per set, one batched scramble beats building an engine per set
#: (about 0.1 ms each); measured on a CPU, N = 16 x 3 (B = 2000): 0.05 s against 0.74 s.
_BATCHED_BELOW = 512


def _scrambled_sobol(num_points: int, dim: int, batch: int) -> Tensor:
    """``(batch, num_points, dim)`` float64 on the CPU: ``batch`` independently scrambled copies
    of the Sobol net, each by a random linear matrix scramble and a digital shift (the
    randomisation of ``SobolEngine(scramble=True)``), plus a uniform jitter below the last of its
    30 digits, which makes each point exactly uniform."""
    engine = torch.quasirandom.SobolEngine
    # The engines and the global generator's stream are on the CPU; the caller moves the points.
    cpu = torch.device("cpu")
    if num_points * dim >= _BATCHED_BELOW:
        seeds = torch.randint(0, 2**62, (batch,), device=cpu).tolist()
        sets = torch.stack([engine(dim, scramble=True, seed=seed).draw(num_points, dtype=torch.float64) for seed in seeds])
        return sets + torch.rand(sets.shape, dtype=torch.float64, device=cpu) * 2.0**-engine.MAXBIT
    bits = engine.MAXBIT
    x = (engine(dim).draw(num_points, dtype=torch.float64) * 2**bits).to(torch.int32)  # (N, dim), exact
    # Row k of a set's matrix: digit k itself (a unit diagonal) plus random more significant digits.
    own = torch.ones((), dtype=torch.int32, device=cpu) << (bits - 1 - torch.arange(bits, dtype=torch.int32, device=cpu))
    above = ((1 << bits) - 1) ^ ((own << 1) - 1)
    rows = (torch.randint(0, 2**bits, (batch, 1, dim, bits), dtype=torch.int32, device=cpu) & above) | own
    out = torch.zeros((batch, num_points, dim), dtype=torch.int32, device=cpu)
    for k in range(bits):
        # Digit k of the scrambled point: the parity of the point's digits the row selects.
        v = x & rows[..., k]
        for step in (16, 8, 4, 2, 1):
            v = v ^ (v >> step)
        out = out | ((v & 1) << (bits - 1 - k))
    out = out ^ torch.randint(0, 2**bits, (batch, 1, dim), dtype=torch.int32, device=cpu)
    return (out.to(torch.float64) + torch.rand(out.shape, dtype=torch.float64, device=cpu)) * 2.0**-bits


def qmc_resample(log_weights: Tensor, order: Tensor, points: Tensor) -> tuple[Tensor, Tensor]:
    r"""The ancestors of SQMC's resampling, and the coordinates that move each new particle.

    The points are sorted by their first coordinate :math:`u^{(1)}_0 \le \dots \le u^{(N)}_0`; the
    ``n``-th new particle descends from the particle at which the cumulative weight, summed in the
    order ``order``, first exceeds :math:`u^{(n)}_0`. Each ancestor is drawn with probability its
    weight, as every point is uniform; the ancestors come out in curve order, paired with the
    remaining coordinates of their points.

    Args:
        log_weights: normalised log-weights ``(..., N)``.
        order: the particles' order ``(..., N)`` (:func:`~pyro_smc.ops.hilbert.hilbert_order`).
        points: ``(..., M, 1 + D)`` points in :math:`(0, 1)`.

    Returns:
        ``(ancestors, moves)``: int64 ``(..., M)`` and the points' other coordinates
        ``(..., M, D)``, row ``n`` of ``moves`` belonging to ancestor ``n``.

    Example:
        >>> import torch
        >>> lw = torch.tensor([0.5, 0.0, 0.5]).log()
        >>> points = torch.tensor([[0.875, 0.125], [0.25, 0.75]])
        >>> ancestors, moves = qmc_resample(lw, torch.tensor([2, 1, 0]), points)
        >>> ancestors.tolist(), moves.tolist()
        ([2, 0], [[0.75], [0.125]])
    """
    first, tau = torch.sort(points[..., 0], dim=-1)
    moves = points[..., 1:].gather(-2, tau.unsqueeze(-1).expand(tau.shape + (points.shape[-1] - 1,)))
    ranked = inverse_cdf(log_weights.gather(-1, order), first)
    return order.gather(-1, ranked), moves
