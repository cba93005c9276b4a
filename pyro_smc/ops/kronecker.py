r"""Kronecker-structured products, solves, log-determinants and Gaussian terms without forming ``kron``.

Convention: a matrix ``X`` of shape ``(n, p)`` stands for the vector ``vec(X)``
of length ``n p`` that stacks its *columns* (column-major, Fortran order); in torch
``vec(X) = X.transpose(-1, -2).reshape(..., n * p)``. With this convention

    vec(A X B) = (B^T kron A) vec(X),        A: (n, n),  B: (p, p),

so the ``np x np`` operator ``B^T kron A`` is applied in ``O(n^2 p + n p^2)`` as ``A @ X @ B``.
A matrix normal ``W = M + A E B`` (``E`` i.i.d. standard normal) has
``vec(W) ~ N(vec(M), (B^T B) kron (A A^T))``; in the lower-Cholesky parametrisation used by
:class:`pyro_smc.distributions.MatrixNormal`, ``W = M + L_row E L_col^T`` and
``Cov(vec W) = (L_col L_col^T) kron (L_row L_row^T) = V kron U``. The ``kron_tril_*`` helpers work
in that parametrisation.

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

import math

import torch
from torch import Tensor

_TRIL_NAMES = ("scale_tril_row", "scale_tril_col")

__all__ = [
    "kron",
    "kron_logdet",
    "kron_matvec",
    "kron_solve",
    "kron_tril_entropy",
    "kron_tril_logdet",
    "kron_tril_mahalanobis",
    "kron_tril_trace",
    "kron_tril_variance",
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
        (unlike ``torch.kron``, which takes the product over every dim).

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
    """``(B^T kron A) vec(X)`` as the matrix ``A X B``.

    Args:
        a: ``(..., n, n)``.
        b: ``(..., p, p)``.
        x: ``(..., n, p)`` representing ``vec(X)`` (column-major).

    Returns:
        ``(..., n, p)``: ``A @ X @ B``, i.e. ``unvec((B^T kron A) vec(X))``.

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
    """Solves ``(B^T kron A) vec(X) = vec(Y)``, i.e. ``X = A^{-1} Y B^{-1}``.

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
    """``log|det(B^T kron A)| = p log|det A| + n log|det B|``.

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


def kron_tril_logdet(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    """``log det (V kron U)^{1/2} = p sum log diag L_row + n sum log diag L_col`` (positive diagonals).

    Args:
        scale_tril_row: ``L_row`` ``(..., n, n)``, lower triangular, ``U = L_row L_row^T``.
        scale_tril_col: ``L_col`` ``(..., p, p)``, lower triangular, ``V = L_col L_col^T``.

    Returns:
        ``(...)``: half the log-determinant of the ``np x np`` covariance.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0, 0.0], [0.2, 0.5, 0.0], [0.1, 0.4, 1.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> bool(torch.isclose(kron_tril_logdet(L_row, L_col), 0.5 * torch.logdet(cov), atol=1e-5))
        True
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_logdet", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    return _kron_logdet(scale_tril_row, scale_tril_col, True)


def kron_tril_mahalanobis(scale_tril_row: Tensor, scale_tril_col: Tensor, x: Tensor) -> Tensor:
    """``vec(X)^T (V kron U)^{-1} vec(X) = ||L_row^{-1} X L_col^{-T}||_F^2`` by two triangular solves.

    Args:
        scale_tril_row: ``(..., n, n)`` lower triangular.
        scale_tril_col: ``(..., p, p)`` lower triangular.
        x: ``(..., n, p)``.

    Returns:
        ``(...)``: the squared Mahalanobis norm.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0], [0.2, 0.5]])
        >>> X = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> dense = vec(X) @ torch.linalg.solve(cov, vec(X))
        >>> bool(torch.isclose(kron_tril_mahalanobis(L_row, L_col, X), dense, rtol=1e-4))
        True
    """
    names = (*_TRIL_NAMES, "x")
    z = _kron_solve("kron_tril_mahalanobis", scale_tril_row, scale_tril_col.transpose(-1, -2), x, "lower", "upper", names)
    return z.pow(2).sum((-1, -2))


def kron_tril_trace(scale_tril_row_p: Tensor, scale_tril_col_p: Tensor, scale_tril_row_q: Tensor, scale_tril_col_q: Tensor) -> Tensor:
    """``tr((V_p kron U_p)^{-1} (V_q kron U_q)) = ||L_row_p^{-1} L_row_q||_F^2 ||L_col_p^{-1} L_col_q||_F^2``.

    See ``docs/math/kronecker.md#kronecker-identities`` and ``docs/math/kronecker.md#kl-divergences``.

    Args:
        scale_tril_row_p: ``(..., n, n)`` lower triangular (the inverted covariance's row factor).
        scale_tril_col_p: ``(..., p, p)`` lower triangular.
        scale_tril_row_q: ``(..., n, n)`` lower triangular.
        scale_tril_col_q: ``(..., p, p)`` lower triangular.

    Returns:
        ``(...)``: the trace.

    Raises:
        ValueError: non-square or mismatched factors, or a ``p`` factor with a zero on its diagonal.

    Example:
        >>> Lr_p, Lc_p = torch.tensor([[2.0, 0.0], [0.3, 1.0]]), torch.tensor([[1.5]])
        >>> Lr_q, Lc_q = torch.tensor([[1.0, 0.0], [0.5, 0.7]]), torch.tensor([[0.5]])
        >>> cov_p = torch.kron(Lc_p @ Lc_p.T, Lr_p @ Lr_p.T)
        >>> cov_q = torch.kron(Lc_q @ Lc_q.T, Lr_q @ Lr_q.T)
        >>> dense = torch.trace(torch.linalg.solve(cov_p, cov_q))
        >>> bool(torch.isclose(kron_tril_trace(Lr_p, Lc_p, Lr_q, Lc_q), dense, rtol=1e-4))
        True
    """
    op = "kron_tril_trace"
    named = (("scale_tril_row_p", scale_tril_row_p), ("scale_tril_col_p", scale_tril_col_p))
    named += (("scale_tril_row_q", scale_tril_row_q), ("scale_tril_col_q", scale_tril_col_q))
    scale_tril_row_p, scale_tril_col_p, scale_tril_row_q, scale_tril_col_q = _check_batch(op, named)
    for name, m in named:
        if m.shape[-1] != m.shape[-2]:
            raise ValueError(f"{op}: {name} must be square (..., k, k), got shape {tuple(m.shape)}")
    for (name_p, p_), (name_q, q_) in ((named[0], named[2]), (named[1], named[3])):
        if q_.shape[-1] != p_.shape[-1]:
            raise ValueError(f"{op}: {name_q} must have the size {p_.shape[-1]} of {name_p}, got shape {tuple(q_.shape)}")
        _check_nonsingular_triangle(op, name_p, p_)
    tr_u = torch.linalg.solve_triangular(scale_tril_row_p, scale_tril_row_q, upper=False).pow(2).sum((-1, -2))
    tr_v = torch.linalg.solve_triangular(scale_tril_col_p, scale_tril_col_q, upper=False).pow(2).sum((-1, -2))
    return tr_u * tr_v


def kron_tril_variance(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    """The diagonal of ``V kron U`` as an ``(n, p)`` matrix: ``diag(U) diag(V)^T``.

    Args:
        scale_tril_row: ``(..., n, n)``.
        scale_tril_col: ``(..., p, p)``.

    Returns:
        ``(..., n, p)``: ``Var(W_ij) = U_ii V_jj``.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0, 0.0], [0.2, 0.5, 0.0], [0.1, 0.4, 1.0]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> var = kron_tril_variance(L_row, L_col)
        >>> var.shape, bool(torch.allclose(vec(var), cov.diagonal()))
        (torch.Size([2, 3]), True)
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_variance", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    u = scale_tril_row.pow(2).sum(-1)
    v = scale_tril_col.pow(2).sum(-1)
    return u.unsqueeze(-1) * v.unsqueeze(-2)


def kron_tril_entropy(scale_tril_row: Tensor, scale_tril_col: Tensor) -> Tensor:
    """Entropy of ``N(M, V kron U)``: ``np/2 (1 + log 2 pi) + p sum log diag L_row + n sum log diag L_col``.

    See ``docs/math/kronecker.md#matrix-normal-distribution``.

    Args:
        scale_tril_row: ``(..., n, n)`` lower triangular with positive diagonal.
        scale_tril_col: ``(..., p, p)`` lower triangular with positive diagonal.

    Returns:
        ``(...)``: the differential entropy in nats.

    Example:
        >>> L_row = torch.tensor([[2.0, 0.0], [0.3, 1.0]])
        >>> L_col = torch.tensor([[1.5, 0.0], [0.2, 0.5]])
        >>> cov = torch.kron(L_col @ L_col.T, L_row @ L_row.T)
        >>> dense = torch.distributions.MultivariateNormal(torch.zeros(4), cov).entropy()
        >>> bool(torch.isclose(kron_tril_entropy(L_row, L_col), dense, atol=1e-5))
        True
    """
    scale_tril_row, scale_tril_col = _check_kron("kron_tril_entropy", scale_tril_row, scale_tril_col, names=_TRIL_NAMES)
    n, p = scale_tril_row.shape[-1], scale_tril_col.shape[-1]
    return 0.5 * n * p * (1.0 + math.log(2 * math.pi)) + _kron_logdet(scale_tril_row, scale_tril_col, True)
