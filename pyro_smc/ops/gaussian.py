r"""Gaussians in moment and natural form: conversions, products, division, damping, PSD checks.

A Gaussian :math:`\mathcal N(x \mid m, P)` has natural parameters :math:`(\eta, \Lambda) = (P^{-1} m, P^{-1})`; in this
form products of densities add and division subtracts, which is how EP combines and removes
messages. A "message" may be improper (singular :math:`\Lambda`, e.g. a scalar measurement of a
2-d state) but a posterior or cavity used for a projection must be proper (:math:`\Lambda` positive
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
    "NotPositiveDefiniteError",
    "check_finite_steps",
    "check_psd",
    "damp",
    "divide",
    "is_proper",
    "moment_change",
    "moment_change_floor",
    "multiply",
    "psd_repair",
    "symmetrize",
    "to_moment",
    "to_natural",
    "tril_from_vector",
    "tril_to_vector",
]


def symmetrize(m: Tensor) -> Tensor:
    r""":math:`(M + M^\top) / 2` over the last two dims.

    Args:
        m: ``(..., d, d)``.

    Returns:
        ``(..., d, d)``: the symmetric part of ``m``.

    Example:
        >>> symmetrize(torch.tensor([[1.0, 2.0], [0.0, 1.0]])).tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    return (m + m.transpose(-1, -2)) / 2


class NotPositiveDefiniteError(ValueError):
    """A matrix that must be positive definite is not (its Cholesky factorisation failed): what
    :func:`to_natural` and :func:`to_moment` raise, so that an engine can catch exactly this and
    say at which step and in which update it happened.

    Example:
        >>> try:
        ...     to_natural(torch.zeros(1), -torch.eye(1))
        ... except NotPositiveDefiniteError as error:
        ...     print(error)
        cov must be positive definite (Cholesky failed)
    """


def _cholesky(name: str, matrix: Tensor) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(matrix)
    if bool((info != 0).any()):
        finite = bool(torch.isfinite(matrix).all())
        raise NotPositiveDefiniteError(f"{name} must be positive definite (Cholesky failed{'' if finite else '; it has non-finite entries'})")
    return chol


def check_finite_steps(where: str, quantities: dict[str, Tensor], hint: str = "") -> None:
    """Raises ``ValueError`` naming the first time step at which a quantity is not finite.

    One host synchronisation when everything is finite; locating the step costs more, but only on
    the way to the error.

    Args:
        where: the engine, the start of the message.
        quantities: ``{name: (T, ...)}`` tensors indexed by time step along dim 0.
        hint: what to check, appended to the message.

    Returns:
        ``None``.

    Raises:
        ValueError: ``"{where}: the {name} at time step {t} is not finite (NaN|inf); {hint}"``, for
            the earliest such step (every quantity bad there is named).

    Example:
        >>> means = torch.tensor([[0.0], [1.0], [float("nan")]])
        >>> check_finite_steps("filter", {"means": means[:2]})
        >>> check_finite_steps(
        ...     "filter",
        ...     {"means": means, "covariances": torch.ones(3, 1, 1)},
        ...     "check the model",
        ... )
        Traceback (most recent call last):
            ...
        ValueError: filter: the means at time step 2 is not finite (NaN); check the model
    """
    values = [q for q in quantities.values() if q.numel()]
    if not values or bool(torch.stack([torch.isfinite(q).all() for q in values]).all()):
        return
    first = {}
    for name, q in quantities.items():
        bad = ~torch.isfinite(q.detach()).reshape(q.shape[0], -1).all(-1)
        if bool(bad.any()):
            first[name] = int(bad.nonzero()[0, 0])
    t = min(first.values())
    names = [name for name, step in first.items() if step == t]
    kind = "NaN" if any(bool(torch.isnan(quantities[name][t]).any()) for name in names) else "inf"
    verb = "is" if len(names) == 1 else "are"
    raise ValueError(f"{where}: the {' and the '.join(names)} at time step {t} {verb} not finite ({kind})" + (f"; {hint}" if hint else ""))


def to_natural(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`(m, P) \mapsto (P^{-1} m, P^{-1})` by a Cholesky factorisation.

    Args:
        mean: ``(..., d)``.
        cov: positive-definite ``(..., d, d)``.

    Returns:
        ``(eta (..., d), precision (..., d, d))``.

    Raises:
        ValueError: if ``cov`` is not positive definite.

    Example:
        >>> eta, prec = to_natural(
        ...     torch.tensor([1.0, 2.0]), torch.diag(torch.tensor([2.0, 4.0]))
        ... )
        >>> [round(v, 4) for v in eta.tolist() + prec.diagonal().tolist()]
        [0.5, 0.5, 0.5, 0.25]
    """
    chol = _cholesky("cov", cov)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
    prec = symmetrize(torch.cholesky_solve(eye, chol))
    return torch.cholesky_solve(mean.unsqueeze(-1), chol).squeeze(-1), prec


def to_moment(eta: Tensor, prec: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`(\eta, \Lambda) \mapsto (\Lambda^{-1} \eta, \Lambda^{-1})`; :math:`\Lambda` must be positive definite.

    Args:
        eta: ``(..., d)``.
        prec: positive-definite precision ``(..., d, d)``.

    Returns:
        ``(mean (..., d), cov (..., d, d))``.

    Raises:
        ValueError: if ``prec`` is not positive definite.

    Example:
        >>> mean, cov = to_moment(
        ...     torch.tensor([0.5, 0.5]), torch.diag(torch.tensor([0.5, 0.25]))
        ... )
        >>> [round(v, 4) for v in mean.tolist() + cov.diagonal().tolist()]
        [1.0, 2.0, 2.0, 4.0]
    """
    chol = _cholesky("prec", prec)
    eye = torch.eye(prec.shape[-1], dtype=prec.dtype, device=prec.device).expand_as(prec)
    cov = symmetrize(torch.cholesky_solve(eye, chol))
    return torch.cholesky_solve(eta.unsqueeze(-1), chol).squeeze(-1), cov


def multiply(*factors: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Product of Gaussian densities in natural form (up to normalisation): parameters add.

    Args:
        *factors: ``(eta (..., d), prec (..., d, d))`` pairs; batch dims broadcast.

    Returns:
        ``(eta, prec)`` of the product, shapes ``(..., d)`` and ``(..., d, d)``.

    Example:
        >>> a = (torch.tensor([1.0]), torch.tensor([[1.0]]))
        >>> b = (torch.tensor([3.0]), torch.tensor([[2.0]]))
        >>> mean, var = to_moment(*multiply(a, b))  # N(1, 1) N(1.5, 0.5)
        >>> round(float(mean), 4), round(float(var), 4)
        (1.3333, 0.3333)
    """
    eta = sum(f[0] for f in factors)
    prec = sum(f[1] for f in factors)
    return eta, prec


def divide(numerator: tuple[Tensor, Tensor], denominator: tuple[Tensor, Tensor], power: float = 1.0) -> tuple[Tensor, Tensor]:
    r""":math:`q / q_i^{\mathrm{power}}` in natural form: parameters subtract (the EP cavity).

    See ``docs/math/ep.md#cavity-and-tilted-distribution`` and ``docs/math/ep.md#power-ep``.

    Args:
        numerator: ``(eta (..., d), prec (..., d, d))``.
        denominator: ``(eta (..., d), prec (..., d, d))``.
        power: the exponent of the denominator (``1`` for plain EP).

    Returns:
        ``(eta, prec)`` of the quotient, possibly improper (check with :func:`is_proper`).

    Example:
        >>> q = (torch.tensor([4.0]), torch.tensor([[3.0]]))
        >>> site = (torch.tensor([3.0]), torch.tensor([[2.0]]))
        >>> eta, prec = divide(q, site)
        >>> eta.tolist(), prec.tolist()
        ([1.0], [[1.0]])
    """
    return numerator[0] - power * denominator[0], numerator[1] - power * denominator[1]


def damp(old: tuple[Tensor, Tensor], new: tuple[Tensor, Tensor], gamma: float) -> tuple[Tensor, Tensor]:
    r""":math:`(1 - \gamma) \, \mathrm{old} + \gamma \, \mathrm{new}` on the natural parameters; :math:`\gamma = 1` is no damping.

    See ``docs/math/ep.md#damping``.

    Args:
        old: ``(eta (..., d), prec (..., d, d))``.
        new: ``(eta (..., d), prec (..., d, d))``.
        gamma: step size in ``(0, 1]``.

    Returns:
        ``(eta, prec)``, the convex combination; ``new`` itself when ``gamma == 1``.

    Example:
        >>> old = (torch.tensor([0.0]), torch.tensor([[1.0]]))
        >>> new = (torch.tensor([2.0]), torch.tensor([[3.0]]))
        >>> eta, prec = damp(old, new, 0.5)
        >>> eta.tolist(), prec.tolist()
        ([1.0], [[2.0]])
    """
    if gamma == 1.0:
        return new
    return (1 - gamma) * old[0] + gamma * new[0], (1 - gamma) * old[1] + gamma * new[1]


def moment_change(means: Tensor, covs: Tensor, previous_means: Tensor, previous_covs: Tensor) -> float:
    r"""The largest change between two sets of Gaussian marginals, in units of their spread.

    :math:`\max(|\Delta m_i| / s_i, |\Delta P_{ij}| / (s_i s_j))` over all marginals and entries,
    with :math:`s_i = \sqrt{P_{ii}}` of the new marginals: a convergence test on it reads the same in
    any units of the state (an absolute change of ``1e-6`` is no change at all when the state is
    measured in metres and its spread in micrometres). Detached; a non-positive variance counts
    as a spread of the dtype's smallest normal number.

    Args:
        means, previous_means: ``(..., d)``.
        covs, previous_covs: ``(..., d, d)``.

    Example:
        >>> m, P = torch.zeros(3, 1), 1e-12 * torch.ones(3, 1, 1)    # spread 1e-6
        >>> round(moment_change(m + 1e-7, P, m, P), 6)  # a tenth of a standard deviation
        0.1
    """
    means, covs = means.detach(), covs.detach()
    sd = torch.diagonal(covs, dim1=-2, dim2=-1).clamp_min(torch.finfo(covs.dtype).tiny).sqrt()
    mean_change = ((means - previous_means.detach()).abs() / sd).max()
    cov_change = ((covs - previous_covs.detach()).abs() / (sd.unsqueeze(-1) * sd.unsqueeze(-2))).max()
    return float(torch.maximum(mean_change, cov_change))


def moment_change_floor(dtype: torch.dtype) -> float:
    """The smallest :func:`moment_change` that rounding lets a stopping rule resolve: 100 machine
    epsilons of ``dtype`` (1.2e-5 in float32, 2.2e-14 in float64). In float32 the sweeps of a
    converged EP run still change its marginals by 5e-7 to 2.4e-6 of their spread (a
    measured floor, tiny-noise models conditioned at 1e6); a tolerance below it would never be met.

    Example:
        >>> moment_change_floor(torch.float32) > 1e-6 > moment_change_floor(torch.float64)
        True
    """
    return 100 * torch.finfo(dtype).eps


def is_proper(prec: Tensor) -> Tensor:
    """Whether each precision matrix is (numerically) positive definite.

    Args:
        prec: ``(..., d, d)``; its symmetric part is tested.

    Returns:
        bool ``(...)``: ``True`` where the Cholesky factorisation succeeds.

    Example:
        >>> is_proper(
        ...     torch.stack([torch.eye(2), torch.diag(torch.tensor([1.0, 0.0]))])
        ... ).tolist()
        [True, False]
    """
    _, info = torch.linalg.cholesky_ex(symmetrize(prec))
    return info == 0


def check_psd(name: str, matrix: Tensor, strict: bool = True) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``matrix`` is a symmetric PSD (PD if strict) matrix.

    Args:
        name: argument name for the message.
        matrix: ``(..., d, d)``.
        strict: require positive definite (Cholesky succeeds) rather than semi-definite.

    Returns:
        ``None``.

    Raises:
        ValueError: if ``matrix`` is not square, has non-finite entries, is not symmetric, or is not
            positive (semi-)definite.

    Example:
        >>> check_psd("Q", torch.diag(torch.tensor([1.0, 0.0])), strict=False)
        >>> check_psd("Q", torch.diag(torch.tensor([1.0, 0.0])))
        Traceback (most recent call last):
            ...
        ValueError: Q must be positive definite (its Cholesky factorisation failed)
    """
    if matrix.dim() < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"{name} must be a square matrix (..., d, d), got shape {tuple(matrix.shape)}")
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(f"{name} has non-finite entries")
    # Relative to each matrix's own size: a floor of 1 made any covariance of entries below 1e-6
    # pass as symmetric (Q = [[1e-6, 9e-7], [0, 1e-6]] was accepted, and read neither as its
    # lower triangle nor as its symmetric part).
    detached = matrix.detach()
    scale = detached.abs().amax((-2, -1), keepdim=True)
    if not bool(((detached - detached.transpose(-1, -2)).abs() <= 1e-6 * scale).all()):
        raise ValueError(f"{name} must be symmetric")
    scale = scale.amax()
    if strict:
        if not bool(is_proper(matrix.detach()).all()):
            raise ValueError(f"{name} must be positive definite (its Cholesky factorisation failed)")
    else:
        min_eig = torch.linalg.eigvalsh(symmetrize(matrix.detach())).amin()
        if float(min_eig) < -1e-8 * float(scale):
            raise ValueError(f"{name} must be positive semi-definite (smallest eigenvalue {float(min_eig):.3g})")


def psd_repair(matrix: Tensor, min_eig: float = 0.0) -> Tensor:
    """The nearest symmetric matrix with eigenvalues ``>= min_eig`` (eigenvalue clipping).

    Args:
        matrix: ``(..., d, d)``; its symmetric part is repaired.
        min_eig: the smallest eigenvalue allowed.

    Returns:
        ``(..., d, d)`` symmetric, eigenvalues ``>= min_eig``.

    Example:
        >>> # eigenvalues 3, -1
        >>> fixed = psd_repair(torch.tensor([[1.0, 2.0], [2.0, 1.0]]), min_eig=0.1)
        >>> [round(v, 4) for v in torch.linalg.eigvalsh(fixed).tolist()]
        [0.1, 3.0]
    """
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

    Raises:
        ValueError: if the last dim of ``params`` is not ``size (size + 1) / 2``.

    Example:
        >>> tril_from_vector(torch.tensor([0.0, 2.0, 0.0]), 2).tolist()
        [[1.0, 0.0], [2.0, 1.0]]
    """
    if params.dim() == 0 or params.shape[-1] != size * (size + 1) // 2:
        raise ValueError(f"params must have last dim size (size + 1) / 2 = {size * (size + 1) // 2} for size {size}, got shape {tuple(params.shape)}")
    rows, cols = torch.tril_indices(size, size, device=params.device)
    flat = params.new_zeros(params.shape[:-1] + (size * size,))
    raw = flat.scatter(-1, (rows * size + cols).expand(params.shape), params).reshape(params.shape[:-1] + (size, size))
    return raw.tril(-1) + torch.diag_embed(raw.diagonal(dim1=-2, dim2=-1).exp())


def tril_to_vector(scale_tril: Tensor) -> Tensor:
    """The inverse of :func:`tril_from_vector`: ``(..., n, n)`` -> ``(..., n (n + 1) / 2)``.

    Args:
        scale_tril: ``(..., n, n)`` lower triangular with positive diagonal.

    Returns:
        ``(..., n (n + 1) / 2)``: the lower triangle row by row, logs on the diagonal.

    Raises:
        ValueError: if a diagonal entry is not positive.

    Example:
        >>> tril_to_vector(torch.tensor([[1.0, 0.0], [2.0, 1.0]])).tolist()
        [0.0, 2.0, 0.0]
    """
    n = scale_tril.shape[-1]
    if not bool((scale_tril.detach().diagonal(dim1=-2, dim2=-1) > 0).all()):
        raise ValueError("scale_tril must have a positive diagonal")
    rows, cols = torch.tril_indices(n, n, device=scale_tril.device)
    raw = scale_tril.tril(-1) + torch.diag_embed(scale_tril.diagonal(dim1=-2, dim2=-1).log())
    return raw[..., rows, cols]
