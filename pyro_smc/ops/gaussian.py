r"""Gaussians in moment and natural form: conversions, products, division, damping, PSD checks.

A Gaussian ``N(x | m, P)`` has natural parameters ``(eta, Lambda) = (P^{-1} m, P^{-1})``; in this
form products of densities add and division subtracts, which is how EP combines and removes
messages. A "message" may be improper (singular ``Lambda``, e.g. a scalar measurement of a
2-d state) but a posterior or cavity used for a projection must be proper (``Lambda`` positive
definite), which :func:`is_proper` tests. See ``docs/math/ep.md#gaussian-densities-in-natural-form``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.gaussian import to_natural, to_moment
    >>> m, P = torch.tensor([1.0, 2.0]), torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    >>> eta, lam = to_natural(m, P)
    >>> m2, P2 = to_moment(eta, lam)
    >>> bool(torch.allclose(m, m2) and torch.allclose(P, P2))
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_psd",
    "damp",
    "divide",
    "is_proper",
    "multiply",
    "psd_repair",
    "symmetrize",
    "to_moment",
    "to_natural",
    "tril_from_vector",
    "tril_to_vector",
]


def symmetrize(m: Tensor) -> Tensor:
    """``(M + M^T) / 2`` over the last two dims."""
    return (m + m.transpose(-1, -2)) / 2


def _cholesky(name: str, matrix: Tensor) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(matrix)
    if bool((info != 0).any()):
        raise ValueError(f"{name} must be positive definite (Cholesky failed)")
    return chol


def to_natural(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    """``(m, P) -> (P^{-1} m, P^{-1})`` by a Cholesky factorisation.

    Args:
        mean: ``(..., d)``.
        cov: positive-definite ``(..., d, d)``.

    Returns:
        ``(eta (..., d), precision (..., d, d))``.
    """
    chol = _cholesky("cov", cov)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
    prec = symmetrize(torch.cholesky_solve(eye, chol))
    return torch.cholesky_solve(mean.unsqueeze(-1), chol).squeeze(-1), prec


def to_moment(eta: Tensor, prec: Tensor) -> tuple[Tensor, Tensor]:
    """``(eta, Lambda) -> (Lambda^{-1} eta, Lambda^{-1})``; ``Lambda`` must be positive definite."""
    chol = _cholesky("prec", prec)
    eye = torch.eye(prec.shape[-1], dtype=prec.dtype, device=prec.device).expand_as(prec)
    cov = symmetrize(torch.cholesky_solve(eye, chol))
    return torch.cholesky_solve(eta.unsqueeze(-1), chol).squeeze(-1), cov


def multiply(*factors: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Product of Gaussian densities in natural form (up to normalisation): parameters add."""
    eta = sum(f[0] for f in factors)
    prec = sum(f[1] for f in factors)
    return eta, prec


def divide(numerator: tuple[Tensor, Tensor], denominator: tuple[Tensor, Tensor], power: float = 1.0) -> tuple[Tensor, Tensor]:
    """``q / q_i^power`` in natural form: parameters subtract (the EP cavity).

    See ``docs/math/ep.md#cavity-and-tilted-distribution`` and ``docs/math/ep.md#power-ep``.
    """
    return numerator[0] - power * denominator[0], numerator[1] - power * denominator[1]


def damp(old: tuple[Tensor, Tensor], new: tuple[Tensor, Tensor], gamma: float) -> tuple[Tensor, Tensor]:
    """``(1 - gamma) old + gamma new`` on the natural parameters; ``gamma = 1`` is no damping.

    See ``docs/math/ep.md#damping``.
    """
    if gamma == 1.0:
        return new
    return (1 - gamma) * old[0] + gamma * new[0], (1 - gamma) * old[1] + gamma * new[1]


def is_proper(prec: Tensor) -> Tensor:
    """Whether each precision matrix is (numerically) positive definite; shape ``prec.shape[:-2]``."""
    _, info = torch.linalg.cholesky_ex(symmetrize(prec))
    return info == 0


def check_psd(name: str, matrix: Tensor, strict: bool = True) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``matrix`` is a symmetric PSD (PD if strict) matrix.

    Args:
        name: argument name for the message.
        matrix: ``(..., d, d)``.
        strict: require positive definite (Cholesky succeeds) rather than semi-definite.
    """
    if matrix.dim() < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"{name} must be a square matrix (..., d, d), got shape {tuple(matrix.shape)}")
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(f"{name} has non-finite entries")
    scale = matrix.detach().abs().amax().clamp_min(1.0)
    if not bool(((matrix - matrix.transpose(-1, -2)).abs() <= 1e-6 * scale).all()):
        raise ValueError(f"{name} must be symmetric")
    if strict:
        if not bool(is_proper(matrix.detach()).all()):
            raise ValueError(f"{name} must be positive definite (its Cholesky factorisation failed)")
    else:
        min_eig = torch.linalg.eigvalsh(symmetrize(matrix.detach())).amin()
        if float(min_eig) < -1e-8 * float(scale):
            raise ValueError(f"{name} must be positive semi-definite (smallest eigenvalue {float(min_eig):.3g})")


def psd_repair(matrix: Tensor, min_eig: float = 0.0) -> Tensor:
    """The nearest symmetric matrix with eigenvalues ``>= min_eig`` (eigenvalue clipping)."""
    vals, vecs = torch.linalg.eigh(symmetrize(matrix))
    return symmetrize((vecs * vals.clamp_min(min_eig).unsqueeze(-2)) @ vecs.transpose(-1, -2))


def tril_from_vector(params: Tensor, size: int) -> Tensor:
    """A lower-triangular factor with positive diagonal from ``size (size + 1) / 2`` free numbers.

    The free numbers fill the lower triangle row by row (``torch.tril_indices`` order), the
    diagonal entries stored as logs, so any real vector maps to a valid Cholesky factor.

    Args:
        params: ``(..., size (size + 1) / 2)``.
        size: the matrix size ``n``.

    Returns:
        ``(..., n, n)`` lower-triangular with positive diagonal.
    """
    if params.dim() == 0 or params.shape[-1] != size * (size + 1) // 2:
        raise ValueError(f"params must have last dim size (size + 1) / 2 = {size * (size + 1) // 2} for size {size}, got shape {tuple(params.shape)}")
    rows, cols = torch.tril_indices(size, size, device=params.device)
    flat = params.new_zeros(params.shape[:-1] + (size * size,))
    raw = flat.scatter(-1, (rows * size + cols).expand(params.shape), params).reshape(params.shape[:-1] + (size, size))
    return raw.tril(-1) + torch.diag_embed(raw.diagonal(dim1=-2, dim2=-1).exp())


def tril_to_vector(scale_tril: Tensor) -> Tensor:
    """The inverse of :func:`tril_from_vector`: ``(..., n, n)`` -> ``(..., n (n + 1) / 2)``."""
    n = scale_tril.shape[-1]
    if not bool((scale_tril.detach().diagonal(dim1=-2, dim2=-1) > 0).all()):
        raise ValueError("scale_tril must have a positive diagonal")
    rows, cols = torch.tril_indices(n, n, device=scale_tril.device)
    raw = scale_tril.tril(-1) + torch.diag_embed(scale_tril.diagonal(dim1=-2, dim2=-1).log())
    return raw[..., rows, cols]
