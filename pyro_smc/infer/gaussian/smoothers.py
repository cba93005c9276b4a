r"""Assumed-density Gaussian filters and Rauch-Tung-Striebel smoothers for nonlinear models.

See ``docs/math/ep.md#gaussian-filter`` and ``docs/math/ep.md#rts-smoother``.

One filter and one smoother, parameterised by the projection (a
:class:`~pyro_smc.infer.gaussian.projections.Projection`, or its name): with :class:`Linearization` they
are the extended Kalman filter and smoother (EKF/EKS; GP-EKF/GP-EKS for GP components), with
:class:`Unscented` the unscented ones (UKF/URTSS), with :class:`MomentMatching` the GP-ADF and
GP-RTSS of Deisenroth et al. The model is any
:class:`~pyro_smc.models.protocol.GaussianStateSpaceModel` (``NonlinearGaussianSSM``,
``LinearGaussianSSM``, ...); on a linear one they are the Kalman filter and RTS smoother. Each
step reads like its equations:

* predict: :math:`(M, S, C) = \operatorname{proj}[f](m_t, P_t) + Q`;
* update: :math:`K = C_y S_y^{-1}`, :math:`m \leftarrow m + K (y - \mu_y)`, :math:`P \leftarrow P - K S_y K^\top`;
* smooth: :math:`G = C S^{-1}`, :math:`m^s_t = m_t + G (m^s_{t+1} - M)`,
  :math:`P^s_t = P_t + G (P^s_{t+1} - S) G^\top`.

These are written in moment form independently of :class:`pyro_smc.EPSmoother` (natural-form
messages), whose first sweep must reproduce them: that agreement is a test. All of them
return :class:`GaussianSmootherResult` with ``log_evidence`` (the prediction-error decomposition).
With :class:`~pyro_smc.gp.MultiOutputGP` components each pass computes each GP posterior once
(:func:`~pyro_smc.gp.pinned_posteriors`), and ``log_evidence`` is differentiable in the GP
hyperparameters (and in ``X``, ``Y`` when they are parameters): GP-ADF/GP-RTSS evidence
maximisation.
Missing data follow the rule of :mod:`pyro_smc.models.protocol`: a step whose observation is
all NaN (or ``None`` in a list) is predicted only; a partly NaN one is conditioned on its
observed entries. No result is ever non-finite: a mean, covariance or evidence term that is not
finite, or a covariance whose factorisation fails, is a ``ValueError`` naming the first time step
where it happened (checked once per run on the stacked result).

Example:
    >>> import torch
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> from pyro_smc.infer import unscented_rts_smoother
    >>> one = torch.ones(1, 1, dtype=torch.float64)
    >>> ssm = NonlinearGaussianSSM(
    ...     lambda x: 0.9 * x,
    ...     one,
    ...     lambda x: x,
    ...     one,
    ...     torch.zeros(1, dtype=torch.float64),
    ...     one,
    ... )
    >>> _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))
    >>> out = unscented_rts_smoother(ssm, ys)
    >>> out.means.shape, out.covariances.shape
    (torch.Size([10, 1]), torch.Size([10, 1, 1]))
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.gaussian.observed import ObservationStatus, observation_status, observed_moments
from pyro_smc.infer.gaussian.projections import Projection, Unscented, as_projection
from pyro_smc.infer.gaussian.recorded import ForwardRun, LeanFilter, _update
from pyro_smc.infer.gaussian.result import GaussianSmootherResult
from pyro_smc.models.protocol import GaussianStateSpaceModel, check_noise_covariances, require_gaussian_model
from pyro_smc.observations import check_observations
from pyro_smc.ops.affine_chain import compose_backward_kernels
from pyro_smc.ops.gaussian import check_finite_steps, symmetrize

__all__ = [
    "extended_kalman_filter",
    "extended_rts_smoother",
    "gaussian_filter",
    "gaussian_smoother",
    "gp_adf",
    "gp_rtss",
    "smoother_pass",
    "FilterPass",
    "SmootherPass",
    "unscented_kalman_filter",
    "unscented_rts_smoother",
]


def _log_normal(residual: Tensor, chol: Tensor) -> Tensor:
    # log N(y; mu, S) from y - mu (..., e) and the Cholesky factor of S (..., e, e).
    z = torch.linalg.solve_triangular(chol, residual.unsqueeze(-1), upper=False).squeeze(-1)
    return -0.5 * (z * z).sum(-1) - torch.diagonal(chol, dim1=-2, dim2=-1).log().sum(-1) - 0.5 * residual.shape[-1] * math.log(2 * math.pi)


def _increments(like: Tensor, steps: int, full: tuple, partial: list) -> Tensor:
    # The (T,) log-evidence increments: the fully observed steps' ``(steps, residuals, chols)``
    # stacked, in one batched call, the partly observed ones (each its own dimension) one by one.
    idx, values = [], []
    if full:
        idx.extend(full[0])
        values.append(_log_normal(full[1], full[2]))
    for t, residual, chol in partial:
        idx.append(t)
        values.append(_log_normal(residual, chol).unsqueeze(0))
    increments = like.new_zeros(steps)
    if not idx:
        return increments
    return increments.index_put((torch.tensor(idx, device=like.device),), torch.cat(values))


class FilterPass(NamedTuple):
    r"""The Gaussian filter's pass, kept for the smoother and for EP's cavities.

    Attributes:
        means: ``(T, d)`` the filtering means.
        covariances: ``(T, d, d)``.
        predictions: ``(M, S, C)``, the predicted moments of each step ``t -> t + 1``: ``M``
            ``(T - 1, d)`` the predicted mean, ``S`` ``(T - 1, d, d)`` its covariance, ``C``
            ``(T - 1, d, d)`` the cross-covariance of ``x_t`` and ``x_{t+1}``; ``()`` when ``T = 1``.
        log_evidence: ``()`` the sum of ``increments``.
        increments: ``(T,)`` each step's :math:`\log p(y_t \mid y_{<t})` under the projection.

    Example:
        See :func:`smoother_pass`.
    """

    means: Tensor
    covariances: Tensor
    predictions: tuple  # (M (T-1, d), S (T-1, d, d), C (T-1, d, d)): step t -> t + 1
    log_evidence: Tensor
    increments: Tensor


def _filter(ssm: GaussianStateSpaceModel, observations, projection: Projection) -> FilterPass:
    # Each GP component's posterior is computed once for the pass (with its autograd graph when
    # the hyperparameters require grad, so that log_evidence is differentiable in them), not
    # once per projection.
    require_gaussian_model(ssm, f"the Gaussian filter ({projection!r})")
    check_noise_covariances(ssm, f"the Gaussian filter ({projection!r})")
    with pinned_posteriors(ssm.transition_fn, ssm.observation_fn):
        return _filter_pinned(ssm, observations, projection)


DIVERGED = (
    "the model diverged or a map returned non-finite values there: check the transition and observation maps at "
    "those states (an unstable model, a wrong map or time index), the scales of the covariances, or run in float64"
)


def _failed(where: str, t: int, moments: dict[str, list], detail: str) -> ValueError:
    """The error for a factorisation that failed at step ``t``: non-finite moments at the first
    step that has them (the likely cause), else a covariance that is not positive definite."""
    try:
        check_finite_steps(where, {name: torch.stack(values) for name, values in moments.items() if values}, DIVERGED)
    except ValueError as located:
        return located
    return ValueError(
        f"{where}: at time step {t} a covariance is not positive definite (the predicted or the innovation covariance; "
        f"{detail}); {DIVERGED}, or give the noise covariances more room relative to the state's scale"
    )


def _check_factorisations(where: str, run: ForwardRun, ssm: GaussianStateSpaceModel) -> None:
    # The lean pass factorises with cholesky_ex and goes on: its first failed step is found here,
    # once per run, and reported as the eager loop reported it at the step (the moments up to it,
    # the step's own being its prediction).
    failed = torch.nonzero(run.info)
    if failed.numel() == 0:
        return
    t = int(failed[0, 0])
    mean, cov = (run.predictions[0][t - 1], run.predictions[1][t - 1]) if t > 0 else (ssm.init_mean, ssm.init_cov)
    moments = {"filtering mean": list(run.means[:t]) + [mean], "filtering covariance": list(run.covariances[:t]) + [cov]}
    raise _failed(where, t, moments, "a Cholesky factorisation failed")


def _filter_pinned(ssm: GaussianStateSpaceModel, observations, projection: Projection) -> FilterPass:
    ys, observed = check_observations(observations, ssm.obs_dim, like=ssm.init_mean)
    status = observation_status(ys)
    where = f"Gaussian filter ({projection!r})"
    lean = LeanFilter.of(ssm, projection)
    if lean is None:
        run = _general_forward(ssm, ys, observed, status, projection, where)
    else:
        run = lean.run(ys, observed, status)
        _check_factorisations(where, run, ssm)
    increments = _increments(ys, ys.shape[0], run.full, run.partial)
    # One check per run: a NaN that never reaches a factorisation (an unobserved coordinate)
    # would otherwise pass silently, beside a finite evidence.
    check_finite_steps(where, {"filtering mean": run.means, "filtering covariance": run.covariances, "log-evidence increment": increments}, DIVERGED)
    return FilterPass(run.means, run.covariances, run.predictions, increments.sum(), increments)


def _general_forward(ssm: GaussianStateSpaceModel, ys: Tensor, observed: Tensor, status: list, projection: Projection, where: str) -> ForwardRun:
    # Any projection, GP maps included: each step through Projection.moments.
    transition, observation = projection.for_factor("transition"), projection.for_factor("observation")
    m, P = ssm.init_mean, ssm.init_cov
    means, covs, predictions, full, partial = [], [], [], [], []
    for t in range(ys.shape[0]):
        try:
            if t > 0:
                M, S, C = transition.moments(ssm.transition_fn, m, P, t - 1, ssm.transition_cov)
                predictions.append((M, S, C))
                m, P = M, S
            if status[t] != ObservationStatus.MISSING:
                y, (mu, S_y, C_y) = ys[t], observation.moments(ssm.observation_fn, m, P, t, ssm.observation_cov)
                if status[t] == ObservationStatus.PARTLY_OBSERVED:
                    y, mu, S_y, C_y = observed_moments(y, observed[t], mu, S_y, C_y)
                updated, updated_cov, residual, chol, info = _update(m, P, y, mu, S_y, C_y)
                if bool(info):
                    raise _failed(where, t, {"filtering mean": means + [m], "filtering covariance": covs + [P]}, "a Cholesky factorisation failed")
                m, P = updated, updated_cov
                (full if status[t] == ObservationStatus.OBSERVED else partial).append((t, residual, chol))
        except torch.linalg.LinAlgError as error:
            detail = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            raise _failed(where, t, {"filtering mean": means + [m], "filtering covariance": covs + [P]}, detail) from error
        means.append(m)
        covs.append(P)
    predictions = tuple(torch.stack(column) for column in zip(*predictions)) if predictions else ()
    stacked = ()
    if full:
        steps, residuals, chols = zip(*full)
        stacked = (list(steps), torch.stack(residuals), torch.stack(chols))
    info = torch.zeros(ys.shape[0], dtype=torch.int32, device=ys.device)
    return ForwardRun(torch.stack(means), torch.stack(covs), predictions, stacked, partial, info)


def gaussian_filter(ssm: GaussianStateSpaceModel, observations: Tensor, projection: Projection | str = "unscented") -> GaussianSmootherResult:
    r"""Assumed-density Gaussian filter :math:`q(x_t \mid y_{0:t})`; the one filter behind
    :func:`extended_kalman_filter`, :func:`unscented_kalman_filter` and :func:`gp_adf`.

    Args:
        ssm: a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel` (state dim ``d``).
        observations: ``(T, e)``, NaN for missing entries (or a list of ``(e,)`` tensors and
            ``None``).
        projection: a :class:`~pyro_smc.infer.gaussian.projections.Projection`, or
            ``"linearization"``, ``"unscented"`` or ``"moment_matching"`` for the default one.

    Returns:
        :class:`~pyro_smc.infer.gaussian.result.GaussianSmootherResult`: the filtering marginals
        ``means (T, d)`` and ``covariances (T, d, d)``, ``log_evidence`` ``()`` (the
        prediction-error decomposition) and ``log_evidence_increments`` ``(T,)``.

    Raises:
        ValueError: an unknown projection name; observations of the wrong shape, with no time
            step, or of a dtype or device other than the model's; a mean, covariance or evidence
            term that is not finite, or a covariance that is not positive definite (naming the
            time step: the model diverged or a map returned non-finite values there).

    Example:
        On a linear-Gaussian model the filter is the Kalman filter, and its ``log_evidence``
        is exact:

        >>> import torch
        >>> from pyro_smc.infer import gaussian_filter
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = gaussian_filter(ssm, ys)
        >>> out.means.shape, out.log_evidence_increments.shape        # (T, d), (T,)
        (torch.Size([5, 1]), torch.Size([5]))
        >>> torch.allclose(out.log_evidence, ssm.log_evidence(ys), atol=1e-4)
        True
    """
    run = _filter(ssm, observations, as_projection(projection))
    return GaussianSmootherResult(run.means, run.covariances, log_evidence=run.log_evidence, log_evidence_increments=run.increments)


def gaussian_smoother(ssm: GaussianStateSpaceModel, observations: Tensor, projection: Projection | str = "unscented") -> GaussianSmootherResult:
    r"""Assumed-density Gaussian RTS smoother :math:`q(x_t \mid y_{0:T-1})`; the one smoother behind
    :func:`extended_rts_smoother`, :func:`unscented_rts_smoother` and :func:`gp_rtss`.

    Args and errors are those of :func:`gaussian_filter`, whose pass it smooths backwards.

    Returns:
        :class:`~pyro_smc.infer.gaussian.result.GaussianSmootherResult`: the smoothed marginals
        ``means (T, d)`` and ``covariances (T, d, d)``, and the filter's ``log_evidence`` ``()``
        and ``log_evidence_increments`` ``(T,)``.

    Raises:
        ValueError: as :func:`gaussian_filter`, or a singular predicted covariance (naming the
            time step of the undefined smoother gain).

    Example:
        On a linear-Gaussian model the smoother is the RTS smoother:

        >>> import torch
        >>> from pyro_smc.infer import gaussian_smoother
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = gaussian_smoother(ssm, ys, projection="linearization")
        >>> out.covariances.shape                                     # (T, d, d)
        torch.Size([5, 1, 1])
        >>> torch.allclose(out.means, ssm.rts_smoother(ys).means, atol=1e-5)
        True
    """
    run = smoother_pass(ssm, observations, projection)
    return GaussianSmootherResult(run.means, run.covariances, log_evidence=run.filtered.log_evidence, log_evidence_increments=run.filtered.increments)


class SmootherPass(NamedTuple):
    """What one filter-smoother pass computes (:func:`smoother_pass`).

    Attributes:
        means: ``(T, d)`` the smoothed means.
        covariances: ``(T, d, d)``.
        filtered: the filter's pass: its marginals ``means``, ``covariances``, the predicted
            moments ``predictions = (M, S, C)`` of each step ``t -> t + 1`` (``(T - 1, ...)``;
            ``()`` when ``T = 1``), ``log_evidence`` and ``increments``.

    Example:
        See :func:`smoother_pass`.
    """

    means: Tensor
    covariances: Tensor
    filtered: FilterPass


def smoother_pass(ssm: GaussianStateSpaceModel, observations: Tensor, projection: Projection | str = "unscented") -> SmootherPass:
    """:func:`gaussian_smoother` with the filter's pass kept: the parallel EP schedule starts
    from the cavities it implies (the matching Gaussian smoother is EP's first sweep).

    Args and errors are those of :func:`gaussian_smoother`.

    Returns:
        :class:`SmootherPass`.

    Example:
        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> run = smoother_pass(ssm, torch.ones(4, 1))
        >>> # S: (T-1, d, d)
        >>> run.means.shape, run.filtered.means.shape, run.filtered.predictions[1].shape
        (torch.Size([4, 1]), torch.Size([4, 1]), torch.Size([3, 1, 1]))
    """
    projection = as_projection(projection)
    run = _filter(ssm, observations, projection)
    means, covs, predictions = run.means, run.covariances, run.predictions
    where = f"Gaussian smoother ({projection!r})"
    ms, Ps = means, covs
    if predictions:
        M, S, C = predictions
        gain_t, info = torch.linalg.solve_ex(S, C.transpose(-1, -2))  # G_t^T = S^{-1} C^T for every t at once
        if bool((info != 0).any()):
            t = int(torch.nonzero(info).max())  # the backward pass meets the last singular step first
            raise ValueError(f"{where}: the predicted covariance of time step {t + 1} is singular, so the smoother gain at time step {t} is undefined; {DIVERGED}")
        # m^s_t = G m^s_{t+1} + (m_t - G M) and P^s_t = G P^s_{t+1} G^T + (P_t - G S G^T): the
        # backward kernels are built for every t at once and composed by a reverse scan.
        gain = gain_t.transpose(-1, -2)
        mean_offsets = means[:-1] - (M.unsqueeze(-2) @ gain_t).squeeze(-2)
        cov_offsets = symmetrize(covs[:-1] - gain @ S @ gain_t)
        ms, Ps = compose_backward_kernels(gain, mean_offsets, cov_offsets, means[-1], covs[-1])
    check_finite_steps(where, {"smoothed mean": ms, "smoothed covariance": Ps}, DIVERGED)
    return SmootherPass(ms, Ps, run)


# The variants fix the projection; their arguments, results and errors are those of
# gaussian_filter / gaussian_smoother, documented there once.
def extended_kalman_filter(ssm: GaussianStateSpaceModel, observations: Tensor) -> GaussianSmootherResult:
    """EKF (GP-EKF for GP components): :func:`gaussian_filter` with ``projection="linearization"``.

    Example:
        >>> import torch
        >>> from pyro_smc.infer import extended_kalman_filter
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = extended_kalman_filter(ssm, ys)
        >>> out.means.shape, out.covariances.shape                    # (T, d), (T, d, d)
        (torch.Size([5, 1]), torch.Size([5, 1, 1]))
        >>> torch.allclose(out.log_evidence, out.log_evidence_increments.sum())
        True
    """
    return gaussian_filter(ssm, observations, "linearization")


def extended_rts_smoother(ssm: GaussianStateSpaceModel, observations: Tensor) -> GaussianSmootherResult:
    """EKS / ERTSS (GP-EKS for GP components): :func:`gaussian_smoother` with
    ``projection="linearization"``.

    Example:
        >>> import torch
        >>> from pyro_smc.infer import extended_rts_smoother
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = extended_rts_smoother(ssm, ys)
        >>> out.means.shape, out.covariances.shape                    # (T, d), (T, d, d)
        (torch.Size([5, 1]), torch.Size([5, 1, 1]))
        >>> bool((out.covariances > 0).all())
        True
    """
    return gaussian_smoother(ssm, observations, "linearization")


def unscented_kalman_filter(ssm: GaussianStateSpaceModel, observations: Tensor, projection: Unscented | None = None) -> GaussianSmootherResult:
    """UKF: :func:`gaussian_filter` with ``projection`` an
    :class:`~pyro_smc.infer.gaussian.projections.Unscented` (default ``Unscented()``; its
    sigma-point settings, per factor if need be, go there).

    Example:
        >>> import torch
        >>> from pyro_smc.infer import Unscented, unscented_kalman_filter
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = unscented_kalman_filter(ssm, ys, Unscented(kappa=2.0))
        >>> out.means.shape, out.log_evidence.shape                   # (T, d), ()
        (torch.Size([5, 1]), torch.Size([]))
    """
    return gaussian_filter(ssm, observations, Unscented() if projection is None else projection)


def unscented_rts_smoother(ssm: GaussianStateSpaceModel, observations: Tensor, projection: Unscented | None = None) -> GaussianSmootherResult:
    """URTSS: :func:`gaussian_smoother` with ``projection`` an
    :class:`~pyro_smc.infer.gaussian.projections.Unscented` (default ``Unscented()``).

    Example:
        The unscented transform is exact for linear maps, so on a linear-Gaussian model this is
        the RTS smoother:

        >>> import torch
        >>> from pyro_smc.infer import unscented_rts_smoother
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = unscented_rts_smoother(ssm, ys)
        >>> torch.allclose(out.means, ssm.rts_smoother(ys).means, atol=1e-5)
        True
    """
    return gaussian_smoother(ssm, observations, Unscented() if projection is None else projection)


def gp_adf(ssm: GaussianStateSpaceModel, observations: Tensor) -> GaussianSmootherResult:
    """GP-ADF (Deisenroth et al. 2009): :func:`gaussian_filter` with
    ``projection="moment_matching"``, exact for ``MultiOutputGP`` components (a plain callable
    falls back to the unscented transform).

    Example:
        >>> import torch
        >>> from pyro_smc.infer import gp_adf, unscented_kalman_filter
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = gp_adf(ssm, ys)                                     # callables: the UKF
        >>> out.means.shape, torch.equal(out.means, unscented_kalman_filter(ssm, ys).means)
        (torch.Size([5, 1]), True)
    """
    return gaussian_filter(ssm, observations, "moment_matching")


def gp_rtss(ssm: GaussianStateSpaceModel, observations: Tensor) -> GaussianSmootherResult:
    """GP-RTSS (Deisenroth et al. 2012): :func:`gaussian_smoother` with
    ``projection="moment_matching"``, exact for ``MultiOutputGP`` components (a plain callable
    falls back to the unscented transform).

    Example:
        >>> import torch
        >>> from pyro_smc.infer import gp_rtss, unscented_rts_smoother
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> out = gp_rtss(ssm, ys)                                    # callables: the URTSS
        >>> out.covariances.shape, torch.equal(out.means, unscented_rts_smoother(ssm, ys).means)
        (torch.Size([5, 1, 1]), True)
    """
    return gaussian_smoother(ssm, observations, "moment_matching")
