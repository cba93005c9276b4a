r"""Kronecker-structured products, solves and log-determinants without forming the Kronecker product.

Convention: a matrix ``X`` of shape ``(n, p)`` stands for the vector ``vec(X)``
of length ``n p`` that stacks its *columns* (column-major, Fortran order); in torch
``vec(X) = X.transpose(-1, -2).reshape(..., n * p)``. With this convention, for ``A`` ``(n, n)`` and ``B`` ``(p, p)``,

.. math::

    \operatorname{vec}(A X B) = (B^\top \otimes A) \operatorname{vec}(X),

so the ``np x np`` operator :math:`B^\top \otimes A` is applied in :math:`O(n^2 p + n p^2)` as ``A @ X @ B``.
The Gaussian terms of a covariance :math:`V \otimes U` given by its lower Cholesky factors (the
``kron_tril_*`` helpers) are in :mod:`pyro_smc.ops.kronecker_tril`.

All functions broadcast over leading batch dims and promote mixed float dtypes to a common one (as
torch's elementwise ops do). Pure torch: no Pyro import.
See ``docs/math/kronecker.md#vectorisation-convention`` and ``docs/math/kronecker.md#kronecker-identities``.

Example:
    >>> import torch
    >>> from pyro_smc.ops.kronecker import kron, kron_matvec, vec
    >>> A, B, X = torch.randn(3, 3), torch.randn(2, 2), torch.randn(3, 2)
    >>> dense = kron(B.T, A) @ vec(X)
    >>> bool(torch.allclose(vec(kron_matvec(A, B, X)), dense, atol=1e-5))
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "kron",
    "kron_logdet",
    "kron_matvec",
    "kron_solve",
    "unvec",
    "vec",
]


def vec(x: Tensor) -> Tensor:
    """Column-major vectorisation: ``(..., n, p) -> (..., n * p)``, stacking the columns of ``x``.

    Args:
        x: ``(..., n, p)``.

    Returns:
        ``(..., n * p)``: column 0 of ``x``, then column 1, and so on.

    Raises:
        ValueError: ``x`` has fewer than 2 dims.

    Example:
        >>> vec(torch.tensor([[1, 2], [3, 4]])).tolist()
        [1, 3, 2, 4]
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"vec: x must be a tensor of shape (..., n, p), got {_shape(x)}")
    return x.transpose(-1, -2).reshape(*x.shape[:-2], x.shape[-1] * x.shape[-2])


def unvec(v: Tensor, n: int, p: int) -> Tensor:
    """Inverse of :func:`vec`: ``(..., n * p) -> (..., n, p)``.

    Args:
        v: ``(..., n * p)``, columns stacked.
        n: number of rows.
        p: number of columns.

    Returns:
        ``(..., n, p)`` with ``vec(unvec(v, n, p)) == v``.

    Raises:
        ValueError: ``v``'s last dim is not ``n * p``.

    Example:
        >>> x = torch.arange(6.0).reshape(2, 3)
        >>> bool(torch.equal(unvec(vec(x), 2, 3), x))
        True
    """
    if not isinstance(v, Tensor) or v.dim() < 1 or v.shape[-1] != n * p:
        raise ValueError(f"unvec: v must have shape (..., n * p) = (..., {n * p}) for n = {n}, p = {p}, got {_shape(v)}")
    return v.reshape(*v.shape[:-1], p, n).transpose(-1, -2)


def kron(a: Tensor, b: Tensor) -> Tensor:
    """Batched dense Kronecker product (for tests and small problems).

    Args:
        a: ``(..., m, n)``.
        b: ``(..., k, l)``.

    Returns:
        ``(..., m k, n l)`` with block ``(i, j)`` equal to ``a[..., i, j] * b``; batch dims broadcast
        (unlike :func:`torch.kron`, which takes the product over every dim).

    Raises:
        ValueError: ``a`` or ``b`` has fewer than 2 dims, or their batch dims do not broadcast.

    Example:
        >>> a, b = torch.randn(2, 3), torch.randn(4, 2)
        >>> bool(torch.allclose(kron(a, b), torch.kron(a, b)))
        True
        >>> kron(torch.randn(5, 2, 3), b).shape
        torch.Size([5, 8, 6])
    """
    a, b = _check_batch("kron", (("a", a), ("b", b)), floating=False)
    m, n = a.shape[-2:]
    k, l_ = b.shape[-2:]
    out = a[..., :, None, :, None] * b[..., None, :, None, :]
    return out.reshape(*out.shape[:-4], m * k, n * l_)


def kron_matvec(a: Tensor, b: Tensor, x: Tensor) -> Tensor:
    r""":math:`(B^\top \otimes A) \operatorname{vec}(X)` as the matrix :math:`A X B`.

    Args:
        a: ``(..., n, n)``.
        b: ``(..., p, p)``.
        x: ``(..., n, p)`` representing ``vec(X)`` (column-major).

    Returns:
        ``(..., n, p)``: ``A @ X @ B``, i.e. :math:`\operatorname{vec}^{-1}((B^\top \otimes A) \operatorname{vec}(X))`.

    Raises:
        ValueError: if ``a`` or ``b`` is not square or ``x`` does not match them.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> A, B, X = torch.randn(3, 3), torch.randn(2, 2), torch.randn(3, 2)
        >>> bool(torch.allclose(vec(kron_matvec(A, B, X)), kron(B.T, A) @ vec(X), atol=1e-5))
        True
    """
    a, b, x = _check_kron("kron_matvec", a, b, x)
    return a @ x @ b


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__


def _check_batch(op: str, named: tuple[tuple[str, Tensor], ...], floating: bool = True) -> tuple[Tensor, ...]:
    """Every argument is a tensor of at least 2 dims (floating point unless ``floating=False``)
    and their batch dims broadcast. Returns them promoted to one dtype, as torch's elementwise ops
    would (``linalg.solve`` and ``matmul`` refuse mixed dtypes)."""
    for name, m in named:
        if not isinstance(m, Tensor) or m.dim() < 2:
            raise ValueError(f"{op}: {name} must be a tensor of shape (..., k, l), got {_shape(m)}")
        if floating and not m.is_floating_point():
            raise ValueError(f"{op}: {name} must be floating point, got {m.dtype}")
    try:
        torch.broadcast_shapes(*(m.shape[:-2] for _, m in named))
    except RuntimeError as error:
        names, shapes = ", ".join(name for name, _ in named), ", ".join(str(tuple(m.shape[:-2])) for _, m in named)
        raise ValueError(f"{op}: the batch dims of {names} do not broadcast: {shapes}") from error
    dtype = named[0][1].dtype
    for _, m in named[1:]:
        dtype = torch.promote_types(dtype, m.dtype)
    return tuple(m.to(dtype) for _, m in named)


def _check_kron(op: str, a: Tensor, b: Tensor, x: Tensor | None = None, names: tuple[str, ...] = ("a", "b", "x")) -> tuple[Tensor, ...]:
    named = tuple(zip(names, (a, b) if x is None else (a, b, x)))
    promoted = _check_batch(op, named)
    for name, m in named[:2]:
        if m.shape[-1] != m.shape[-2]:
            raise ValueError(f"{op}: {name} must be square (..., k, k), got shape {tuple(m.shape)}")
    if x is not None and (x.shape[-2] != a.shape[-1] or x.shape[-1] != b.shape[-1]):
        raise ValueError(f"{op}: {names[2]} must have shape (..., {a.shape[-1]}, {b.shape[-1]}) to match {names[0]} and {names[1]}, got {tuple(x.shape)}")
    return promoted


def _check_nonsingular_triangle(op: str, name: str, m: Tensor) -> None:
    # A triangular solve divides by the diagonal; a zero there would return inf/NaN silently.
    if bool((m.detach().diagonal(dim1=-2, dim2=-1) == 0).any()):
        raise ValueError(f"{op}: triangular {name} is singular (a zero on its diagonal)")


def kron_solve(a: Tensor, b: Tensor, y: Tensor, *, tri_a: str | None = None, tri_b: str | None = None) -> Tensor:
    r"""Solves :math:`(B^\top \otimes A) \operatorname{vec}(X) = \operatorname{vec}(Y)`, i.e. :math:`X = A^{-1} Y B^{-1}`.

    Args:
        a: invertible ``(..., n, n)``.
        b: invertible ``(..., p, p)``.
        y: ``(..., n, p)``.
        tri_a: ``"lower"`` or ``"upper"`` if ``a`` is triangular (a triangular solve is used,
            reading only that triangle), ``None`` for a general LU solve.
        tri_b: the same for ``b``.

    Returns:
        ``(..., n, p)``: ``X`` with ``A X B = Y``.

    Raises:
        ValueError: on a bad ``tri_a``/``tri_b``, non-square, mismatched or non-broadcasting
            shapes, a non-floating dtype, or a singular factor (a triangular one with a zero
            on its diagonal, or a general one that LU finds exactly singular).

    Example:
        >>> A = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
        >>> B = torch.tensor([[1.0, 0.5, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 4.0]])
        >>> Y = torch.arange(6.0).reshape(2, 3)
        >>> X = kron_solve(A, B, Y, tri_a="lower", tri_b="upper")
        >>> bool(torch.allclose(A @ X @ B, Y, atol=1e-5))
        True
    """
    return _kron_solve("kron_solve", a, b, y, tri_a, tri_b, ("a", "b", "y"))


def _kron_solve(op: str, a: Tensor, b: Tensor, y: Tensor, tri_a: str | None, tri_b: str | None, names: tuple[str, str, str]) -> Tensor:
    for name, tri in (("tri_a", tri_a), ("tri_b", tri_b)):
        if tri not in (None, "lower", "upper"):
            raise ValueError(f"{name} must be None, 'lower' or 'upper', got {tri!r}")
    a, b, y = _check_kron(op, a, b, y, names)
    for name, m, tri in ((names[0], a, tri_a), (names[1], b, tri_b)):
        if tri is not None:
            _check_nonsingular_triangle(op, name, m)
    try:
        z = torch.linalg.solve(a, y) if tri_a is None else torch.linalg.solve_triangular(a, y, upper=tri_a == "upper")
    except torch.linalg.LinAlgError as error:
        raise ValueError(f"{op}: {names[0]} is singular") from error
    try:
        if tri_b is None:
            return torch.linalg.solve(b, z, left=False)
        return torch.linalg.solve_triangular(b, z, upper=tri_b == "upper", left=False)
    except torch.linalg.LinAlgError as error:
        raise ValueError(f"{op}: {names[1]} is singular") from error


def kron_logdet(a: Tensor, b: Tensor, *, triangular: bool = False) -> Tensor:
    r""":math:`\log |\det(B^\top \otimes A)| = p \log |\det A| + n \log |\det B|`.

    Args:
        a: ``(..., n, n)``.
        b: ``(..., p, p)``.
        triangular: both are triangular, so ``log|det|`` is the sum of ``log|diagonal|``.

    Returns:
        ``(...)``: the log absolute determinant.

    Raises:
        ValueError: if ``a`` or ``b`` is not square or not floating point, or their batch dims do
            not broadcast.

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 3.0]])
        >>> B = torch.diag(torch.tensor([0.5, 2.0, 4.0]))
        >>> dense = torch.linalg.slogdet(kron(B.T, A)).logabsdet
        >>> bool(torch.isclose(kron_logdet(A, B), dense))
        True
    """
    a, b = _check_kron("kron_logdet", a, b)
    return _kron_logdet(a, b, triangular)


def _kron_logdet(a: Tensor, b: Tensor, triangular: bool) -> Tensor:
    n, p = a.shape[-1], b.shape[-1]
    if triangular:
        la = a.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
        lb = b.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
    else:
        la = torch.linalg.slogdet(a).logabsdet
        lb = torch.linalg.slogdet(b).logabsdet
    return p * la + n * lb
