r"""Filtering and smoothing of a time-varying affine linear-Gaussian chain by parallel scans.

The model, for :math:`t = 0, \dots, T-1` (0-based):

.. math::

    & x_0 \sim \mathcal N(m_0, P_0), \quad x_{t+1} = F_t x_t + c_t + w_t, \quad w_t \sim \mathcal N(0, Q_t), \\
    & r_t = H_t x_t + v_t, \quad v_t \sim \mathcal N(0, R_t),

with the entries of ``r_t`` where ``observed[t]`` is false missing. As in
:func:`pyro_smc.ops.kalman.masked_update`, a missing entry gets a zero row of ``H_t``, residual 0
and unit noise uncorrelated with the rest, so shapes stay fixed and every step batches.

:func:`affine_chain_smoother` runs either a plain loop (``parallel=False``) or two associative
scans of depth :math:`O(\log T)` (Särkkä & García-Fernández, 2021, IEEE TAC 66(1)).

**Filter.** Element :math:`t` is the pair :math:`p(x_t \mid x_{t-1}, r_t) = \mathcal N(A x_{t-1} + b, C)` and the
likelihood of :math:`x_{t-1}` given :math:`r_t`, :math:`\exp(-x^\top J x / 2 + \eta^\top x)`. With
:math:`S = H Q H^\top + R` and :math:`K = Q H^\top S^{-1}` (all at :math:`t`, :math:`F, c, Q` at :math:`t-1`):

.. math::

    & A = (I - K H) F, \quad b = c + K (r - H c), \quad C = (I - K H) Q, \\
    & \eta = F^\top H^\top S^{-1} (r - H c), \quad J = F^\top H^\top S^{-1} H F,

and element 0 is the filtered posterior at :math:`t = 0` itself (:math:`A = 0, \eta = 0, J = 0`).
Two elements :math:`i` (earlier) and :math:`j` (later) combine, by marginalising the middle state, into

.. math::

    \begin{aligned}
    A_{ij} &= A_j M^{-1} A_i, & b_{ij} &= A_j M^{-1} (b_i + C_i \eta_j) + b_j, \\
    C_{ij} &= A_j M^{-1} C_i A_j^\top + C_j, & \eta_{ij} &= A_i^\top M^{-\top} (\eta_j - J_j b_i) + \eta_i, \\
    J_{ij} &= A_i^\top M^{-\top} J_j A_i + J_i, & M &= I + C_i J_j,
    \end{aligned}

so the inclusive prefix ending at :math:`t` has :math:`A = 0` and :math:`(b, C)` = the filtered moments at :math:`t`.

**Smoother.** Element :math:`t < T-1` is the backward kernel :math:`p(x_t \mid x_{t+1}, r_{0:t}) =
\mathcal N(E x_{t+1} + g, L)` with :math:`E = P_t F_t^\top (P^-_{t+1})^{-1}`, :math:`g = m_t - E m^-_{t+1}`,
:math:`L = P_t - E F_t P_t` (filtered ``m, P``, predicted ``m^-, P^-``); the last is
:math:`(0, m_{T-1}, P_{T-1})`. Composing the affine maps, ``(E, g, L)`` at ``t`` then suffix ``s``
gives :math:`(E_t E_s, E_t g_s + g_t, E_t L_s E_t^\top + L_t)`; a reverse scan leaves the smoothed
moments in ``(g, L)``. Log-evidence increments are :math:`\log \mathcal N(r_t; H_t m^-_t, H_t P^-_t H_t^\top + R_t)`
over the observed entries, batched over ``t`` from the predicted moments.

Example:
    >>> import torch
    >>> from pyro_smc.ops.affine_chain import affine_chain_smoother
    >>> T, d, e = 6, 2, 1
    >>> eye = torch.eye(d, dtype=torch.float64)
    >>> F, Q = (0.9 * eye).expand(T - 1, d, d), (0.1 * eye).expand(T - 1, d, d)
    >>> c, H = (
    ...     torch.zeros(T - 1, d, dtype=torch.float64),
    ...     torch.ones(T, e, d, dtype=torch.float64),
    ... )
    >>> r, R = (
    ...     torch.ones(T, e, dtype=torch.float64),
    ...     torch.ones(T, e, e, dtype=torch.float64),
    ... )
    >>> par = affine_chain_smoother(
    ...     torch.zeros(d, dtype=torch.float64), eye, F, c, Q, H, r, R
    ... )
    >>> seq = affine_chain_smoother(
    ...     torch.zeros(d, dtype=torch.float64), eye, F, c, Q, H, r, R, parallel=False
    ... )
    >>> bool(torch.allclose(par.means, seq.means)), par.log_evidence_increments.shape
    (True, torch.Size([6]))
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from pyro_smc.ops.gaussian import NotPositiveDefiniteError, symmetrize
from pyro_smc.ops.kalman import mask_missing, masked_update, predict, smooth_step, update

__all__ = ["AffineChainResult", "affine_chain_smoother", "associative_scan", "compose_backward_kernels"]

Elems = tuple[Tensor, ...]


class AffineChainResult(NamedTuple):
    r"""Marginals of :func:`affine_chain_smoother`; ``T`` steps, state dimension ``d``.

    Attributes:
        predicted_means: ``(T, d)`` of :math:`p(x_t \mid r_{<t})`; index 0 is the prior ``m_0``.
        predicted_covariances: ``(T, d, d)``; index 0 is ``P_0``.
        filtering_means: ``(T, d)`` of :math:`p(x_t \mid r_{\le t})`.
        filtering_covariances: ``(T, d, d)``.
        means: ``(T, d)`` of :math:`p(x_t \mid r_{0:T-1})`.
        covariances: ``(T, d, d)``.
        log_evidence_increments: ``(T,)`` :math:`\log p(r_t \mid r_{<t})` over the observed entries;
            exactly 0 at a step with nothing observed.

    Example:
        >>> import torch
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> out = affine_chain_smoother(
        ...     torch.zeros(1, dtype=torch.float64),
        ...     eye,
        ...     eye.expand(2, 1, 1),
        ...     torch.zeros(2, 1, dtype=torch.float64),
        ...     eye.expand(2, 1, 1),
        ...     eye.expand(3, 1, 1),
        ...     torch.ones(3, 1, dtype=torch.float64),
        ...     eye.expand(3, 1, 1),
        ... )
        >>> # the prior, then given r_0 = 1
        >>> out.predicted_means[0].item(), round(out.filtering_means[0].item(), 6)
        (0.0, 0.5)
    """

    predicted_means: Tensor
    predicted_covariances: Tensor
    filtering_means: Tensor
    filtering_covariances: Tensor
    means: Tensor
    covariances: Tensor
    log_evidence_increments: Tensor


def associative_scan(combine: Callable[[Elems, Elems], Elems], elems: Sequence[Tensor], reverse: bool = False) -> Elems:
    """Inclusive scan of an associative ``combine`` over the leading dim, in ``O(log T)`` depth.

    Args:
        combine: ``combine(a, b)`` takes two tuples of tensors with equal leading (batch) dim,
            ``a`` before ``b`` in scan order, and returns their combination as a tuple.
        elems: tensors with a common leading dim ``T >= 1``.
        reverse: scan from the end: the same as flipping ``elems``, scanning and flipping back, so
            ``out[t] = combine(...combine(elems[T-1], elems[T-2])..., elems[t])``.

    Returns:
        Tuple of tensors shaped like ``elems``: ``out[t] = elems[0] * ... * elems[t]``.

    Raises:
        ValueError: if ``elems`` is empty or the leading dims differ or are 0.

    Example:
        >>> x = torch.arange(1.0, 6.0)
        >>> associative_scan(lambda a, b: (a[0] + b[0],), (x,))[0].tolist()
        [1.0, 3.0, 6.0, 10.0, 15.0]
        >>> associative_scan(lambda a, b: (a[0] + b[0],), (x,), reverse=True)[0].tolist()
        [15.0, 14.0, 12.0, 9.0, 5.0]
    """
    elems = tuple(elems)
    if not elems or any(e.dim() == 0 or e.shape[0] != elems[0].shape[0] for e in elems) or elems[0].shape[0] == 0:
        raise ValueError("elems must be a non-empty tuple of tensors with one common, non-zero leading dim")
    if not reverse:
        return _scan(combine, elems)
    return tuple(e.flip(0) for e in _scan(combine, tuple(e.flip(0) for e in elems)))


def _scan(combine: Callable[[Elems, Elems], Elems], elems: Elems) -> Elems:
    n = elems[0].shape[0]
    if n < 2:
        return elems
    # Pair neighbours, scan the half-length sequence (prefixes ending at odd positions), then one
    # more combine fills in the even positions: O(n) work, recursion depth log2(n).
    odd = _scan(combine, combine(tuple(e[0 : n - 1 : 2] for e in elems), tuple(e[1::2] for e in elems)))
    rest = tuple(e[2::2] for e in elems)
    if rest[0].shape[0] > 0:
        rest = combine(odd if n % 2 else tuple(o[:-1] for o in odd), rest)
    return tuple(_interleave(torch.cat([e[:1], ev]), od) for e, ev, od in zip(elems, rest, odd))


def _interleave(even: Tensor, odd: Tensor) -> Tensor:
    k = odd.shape[0]
    paired = torch.stack([even[:k], odd], 1).reshape(2 * k, *odd.shape[1:])
    return torch.cat([paired, even[k:]])  # an odd length leaves one even element at the end


def _mv(matrix: Tensor, vector: Tensor) -> Tensor:
    return (matrix @ vector.unsqueeze(-1)).squeeze(-1)


# Inside the scans an element is one packed tensor, (n, d, 3d+2) = [A | b | C | eta | J] for the
# filter and (n, d, 2d+1) = [E | g | L] for the smoother, and products are fused into few bmm
# calls: at small d the cost is the number of torch calls, not the flops.
def _filter_combine(a: Elems, b: Elems) -> Elems:
    (P1,), (P2,) = a, b
    d = P1.shape[-2]
    A1, b1, C1, e1, J1 = P1.split([d, 1, d, 1, d], -1)
    A2, b2, C2, e2, J2 = P2.split([d, 1, d, 1, d], -1)
    # One LU of N = I + J_j C_i = M^T serves every solve: A_j M^{-1} = (N^{-1} A_j^T)^T.
    N = torch.baddbmm(torch.eye(d, dtype=P1.dtype, device=P1.device), J2, C1)
    JA, Jb = torch.bmm(J2, P1[..., : d + 1]).split([d, 1], -1)
    sol = torch.linalg.solve(N, torch.cat([A2.mT, e2 - Jb, JA], -1))
    CA, Ce = torch.bmm(C1, torch.cat([A2.mT, e2], -1)).split([d, 1], -1)
    XA, Xb, XCA = torch.bmm(sol[..., :d].mT, torch.cat([A1, b1 + Ce, CA], -1)).split([d, 1, d], -1)
    Ay, AZ = torch.bmm(A1.mT, sol[..., d:]).split([1, d], -1)
    return (torch.cat([XA, Xb + b2, symmetrize(XCA) + C2, Ay + e1, symmetrize(AZ) + J1], -1),)


def _smooth_combine(later: Elems, earlier: Elems) -> Elems:
    (P1,), (P2,) = later, earlier
    d = P1.shape[-2]
    E2, g2, L2 = P2.split([d, 1, d], -1)
    EE, Eg, EL = torch.bmm(E2, P1).split([d, 1, d], -1)
    return (torch.cat([EE, Eg + g2, symmetrize(torch.bmm(EL, E2.mT)) + L2], -1),)


def _filter_elements(F: Tensor, c: Tensor, Q: Tensor, H: Tensor, r: Tensor, R: Tensor) -> Tensor:
    HQ, HF = H @ Q, H @ F
    resid = (r - _mv(H, c)).unsqueeze(-1)
    # S^{-1} [H Q, H F, r - H c] by one Cholesky solve; S^{-1} H Q is K^T.
    chol = torch.linalg.cholesky(symmetrize(HQ @ H.mT + R))
    Kt, SHF, Sres = torch.cholesky_solve(torch.cat([HQ, HF, resid], -1), chol).split([F.shape[-1]] * 2 + [1], -1)
    A, b = F - Kt.mT @ HF, c.unsqueeze(-1) + Kt.mT @ resid
    return torch.cat([A, b, symmetrize(Q - Kt.mT @ HQ), HF.mT @ Sres, symmetrize(HF.mT @ SHF)], -1)


def _parallel(m0: Tensor, P0: Tensor, F: Tensor, c: Tensor, Q: Tensor, H: Tensor, r: Tensor, R: Tensor, observed: Tensor | None) -> AffineChainResult:
    Hm, rm, Rm = (H, r, R) if observed is None else mask_missing(H, r, R, observed)
    m, P, _ = update(m0, P0, rm[0], Hm[0], Rm[0])
    zero = P.new_zeros(1, *P.shape)
    first = torch.cat([zero, m[None, :, None], P[None], m.new_zeros(1, m.shape[0], 1), zero], -1)
    rest = _filter_elements(F, c, Q, Hm[1:], rm[1:], Rm[1:])
    (scanned,) = associative_scan(_filter_combine, (torch.cat([first, rest]),))
    d = m.shape[0]
    fm, fP = scanned[..., d], scanned[..., d + 1 : 2 * d + 1]
    FP = F @ fP[:-1]
    pm = torch.cat([m0[None], _mv(F, fm[:-1]) + c])
    pP = torch.cat([P0[None], symmetrize(FP @ F.mT + Q)])
    if observed is None:
        ll = update(pm, pP, r, H, R)[2]
    else:
        ll = masked_update(pm, pP, r, H, R, observed)[2]
    # Backward kernels: E^T = (P^-_{t+1})^{-1} F_t P_t by a Cholesky solve.
    E = torch.cholesky_solve(FP, torch.linalg.cholesky(pP[1:])).mT
    sm, sP = compose_backward_kernels(E, fm[:-1] - _mv(E, pm[1:]), symmetrize(fP[:-1] - E @ FP), fm[-1], fP[-1])
    return AffineChainResult(pm, pP, fm, fP, sm, sP, ll)


def compose_backward_kernels(gains: Tensor, mean_offsets: Tensor, cov_offsets: Tensor, last_mean: Tensor, last_cov: Tensor) -> tuple[Tensor, Tensor]:
    r"""The marginals of a chain given backward kernels and its last marginal, by one reverse scan.

    With :math:`x_{T-1} \sim \mathcal N(\mathrm{last\_mean}, \mathrm{last\_cov})` and :math:`x_t \mid x_{t+1} \sim \mathcal N(E_t x_{t+1} + g_t, L_t)`,
    the marginal of ``x_t`` is :math:`\mathcal N(m_t, P_t)` with :math:`m_t = E_t m_{t+1} + g_t` and
    :math:`P_t = E_t P_{t+1} E_t^\top + L_t`: the backward pass of every RTS smoother, where
    :math:`E_t = G_t` is the gain, :math:`g_t = m^f_t - G_t m^-_{t+1}` and
    :math:`L_t = P^f_t - G_t P^-_{t+1} G_t^\top`. Composed as affine maps in an associative scan of
    depth ``O(log T)`` instead of ``T - 1`` small steps; every term of ``P_t`` is a congruence of
    a positive semi-definite ``L``, so the sum loses nothing to cancellation.

    Args:
        gains: ``(T-1, d, d)``, ``E_t``.
        mean_offsets: ``(T-1, d)``, ``g_t``.
        cov_offsets: ``(T-1, d, d)``, ``L_t``.
        last_mean: ``(d,)``.
        last_cov: ``(d, d)``.

    Returns:
        ``(means (T, d), covariances (T, d, d))``, covariances symmetrised.

    Example:
        A scalar chain with ``E = 0.5``, ``g = 0``, ``L = 1`` back from ``N(2, 4)``:

        >>> E, g, L = torch.full((2, 1, 1), 0.5), torch.zeros(2, 1), torch.ones(2, 1, 1)
        >>> means, covs = compose_backward_kernels(
        ...     E, g, L, torch.tensor([2.0]), torch.tensor([[4.0]])
        ... )
        >>> means.squeeze(-1).tolist(), covs.flatten().tolist()   # m = m' / 2, P = P' / 4 + 1
        ([0.5, 1.0, 2.0], [1.5, 2.0, 4.0])
    """
    d = last_mean.shape[-1]
    kernels = torch.cat([gains, mean_offsets.unsqueeze(-1), cov_offsets], -1)
    last = torch.cat([torch.zeros_like(last_cov), last_mean.unsqueeze(-1), last_cov], -1)
    (scanned,) = associative_scan(_smooth_combine, (torch.cat([kernels, last[None]]),), reverse=True)
    return scanned[..., d], scanned[..., d + 1 :]


def _sequential(m0: Tensor, P0: Tensor, F: Tensor, c: Tensor, Q: Tensor, H: Tensor, r: Tensor, R: Tensor, observed: Tensor) -> AffineChainResult:
    out: list[list[Tensor]] = [[] for _ in range(5)]
    m, P = m0, P0
    for t in range(r.shape[0]):
        if t > 0:
            m, P = predict(m, P, F[t - 1], Q[t - 1])
            m = m + c[t - 1]
        pred = (m, P)
        try:
            m, P, ll = masked_update(m, P, r[t], H[t], R[t], observed[t])
        except torch.linalg.LinAlgError as error:
            raise NotPositiveDefiniteError(
                f"affine_chain_smoother: at time step {t} the innovation covariance H P H^T + R is not positive definite "
                f"(R[{t}] is not, or the predicted covariance lost its definiteness to rounding: run in float64)"
            ) from error
        for lst, v in zip(out, (*pred, m, P, ll)):
            lst.append(v)
    pm, pP, fm, fP, ll = (torch.stack(v) for v in out)
    means, covs = [fm[-1]], [fP[-1]]
    for t in range(r.shape[0] - 2, -1, -1):
        try:
            m, P = smooth_step(fm[t], fP[t], pm[t + 1], pP[t + 1], means[-1], covs[-1], F[t])
        except torch.linalg.LinAlgError as error:
            raise NotPositiveDefiniteError(f"affine_chain_smoother: the predicted covariance of time step {t + 1} is singular (Q[{t}] is)") from error
        means.append(m)
        covs.append(P)
    return AffineChainResult(pm, pP, fm, fP, torch.stack(means[::-1]), torch.stack(covs[::-1]), ll)


def _check_shape(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def affine_chain_smoother(
    init_mean: Tensor,
    init_cov: Tensor,
    F: Tensor,
    c: Tensor,
    Q: Tensor,
    H: Tensor,
    r: Tensor,
    R: Tensor,
    observed: Tensor | None = None,
    parallel: bool = True,
) -> AffineChainResult:
    """Exact filter, smoother and log-evidence increments of the affine chain (module docstring).

    Args:
        init_mean: ``(d,)`` prior mean ``m_0`` of ``x_0``.
        init_cov: ``(d, d)`` prior covariance ``P_0`` (positive definite).
        F: ``(T-1, d, d)`` transition matrices.
        c: ``(T-1, d)`` transition offsets.
        Q: ``(T-1, d, d)`` process-noise covariances (positive definite).
        H: ``(T, e, d)`` observation matrices.
        r: ``(T, e)`` observations; entries where ``observed`` is false are ignored (may be NaN).
        R: ``(T, e, e)`` observation-noise covariances (positive definite).
        observed: bool ``(T, e)``, or ``None`` when every entry is observed.
        parallel: the ``O(log T)``-depth associative scans (default) or the sequential loop.

    Returns:
        :class:`AffineChainResult`, on the dtype and device of the inputs, differentiable in each.

    Raises:
        ValueError: naming the argument whose shape (or dtype, for ``observed``) is wrong; or
            (``NotPositiveDefiniteError``) naming the time step whose innovation or predicted
            covariance is not positive definite. Where only the parallel scans fail (rounding),
            the sequential loop gives the answer.

    Example:
        >>> one = torch.ones(1, 1, 1)
        >>> out = affine_chain_smoother(
        ...     torch.zeros(1),
        ...     one[0],
        ...     one,
        ...     torch.zeros(1, 1),
        ...     one,
        ...     one.expand(2, 1, 1),
        ...     torch.tensor([[0.0], [2.0]]),
        ...     one.expand(2, 1, 1),
        ... )
        >>> [round(v, 4) for v in out.means.squeeze(-1).tolist()]  # as rts_smoother's example
        [0.4, 1.2]
    """
    if init_mean.dim() != 1:
        raise ValueError(f"init_mean must have shape (d,), got {tuple(init_mean.shape)}")
    if r.dim() != 2 or r.shape[0] == 0:
        raise ValueError(f"r must have shape (T, e) with T >= 1, got {tuple(r.shape)}")
    (d,), (T, e) = init_mean.shape, r.shape
    for name, x, shape in [
        ("init_cov", init_cov, (d, d)),
        ("F", F, (T - 1, d, d)),
        ("c", c, (T - 1, d)),
        ("Q", Q, (T - 1, d, d)),
        ("H", H, (T, e, d)),
        ("R", R, (T, e, e)),
    ]:
        _check_shape(name, x, shape)
    if observed is not None:
        _check_shape("observed", observed, (T, e))
        if observed.dtype != torch.bool:
            raise ValueError(f"observed must be a bool tensor, got {observed.dtype}")
    if parallel:
        try:
            return _parallel(init_mean, init_cov, F, c, Q, H, r, R, observed)
        except torch.linalg.LinAlgError:
            # The scans' products round differently from the recursion (in float32 a tiny
            # covariance may come out indefinite): the loop is the same answer, computed stably,
            # and where it fails too it names the time step.
            pass
    if observed is None:
        observed = torch.ones(T, e, dtype=torch.bool, device=r.device)
    return _sequential(init_mean, init_cov, F, c, Q, H, r, R, observed)
