r"""Building blocks of log-stabilised Sinkhorn: batched mat-vecs, c-transforms, empty points.

See ``docs/math/smc.md#sinkhorn-in-the-log-domain``.

The plan of a Sinkhorn iterate is :math:`P = \operatorname{diag}(a u) \, K \operatorname{diag}(b v)` with the stabilised kernel
:math:`K_{ij} = \exp((f_i + g_j - C_{ij}) / \epsilon)`: the potentials :math:`f, g` hold what has been absorbed
and the scalings :math:`u, v` stay :math:`O(1)`. This module holds the pieces every stage of the solver
(:mod:`pyro_smc.ops.sinkhorn_solver`), the adjoint (:mod:`pyro_smc.ops.sinkhorn_implicit`) and
the fused ensemble transform (:mod:`pyro_smc.ops.ensemble`) share:
the batched products with ``K``, the exact log-domain c-transform, and the handling of points
whose mass underflows to zero (treated as empty, their scalings pinned to 1).

Allocations: every ``(B, N, M)`` temporary is built in place where autograd allows
(``stabilised_kernel``, ``baddbmm(...).clamp_min_(0)``). A batch of kernels is above glibc's
mmap threshold (1.3 MB at 32 x 100 x 100 float32); two such temporaries freed together let the
allocator return the memory to the system, and the next allocation faults in every page again:
``exp(cost * c)`` took 2.2 ms where ``(cost * c).exp_()`` took 0.45 ms (one thread, this
project's 2-core benchmark machine).

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn_kernel import log_domain_update, rowsum
    >>> cost = torch.rand(2, 4, 3, dtype=torch.float64)
    >>> log_a = torch.full((2, 4), -math.log(4), dtype=torch.float64)
    >>> log_b = torch.full((2, 3), -math.log(3), dtype=torch.float64)
    >>> f, g = torch.zeros_like(log_a), torch.zeros_like(log_b)
    >>> f, g, kernel = log_domain_update(cost, f, g, log_a, log_b, 0.1, None, None)
    >>> rows = log_a.exp() * rowsum(kernel, log_b.exp())      # row sums of the plan: exact
    >>> bool(torch.allclose(rows, log_a.exp()))
    True
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

# Shared by the Sinkhorn modules and the fused ensemble transform, not part of the API.
__all__: list[str] = []


# exp(t) is computed as exp2(t * log2(e)): on CPU torch.exp over a (32, 100, 100) kernel took
# 3x as long as torch.exp2 in float32 and 1.8x in float64 (270 against 92 us, 540 against
# 296 us, one thread, this project's benchmark machine). The extra rounding of the scaled
# exponent is |t| ulps relative, below 1e-5 in float32 for every entry that is not already
# below 1e-38, far under the solver's marginal threshold.
_LOG2E = 1.4426950408889634


def stabilised_kernel(cost: Tensor, f: Tensor, g: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """The stabilised kernel ``exp((f_i + g_j - C_ij) / eps)``, built in place in a fresh tensor
    or in ``out`` (a buffer of the cost's shape). ``f`` and ``g`` carry the batch shape of ``cost``."""
    return torch.add(f.unsqueeze(-1), g.unsqueeze(-2), out=out).sub_(cost).mul_(_LOG2E / eps).exp2_()


def plain_kernel(cost: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """``exp(-C / eps)``: the kernel with zero potentials, built in place in a fresh tensor or in
    ``out``."""
    return torch.mul(cost, -_LOG2E / eps, out=out).exp2_()


def rowsum(kernel: Tensor, v: Tensor) -> Tensor:
    r""":math:`K v` batched. Written as :math:`v^\top K^\top`: on CPU the row-vector form of a batched mat-vec
    is several times faster than ``K @ v[..., None]`` (measured 9x at 32 x 100 x 100)."""
    return (v.unsqueeze(-2) @ kernel.transpose(-1, -2)).squeeze(-2)


def colsum(kernel: Tensor, u: Tensor) -> Tensor:
    r""":math:`K^\top u` batched."""
    return (u.unsqueeze(-2) @ kernel).squeeze(-2)


def row_products(rows: Tensor, kernel: Tensor) -> Tensor:
    r"""``rows @ kernel`` for thin rows ``(B, q, N)`` and a batch of kernels ``(B, N, M)`` (either
    may be a transposed view), as one bmm.

    A row count of 3 modulo 4 is padded with a row of zeros: the CPU BLAS behind ``bmm`` runs
    multiples of four rows faster than one row fewer (at 32 x 100 x 100, 4 rows took 108 us
    where 3 took 127 in float32; 8 rows 380 us where 7 took 524 in float64; one thread, this
    project's benchmark machine). The padded row's product is dropped (a view).
    """
    q = rows.shape[-2]
    if q % 4 != 3:
        return torch.bmm(rows, kernel)
    padded = torch.cat([rows, rows.new_zeros(rows.shape[:-2] + (1, rows.shape[-1]))], -2)
    return torch.bmm(padded, kernel)[:, :q]


def soft_min(cost: Tensor, pot: Tensor, log_w: Tensor, eps: float, rows: bool) -> Tensor:
    r"""The c-transform :math:`-\epsilon \log \sum \exp((\mathrm{pot} - C) / \epsilon + \log w)` over the points of ``pot``:
    ``rows=True`` maps row potentials ``f`` to column potentials ``g``, ``rows=False`` the reverse."""
    return -eps * torch.logsumexp(soft_min_logits(cost, pot, log_w, eps, rows), dim=-2 if rows else -1)


def soft_min_logits(cost: Tensor, pot: Tensor, log_w: Tensor, eps: float, rows: bool) -> Tensor:
    """The exponents summed by :func:`soft_min`, shape ``(..., N, M)``."""
    if rows:
        return (pot.unsqueeze(-1) - cost) / eps + log_w.unsqueeze(-1)
    return (pot.unsqueeze(-2) - cost) / eps + log_w.unsqueeze(-2)


def mask_kernel(kernel: Tensor, a_zero: Tensor | None, b_zero: Tensor | None) -> Tensor:
    """Zeroes the kernel's rows and columns of zero-mass points.

    Their entries carry no mass, but they are not bounded: a row far from every heavy particle
    needs ``K_ij`` up to ``1 / b_j`` for its marginal, which overflows float32 once ``b_j`` is
    below 1e-38, and ``0 * inf`` then sent every iteration back to an absorption (100 of them
    without a convergence check on a float32 filter with ESS 1.001).

    Outside autograd the kernel is fresh, so the few masked rows/columns are zeroed in place by
    index: ``masked_fill`` with a broadcast ``(B, 1, M)`` mask costs five times an ``exp`` of the
    whole kernel on CPU (424 us against 83 us at 32 x 100 x 100, float32).
    """
    inplace = not (torch.is_grad_enabled() and kernel.requires_grad)
    if a_zero is not None:
        if inplace:
            idx = a_zero.nonzero()
            kernel[idx[:, 0], idx[:, 1], :] = 0.0
        else:
            kernel = kernel.masked_fill(a_zero.unsqueeze(-1), 0.0)
    if b_zero is not None:
        if inplace:
            idx = b_zero.nonzero()
            kernel[idx[:, 0], :, idx[:, 1]] = 0.0
        else:
            kernel = kernel.masked_fill(b_zero.unsqueeze(-2), 0.0)
    return kernel


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Runs the block with denormal floats flushed to zero on CPU, then restores the mode.

    Light particles (weights down to 1e-38 in float32) make products in the kernel mat-vecs
    fall below the smallest normal number, and CPU arithmetic on denormals is many times slower:
    flushing them halved the fused ensemble backward (0.86 s to 0.44 s) and cut the forward
    from 1.37 s to 1.06 s on the float32 filter of ``benchmarks/resampling/bench_ot_cost.py``. Zeroing the
    kernel's small entries does not help, since the products of normal numbers underflow. The
    values lost are below 1e-38 (float32) or 1e-308 (float64) of marginals that sum to one.
    PyTorch has no getter for the mode, so it is probed (a product that underflows) and only
    switched off again if it was off; the flag is per thread, so intra-op worker threads keep
    their own (correct either way, only slower).
    """
    # The flag is a CPU setting; probe on the CPU whatever the default device is.
    probe = torch.tensor([1e-20], dtype=torch.float32, device="cpu")  # squared: 1e-40, a float32 denormal
    was_on = bool((probe * probe == 0).item())
    if was_on or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def flushing(fn: Callable) -> Callable:
    """Decorator: runs ``fn`` under :func:`flush_denormals` (the forward and backward of the
    fused autograd functions)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with flush_denormals():
            return fn(*args, **kwargs)

    return wrapper


def zero_mass(log_w: Tensor) -> Tensor:
    """Points whose mass is below the dtype's smallest normal number (denormals carry a few bits
    at best and their reciprocals overflow): the solver treats them as empty."""
    return log_w < math.log(torch.finfo(log_w.dtype).tiny)


def log_domain_update(
    cost: Tensor, f: Tensor, g: Tensor, log_a: Tensor, log_b: Tensor, eps: float, a_zero: Tensor | None, b_zero: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One exact log-domain column then row update; returns ``(f, g, kernel)`` with the new
    potentials absorbed, so the kernel is O(1) at every row's and column's maximum. Potentials of
    zero-mass particles (``a_zero`` / ``b_zero`` masks) are pinned to 0 and their kernel rows and
    columns to 0."""
    g = soft_min(cost, f, log_a, eps, rows=True)
    f = soft_min(cost, g, log_b, eps, rows=False)
    if a_zero is not None:
        f = torch.where(a_zero, torch.zeros_like(f), f)
    if b_zero is not None:
        g = torch.where(b_zero, torch.zeros_like(g), g)
    return f, g, mask_kernel(stabilised_kernel(cost, f, g, eps), a_zero, b_zero)


def complete_zero_mass(
    cost: Tensor, log_a: Tensor, log_b: Tensor, f: Tensor, g: Tensor, eps: float, masks: tuple[Tensor | None, Tensor | None] | None = None
) -> tuple[Tensor, Tensor]:
    r"""Gives points whose mass underflowed to zero their true potentials, the c-transforms
    :math:`g_j = -\epsilon \log \sum_i a_i \exp((f_i - C_{ij}) / \epsilon)` (and the same for ``f``).

    The iterations pin such points' scalings to 1 (their marginals are empty, and 0 * inf would
    turn errors into NaN), which leaves their potentials at whatever was last absorbed. That is
    harmless for the plan while ``b_j`` is exactly zero, but a finite ``log b_j`` below the
    dtype's range (about -104 in float32, -745 in float64) still enters every kernel built in
    log space, :math:`P_{ij} = \exp(\log a_i + \log b_j + (f_i + g_j - C_{ij}) / \epsilon)`: with a stale
    :math:`g_j` that column was off by :math:`\exp((g^{\mathrm{true}}_j - g_j) / \epsilon)`, which in float32 on sharp
    likelihoods reached 1e29 and made the adjoint system indefinite (gradients of 1e13 to 1e21).
    The c-transform is the potential the fixed point extends to those points, so every column
    of the plan then sums to its (underflowing) mass.

    Only the zero-mass columns (rows) are gathered, ``O(K N)`` for ``K`` such points instead of
    a logsumexp over the whole ``(B, N, M)`` cost (which at N=2000 was a third of the forward).
    ``masks``, the solver's ``(a_zero, b_zero)`` (``None`` for a side with no such point; a mask
    given has at least one), saves finding them again.
    """
    if masks is None:
        a_zero, b_zero = (mask if bool(mask.any()) else None for mask in (zero_mass(log_a), zero_mass(log_b)))
    else:
        a_zero, b_zero = masks
    if b_zero is not None:
        *batch, j = b_zero.nonzero(as_tuple=True)
        logits = (f[(*batch,)] - cost[(*batch, slice(None), j)]) / eps + log_a[(*batch,)]
        g = g.index_put((*batch, j), -eps * torch.logsumexp(logits, dim=-1))
    if a_zero is not None:
        *batch, i = a_zero.nonzero(as_tuple=True)
        logits = (g[(*batch,)] - cost[(*batch, i)]) / eps + log_b[(*batch,)]
        f = f.index_put((*batch, i), -eps * torch.logsumexp(logits, dim=-1))
    return f, g
