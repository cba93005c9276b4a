r"""Assumed-density Gaussian filters and Rauch-Tung-Striebel smoothers for nonlinear models.

One filter and one smoother, parameterised by the projection (see
:mod:`pyro_smc.infer.projections`): with ``"linearization"`` they are the extended Kalman filter
and smoother (EKF/EKS; GP-EKF/GP-EKS for GP components), with ``"unscented"`` the unscented ones
(UKF/URTSS), with ``"moment_matching"`` the GP-ADF and GP-RTSS of Deisenroth et al. Each step
reads like its equations:

* predict: ``(M, S, C) = proj[f](m_t, P_t) + Q``;
* update: ``K = C_y S_y^{-1}``, ``m <- m + K (y - mu_y)``, ``P <- P - K S_y K^T``;
* smooth: ``G = C S^{-1}``, ``m^s_t = m_t + G (m^s_{t+1} - M)``,
  ``P^s_t = P_t + G (P^s_{t+1} - S) G^T``.

These are written in moment form independently of :class:`pyro_smc.EPSmoother` (natural-form
messages), whose first sweep must reproduce them: that agreement is a test. All of them
return :class:`GaussianSmootherResult`.

Example:
    >>> import torch
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> from pyro_smc.infer.gaussian_smoothers import unscented_rts_smoother
    >>> one = torch.ones(1, 1, dtype=torch.float64)
    >>> ssm = NonlinearGaussianSSM(lambda x: 0.9 * x, one, lambda x: x, one, torch.zeros(1, dtype=torch.float64), one)
    >>> _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))
    >>> out = unscented_rts_smoother(ssm, ys)
    >>> out.means.shape, out.covariances.shape
    (torch.Size([10, 1]), torch.Size([10, 1, 1]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pyro_smc.infer.projections import PROJECTIONS, project, unscented_settings
from pyro_smc.ops.gaussian import symmetrize

__all__ = [
    "GaussianSmootherResult",
    "extended_kalman_filter",
    "extended_rts_smoother",
    "gaussian_filter",
    "gaussian_smoother",
    "gp_adf",
    "gp_rtss",
    "unscented_kalman_filter",
    "unscented_rts_smoother",
]


@dataclass
class GaussianSmootherResult:
    """Gaussian marginals ``q(x_t)`` of a filter, smoother or EP run.

    Attributes:
        means: ``(T, d)``.
        covariances: ``(T, d, d)``.
        first_sweep: for EP, the result of the first forward-backward sweep (the plain Gaussian
            smoother); ``None`` otherwise.
        history: for EP, one dict per iteration with ``change`` (max abs change of the
            marginals' means and covariances) and ``skipped`` (updates not applied because a
            cavity or the resulting marginal was not a proper Gaussian).
        converged: whether EP stopped on ``tol`` (always ``True`` for filters and smoothers).
        log_likelihood: the filter's Gaussian approximation of ``log p(y_{1:T})`` (filters and
            smoothers only).
    """

    means: Tensor
    covariances: Tensor
    first_sweep: GaussianSmootherResult | None = None
    history: list[dict] = field(default_factory=list)
    converged: bool = True
    log_likelihood: Tensor | None = None


def check_observations(observations: Tensor, obs_dim: int) -> tuple[Tensor, Tensor]:
    """Validates ``(T, e)`` (or ``(T,)`` when ``e = 1``) observations.

    Returns:
        ``(observations (T, e), observed (T,) bool)``; a step with any NaN entry is missing.
    """
    if not isinstance(observations, Tensor):
        raise ValueError(f"observations must be a tensor of shape (T, {obs_dim}), got {type(observations).__name__}")
    if observations.dim() == 1 and obs_dim == 1:
        observations = observations.unsqueeze(-1)
    if observations.dim() != 2 or observations.shape[-1] != obs_dim:
        raise ValueError(f"observations must have shape (T, {obs_dim}), got {tuple(observations.shape)}")
    bad = torch.isinf(observations).any(-1)
    if bool(bad.any()):
        raise ValueError(f"observations contain inf at time step {int(bad.nonzero()[0, 0])} (use NaN for a missing measurement)")
    return observations, ~torch.isnan(observations).any(-1)


def _log_normal(y: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    chol = torch.linalg.cholesky(cov)
    z = torch.linalg.solve_triangular(chol, (y - mean).unsqueeze(-1), upper=False).squeeze(-1)
    return -0.5 * (z * z).sum(-1) - torch.diagonal(chol, dim1=-2, dim2=-1).log().sum(-1) - 0.5 * y.shape[-1] * math.log(2 * math.pi)


def _check_projection(projection: str) -> None:
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")


def _filter(ssm, observations: Tensor, projection: str, unscented: dict | None):
    _check_projection(projection)
    ut_transition, ut_observation = unscented_settings(unscented, "transition"), unscented_settings(unscented, "observation")
    ys, observed = check_observations(observations, ssm.obs_dim)
    m, P = ssm.init_mean, ssm.init_cov
    means, covs, predictions = [], [], []
    log_lik = ys.new_zeros(())
    for t in range(ys.shape[0]):
        if t > 0:
            M, S, C = project(ssm.transition, m, P, t - 1, projection, ssm.transition_cov, ssm.transition_takes_time, ut_transition)
            predictions.append((M, S, C))
            m, P = M, S
        if bool(observed[t]):
            mu, S_y, C_y = project(ssm.observation, m, P, t, projection, ssm.observation_cov, ssm.observation_takes_time, ut_observation)
            gain_t = torch.linalg.solve(S_y, C_y.transpose(-1, -2))  # K^T = S_y^{-1} C_y^T
            m = m + (ys[t] - mu) @ gain_t
            P = symmetrize(P - C_y @ gain_t)
            log_lik = log_lik + _log_normal(ys[t], mu, S_y)
        means.append(m)
        covs.append(P)
    return means, covs, predictions, log_lik


def gaussian_filter(ssm, observations: Tensor, projection: str = "unscented", unscented: dict | None = None) -> GaussianSmootherResult:
    """Assumed-density Gaussian filter ``q(x_t | y_{0:t})``.

    Args:
        ssm: a :class:`pyro_smc.models.NonlinearGaussianSSM`.
        observations: ``(T, e)``; a step with NaN entries is a missing measurement.
        projection: ``"linearization"``, ``"unscented"`` or ``"moment_matching"``.
        unscented: ``alpha``, ``beta``, ``kappa`` of the sigma points (defaults 1, 0, ``3 - d``),
            or ``{"transition": {...}, "observation": {...}}`` to set them per factor.

    Returns:
        :class:`GaussianSmootherResult` with the filtering marginals and ``log_likelihood``.
    """
    means, covs, _, log_lik = _filter(ssm, observations, projection, unscented)
    return GaussianSmootherResult(torch.stack(means), torch.stack(covs), log_likelihood=log_lik)


def gaussian_smoother(ssm, observations: Tensor, projection: str = "unscented", unscented: dict | None = None) -> GaussianSmootherResult:
    """Assumed-density Gaussian RTS smoother ``q(x_t | y_{0:T-1})``; arguments as :func:`gaussian_filter`."""
    means, covs, predictions, log_lik = _filter(ssm, observations, projection, unscented)
    ms, Ps = [means[-1]], [covs[-1]]
    for t in range(len(means) - 2, -1, -1):
        M, S, C = predictions[t]
        gain = torch.linalg.solve(S, C.transpose(-1, -2)).transpose(-1, -2)  # G = C S^{-1}
        ms.append(means[t] + (ms[-1] - M) @ gain.transpose(-1, -2))
        Ps.append(symmetrize(covs[t] + gain @ (Ps[-1] - S) @ gain.transpose(-1, -2)))
    return GaussianSmootherResult(torch.stack(ms[::-1]), torch.stack(Ps[::-1]), log_likelihood=log_lik)


def extended_kalman_filter(ssm, observations: Tensor) -> GaussianSmootherResult:
    """EKF (GP-EKF for GP components): :func:`gaussian_filter` with ``"linearization"``."""
    return gaussian_filter(ssm, observations, "linearization")


def extended_rts_smoother(ssm, observations: Tensor) -> GaussianSmootherResult:
    """EKS / ERTSS (GP-EKS for GP components): :func:`gaussian_smoother` with ``"linearization"``."""
    return gaussian_smoother(ssm, observations, "linearization")


def unscented_kalman_filter(ssm, observations: Tensor, **unscented: float) -> GaussianSmootherResult:
    """UKF: :func:`gaussian_filter` with ``"unscented"``; keyword arguments ``alpha, beta, kappa``."""
    return gaussian_filter(ssm, observations, "unscented", unscented or None)


def unscented_rts_smoother(ssm, observations: Tensor, **unscented: float) -> GaussianSmootherResult:
    """URTSS: :func:`gaussian_smoother` with ``"unscented"``; keyword arguments ``alpha, beta, kappa``."""
    return gaussian_smoother(ssm, observations, "unscented", unscented or None)


def gp_adf(ssm, observations: Tensor) -> GaussianSmootherResult:
    """GP-ADF (Deisenroth et al. 2009): :func:`gaussian_filter` with ``"moment_matching"``."""
    return gaussian_filter(ssm, observations, "moment_matching")


def gp_rtss(ssm, observations: Tensor) -> GaussianSmootherResult:
    """GP-RTSS (Deisenroth et al. 2012): :func:`gaussian_smoother` with ``"moment_matching"``."""
    return gaussian_smoother(ssm, observations, "moment_matching")
