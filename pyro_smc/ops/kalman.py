r"""Kalman filter, Rauch-Tung-Striebel smoother and the exact log-evidence.

See ``docs/math/ep.md#kalman-filter`` and ``docs/math/ep.md#missing-observations``.

The model is :math:`x_1 \sim \mathcal N(m_1, P_1)`, :math:`x_t = A x_{t-1} + w_t`, :math:`w_t \sim \mathcal N(0, Q)`,
:math:`y_t = C x_t + v_t`, :math:`v_t \sim \mathcal N(0, R)`. Each step is a pure function; :func:`kalman_filter` and
:func:`rts_smoother` are drivers. Everything is differentiable, so ``torch.autograd`` on
:func:`kalman_filter`'s log-evidence gives the exact score, the oracle for gradient tests.

Missing data: NaN entries of ``y_t`` are not observed. The update conditions on the observed
entries only (the exact Gaussian marginal of ``C_o x + v_o``); a step with every entry NaN is a
prediction only and adds 0 to the log-evidence. ``inf`` is an error.

Example:
    >>> import torch
    >>> from pyro_smc.ops.kalman import kalman_filter
    >>> eye = torch.eye(2, dtype=torch.float64)
    >>> ys = torch.zeros(5, 2, dtype=torch.float64)
    >>> out = kalman_filter(
    ...     ys, 0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2, dtype=torch.float64), eye
    ... )
    >>> out.means.shape, out.log_evidence_increments.shape
    (torch.Size([5, 2]), torch.Size([5]))
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The result types live with the other engines' results; re-exported here, where they began.
from pyro_smc.ops.gaussian import check_finite_steps
from pyro_smc.ops.results import FilterResult, SmootherResult

__all__ = ["FilterResult", "SmootherResult", "predict", "update", "mask_missing", "masked_update", "smooth_step", "kalman_filter", "rts_smoother"]

# Why a Kalman filter's moments stop being finite with finite inputs: float32 overflows first.
_OVERFLOW = (
    "the model's matrices are finite, so the recursion overflowed: an unstable A (spectral radius > 1) over many steps, "
    "or covariances at extreme scales; rescale the model or run in float64"
)


def _mv(matrix: Tensor, vector: Tensor) -> Tensor:
    # Batched matrix-vector product that broadcasts batch dims of both sides.
    return (matrix @ vector.unsqueeze(-1)).squeeze(-1)


def _symmetrize(m: Tensor) -> Tensor:
    return (m + m.transpose(-1, -2)) / 2


def predict(mean: Tensor, cov: Tensor, A: Tensor, Q: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`p(x_t \mid y_{1:t-1})` from :math:`p(x_{t-1} \mid y_{1:t-1})`: :math:`(A m, A P A^\top + Q)`.

    Args:
        mean: ``(..., d)`` filtered mean at ``t - 1``.
        cov: ``(..., d, d)`` filtered covariance at ``t - 1``.
        A: ``(..., d, d)`` transition matrix.
        Q: ``(..., d, d)`` process-noise covariance.

    Returns:
        ``(mean (..., d), cov (..., d, d))`` of the prediction.

    Example:
        >>> m, P = predict(
        ...     torch.tensor([1.0]),
        ...     torch.tensor([[2.0]]),
        ...     torch.tensor([[0.5]]),
        ...     torch.tensor([[1.0]]),
        ... )
        >>> m.tolist(), P.tolist()  # (0.5 * 1, 0.25 * 2 + 1)
        ([0.5], [[1.5]])
    """
    return _mv(A, mean), _symmetrize(A @ cov @ A.transpose(-1, -2) + Q)


def update(mean: Tensor, cov: Tensor, y: Tensor, C: Tensor, R: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Conditions :math:`\mathcal N(m, P)` (``mean``, ``cov``) on :math:`y = C x + v`.

    Args:
        mean: ``(..., d)`` predicted mean.
        cov: ``(..., d, d)`` predicted covariance.
        y: ``(..., dy)`` observation (all entries observed).
        C: ``(..., dy, d)`` observation matrix.
        R: ``(..., dy, dy)`` observation-noise covariance.

    Returns:
        ``(mean (..., d), cov (..., d, d), log_lik (...))`` with
        ``log_lik`` :math:`= \log \mathcal N(y \mid C m, C P C^\top + R)`.

    Raises:
        RuntimeError: (``torch.linalg.LinAlgError``) if :math:`C P C^\top + R` is not positive definite.

    Example:
        >>> one = torch.tensor([[1.0]])
        >>> m, P, ll = update(torch.tensor([0.0]), one, torch.tensor([2.0]), one, one)
        >>> m.tolist(), P.tolist()  # gain 1 / 2
        ([1.0], [[0.5]])
        >>> bool(
        ...     torch.isclose(
        ...         ll, torch.distributions.Normal(0.0, 2**0.5).log_prob(torch.tensor(2.0))
        ...     )
        ... )
        True
    """
    S = _symmetrize(C @ cov @ C.transpose(-1, -2) + R)
    L = torch.linalg.cholesky(S)
    resid = y - _mv(C, mean)
    # K^T = S^{-1} C P, computed by two triangular solves.
    gain_t = torch.cholesky_solve(C @ cov, L)
    new_mean = mean + _mv(gain_t.transpose(-1, -2), resid)
    new_cov = _symmetrize(cov - (C @ cov).transpose(-1, -2) @ gain_t)
    z = torch.linalg.solve_triangular(L, resid.unsqueeze(-1), upper=False).squeeze(-1)
    dim = y.shape[-1]
    log_lik = -0.5 * (z * z).sum(-1) - torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1) - 0.5 * dim * math.log(2 * math.pi)
    return new_mean, new_cov, log_lik


def mask_missing(C: Tensor, y: Tensor, R: Tensor, observed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The measurement model ``y = C x + v`` with the entries where ``observed`` is false made
    uninformative and shape-preserving: a zero row of ``C``, ``y_i = 0`` and unit noise
    uncorrelated with the other entries (see :func:`masked_update`).

    Args:
        C: ``(..., dy, d)``.
        y: ``(..., dy)``; entries where ``observed`` is false may be NaN.
        R: ``(..., dy, dy)``.
        observed: bool ``(..., dy)``.

    Returns:
        ``(C, y, R)`` masked.

    Example:
        >>> C, y, R = mask_missing(
        ...     torch.ones(2, 1),
        ...     torch.tensor([1.0, float("nan")]),
        ...     torch.ones(2, 2),
        ...     torch.tensor([True, False]),
        ... )
        >>> C.tolist(), y.tolist(), R.tolist()
        ([[1.0], [0.0]], [1.0, 0.0], [[1.0, 0.0], [0.0, 1.0]])
    """
    obs = observed.to(C.dtype)
    R = R * (obs.unsqueeze(-1) * obs.unsqueeze(-2)) + torch.diag_embed(1 - obs)
    return C * obs.unsqueeze(-1), torch.where(observed, y, torch.zeros_like(y)), R


def masked_update(mean: Tensor, cov: Tensor, y: Tensor, C: Tensor, R: Tensor, observed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r""":func:`update` on the entries of ``y`` where ``observed`` (bool, shape of ``y``) is true.

    A missing entry ``i`` gets a zero row of ``C``, no noise correlation and unit noise variance at
    ``y_i = 0``: its innovation is independent of ``x`` and of the observed entries, so it leaves the
    state alone and adds exactly :math:`\log \mathcal N(0 \mid 0, 1)`, which is taken off again. This keeps the shapes
    (and any batch dims) fixed, so the observed set may differ across batch members.

    Args:
        mean: ``(..., d)``.
        cov: ``(..., d, d)``.
        y: ``(..., dy)``; entries where ``observed`` is false are ignored (may be NaN).
        C: ``(..., dy, d)``.
        R: ``(..., dy, dy)``.
        observed: bool ``(..., dy)``.

    Returns:
        ``(mean (..., d), cov (..., d, d), log_lik (...))`` as :func:`update` on the observed
        entries; ``log_lik`` is exactly 0 where nothing is observed.

    Example:
        >>> eye = torch.eye(2)
        >>> y = torch.tensor([1.0, float("nan")])
        >>> m, P, ll = masked_update(torch.zeros(2), eye, y, eye, eye, ~y.isnan())
        >>> m1, P1, ll1 = update(torch.zeros(1), eye[:1, :1], y[:1], eye[:1, :1], eye[:1, :1])
        >>> (
        ...     [round(v, 4) for v in m.tolist() + P.diagonal().tolist()],
        ...     bool(torch.isclose(ll, ll1)),
        ... )
        ([0.5, 0.0, 0.5, 1.0], True)
    """
    C, y, R = mask_missing(C, y, R, observed)
    new_mean, new_cov, log_lik = update(mean, cov, y, C, R)
    log_lik = log_lik + 0.5 * math.log(2 * math.pi) * (~observed).sum(-1).to(log_lik.dtype)
    # An unobserved step adds exactly 0, not the rounding error of the correction.
    return new_mean, new_cov, torch.where(observed.any(-1), log_lik, torch.zeros_like(log_lik))


def check_ys(ys: Tensor) -> Tensor | None:
    """``None`` when every entry of ``ys`` is finite, else the bool mask of its observed (non-NaN)
    entries; raises ``ValueError`` naming the first time step (dim 0) with an ``inf``."""
    finite = torch.isfinite(ys)
    if bool(finite.all()):
        return None
    inf = torch.isinf(ys).reshape(ys.shape[0], -1).any(-1)
    if bool(inf.any()):
        raise ValueError(f"ys contains inf at time step {int(inf.nonzero()[0, 0])} (use NaN for a missing observation)")
    return finite


def smooth_step(
    filt_mean: Tensor, filt_cov: Tensor, pred_mean: Tensor, pred_cov: Tensor, next_mean: Tensor, next_cov: Tensor, A: Tensor
) -> tuple[Tensor, Tensor]:
    r"""One RTS step: :math:`p(x_t \mid y_{1:T})` from the filter at ``t`` and the smoother at ``t+1``.

    Args:
        filt_mean: ``(..., d)`` filtered mean at ``t``.
        filt_cov: ``(..., d, d)`` filtered covariance at ``t``.
        pred_mean: ``(..., d)`` prediction of ``x_{t+1}`` from the filter at ``t``.
        pred_cov: ``(..., d, d)`` its covariance.
        next_mean: ``(..., d)`` smoothed mean at ``t + 1``.
        next_cov: ``(..., d, d)`` smoothed covariance at ``t + 1``.
        A: ``(..., d, d)`` transition matrix.

    Returns:
        ``(mean (..., d), cov (..., d, d))`` of :math:`p(x_t \mid y_{1:T})`.

    Example:
        >>> one = torch.tensor([[1.0]])
        >>> m, P = smooth_step(
        ...     torch.tensor([0.0]),
        ...     one,
        ...     torch.tensor([0.0]),
        ...     2 * one,
        ...     torch.tensor([1.0]),
        ...     one,
        ...     one,
        ... )
        >>> m.tolist(), P.tolist()  # gain 1 / 2: 0 + 1 / 2, 1 + (1 - 2) / 4
        ([0.5], [[0.75]])
    """
    # G = P_t A^T P_pred^{-1}
    gain = torch.linalg.solve(pred_cov, A @ filt_cov).transpose(-1, -2)
    mean = filt_mean + _mv(gain, next_mean - pred_mean)
    cov = _symmetrize(filt_cov + gain @ (next_cov - pred_cov) @ gain.transpose(-1, -2))
    return mean, cov


def kalman_filter(ys: Tensor, A: Tensor, Q: Tensor, C: Tensor, R: Tensor, init_mean: Tensor, init_cov: Tensor) -> FilterResult:
    """Runs the Kalman filter over observations ``ys`` of shape ``(T, dy)``.

    Model matrices may carry leading batch dimensions (e.g. a grid of parameters), which
    broadcast through every output: ``means`` is then ``(T, *batch, d)``.

    ``init_mean, init_cov`` are the prior of ``x_1`` (the state of the first observation). NaN
    entries of ``ys`` are missing (see the module docstring); ``inf`` raises ``ValueError``.

    Args:
        ys: ``(T, dy)`` observations, NaN where missing.
        A: ``(*batch, d, d)`` transition matrix.
        Q: ``(*batch, d, d)`` process-noise covariance.
        C: ``(*batch, dy, d)`` observation matrix.
        R: ``(*batch, dy, dy)`` observation-noise covariance.
        init_mean: ``(*batch, d)`` prior mean of ``x_1``.
        init_cov: ``(*batch, d, d)`` prior covariance of ``x_1``.

    Returns:
        ``FilterResult`` with ``means (T, *batch, d)``, ``covariances (T, *batch, d, d)``, the
        predictions of the same shapes and ``log_evidence_increments (T, *batch)``.

    Raises:
        ValueError: ``ys`` with no time step, an ``inf`` or another dtype or device than the
            model's; a model tensor with non-finite entries or another dtype; a factorisation that
            fails or a moment that is not finite (naming the time step: float32 overflows on an
            unstable model).

    Example:
        >>> one = torch.tensor([[1.0]])
        >>> out = kalman_filter(torch.tensor([[2.0]]), one, one, one, one, torch.zeros(1), one)
        >>> exact = torch.distributions.Normal(0.0, 2 ** 0.5).log_prob(torch.tensor(2.0))
        >>> out.means.tolist(), bool(torch.isclose(out.log_evidence, exact))
        ([[1.0]], True)
    """
    _check_inputs(ys, A=A, Q=Q, C=C, R=R, init_mean=init_mean, init_cov=init_cov)
    observed = check_ys(ys)
    means, covs, pmeans, pcovs, lls = [], [], [], [], []
    # Every step's moments carry the batch of all the model's tensors: with only A batched the
    # first step's would otherwise lack it, and stacking the steps failed.
    batch = torch.broadcast_shapes(A.shape[:-2], Q.shape[:-2], C.shape[:-2], R.shape[:-2], init_mean.shape[:-1], init_cov.shape[:-2])
    d = init_mean.shape[-1]
    m, P = init_mean.expand(batch + (d,)), init_cov.expand(batch + (d, d))
    for t in range(ys.shape[0]):
        try:
            if t > 0:
                m, P = predict(m, P, A, Q)
            pmeans.append(m)
            pcovs.append(P)
            if observed is None:
                m, P, ll = update(m, P, ys[t], C, R)
            else:
                m, P, ll = masked_update(m, P, ys[t], C, R, observed[t])
        except torch.linalg.LinAlgError as error:
            check_finite_steps("kalman_filter", {"predicted mean": torch.stack(pmeans), "predicted covariance": torch.stack(pcovs)}, _OVERFLOW)
            raise ValueError(
                f"kalman_filter: at time step {t} the innovation covariance C P C^T + R is not positive definite (R is not, "
                "or P has lost its positive definiteness to rounding); rescale the model or run in float64"
            ) from error
        means.append(m)
        covs.append(P)
        lls.append(ll)
    out = FilterResult(torch.stack(means), torch.stack(covs), torch.stack(pmeans), torch.stack(pcovs), torch.stack(lls))
    check_finite_steps(
        "kalman_filter",
        {"predicted mean": out.predicted_means, "predicted covariance": out.predicted_covariances, "filtering mean": out.means,
         "filtering covariance": out.covariances, "log-evidence increment": out.log_evidence_increments},
        _OVERFLOW,
    )
    return out


def _check_inputs(ys: Tensor, **model: Tensor) -> None:
    """``ys`` ``(T, dy)`` with ``T >= 1`` in the model's dtype and device; the model's tensors finite."""
    dy = model["C"].shape[-2]
    if ys.dim() != 2 or ys.shape[-1] != dy:
        raise ValueError(f"ys must have shape (T, {dy}) (the rows of C), got {tuple(ys.shape)}")
    if ys.shape[0] == 0:
        raise ValueError(f"ys must have at least one time step, got shape {tuple(ys.shape)}")
    ref = model["A"]
    for name, value in model.items():
        if value.dtype != ref.dtype or value.device != ref.device:
            raise ValueError(f"{name} has dtype {value.dtype} on {value.device}, A {ref.dtype} on {ref.device}: give the model one dtype and device")
    if ys.dtype != ref.dtype or ys.device != ref.device:
        raise ValueError(f"ys has dtype {ys.dtype} on {ys.device}, but the model {ref.dtype} on {ref.device}: convert it, ys.to(A)")
    finite = torch.stack([torch.isfinite(value).all() for value in model.values()])
    if not bool(finite.all()):
        raise ValueError(f"{list(model)[int((~finite).nonzero()[0, 0])]} has non-finite entries")


def rts_smoother(filtered: FilterResult, A: Tensor) -> SmootherResult:
    """Rauch-Tung-Striebel smoother over a ``FilterResult``; carries its ``log_evidence``.

    Args:
        filtered: the output of :func:`kalman_filter` over ``T`` steps.
        A: ``(*batch, d, d)`` transition matrix used by the filter.

    Returns:
        ``SmootherResult`` with ``means (T, *batch, d)`` and ``covariances (T, *batch, d, d)``.

    Raises:
        ValueError: a singular predicted covariance, or a smoothed moment that is not finite,
            naming the time step.

    Example:
        >>> one = torch.tensor([[1.0]])
        >>> ys = torch.tensor([[0.0], [2.0]])
        >>> out = rts_smoother(kalman_filter(ys, one, one, one, one, torch.zeros(1), one), one)
        >>> y = torch.distributions.MultivariateNormal(
        ...     torch.zeros(2), torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        ... )
        >>> (
        ...     [round(v, 4) for v in out.means.squeeze(-1).tolist()],
        ...     bool(torch.isclose(out.log_evidence, y.log_prob(ys.squeeze(-1)))),
        ... )
        ([0.4, 1.2], True)
    """
    T = filtered.means.shape[0]
    m, P = filtered.means[-1], filtered.covariances[-1]
    means, covs = [m], [P]
    for t in range(T - 2, -1, -1):
        try:
            m, P = smooth_step(
                filtered.means[t], filtered.covariances[t], filtered.predicted_means[t + 1], filtered.predicted_covariances[t + 1], m, P, A
            )
        except torch.linalg.LinAlgError as error:
            raise ValueError(
                f"rts_smoother: the predicted covariance of time step {t + 1} is singular, so the smoother gain at time step {t} "
                "is undefined (a zero process noise Q with a singular A P A^T)"
            ) from error
        means.append(m)
        covs.append(P)
    out = SmootherResult(torch.stack(means[::-1]), torch.stack(covs[::-1]), filtered.log_evidence)
    check_finite_steps("rts_smoother", {"smoothed mean": out.means, "smoothed covariance": out.covariances}, _OVERFLOW)
    return out
