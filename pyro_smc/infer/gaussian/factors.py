r"""EP's factors as fitted linear models: each factor's implicit linear model at its cavity, the
messages it implies, and the EP evidence of the fitted chain.

See ``docs/math/ep.md#expectation-propagation`` and ``docs/math/ep.md#the-ep-evidence``.

A projection (:class:`~pyro_smc.infer.gaussian.projections.Projection`) turns the map ``f`` of a
factor into the moments :math:`(\mu_a, S_a, C)` of :math:`a = f(x) + \mathrm{noise}` at a cavity :math:`\mathcal N(m, P)`; the
factor is then the implicit linear model :math:`a = J x + c + \epsilon` with :math:`J = C^\top P^{-1}`,
:math:`c = \mu_a - J m` and :math:`\operatorname{Cov}[\epsilon] = S_a - J P J^\top` (a :class:`LinearFit`). Both schedules fit
through :class:`Factors`; the sequential one also takes its messages from here.

Example:
    >>> import torch
    >>> from pyro_smc.infer.gaussian.factors import Factors
    >>> from pyro_smc.infer.gaussian.projections import Unscented
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(1, dtype=torch.float64)
    >>> ssm = LinearGaussianSSM(
    ...     0.5 * eye, eye, eye, eye, torch.zeros(1, dtype=torch.float64), eye
    ... )
    >>> fit = Factors(ssm, Unscented()).transition(
    ...     (torch.zeros(1, dtype=torch.float64), eye), 0
    ... )
    >>> # x' = 0.5 x + w, Var[w] = 1
    >>> round(fit.jacobian.item(), 12), round(fit.noise.item(), 12)
    (0.5, 1.0)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.observed import observed_moments
from pyro_smc.infer.gaussian.projections import Projection
from pyro_smc.infer.gaussian.sites import Natural, failure_hint
from pyro_smc.models.protocol import GaussianStateSpaceModel
from pyro_smc.ops.gaussian import symmetrize, to_moment, to_natural
from pyro_smc.ops.kalman import predict, update

__all__ = ["Factors", "LinearFit", "backward_message", "ep_log_evidence_increments", "forward_message", "powered_noise"]


class LinearFit(NamedTuple):
    r"""A factor's implicit linear model :math:`a = J x + c + \epsilon`, :math:`\epsilon \sim \mathcal N(0, \mathrm{noise})`, fitted at a
    cavity with mean ``at``. Every field may carry leading batch dims (the parallel schedule fits
    all factors at once).

    Attributes:
        at: ``(d,)`` the cavity mean the model was fitted at.
        jacobian: :math:`J` ``(e, d)``, :math:`C^\top P^{-1}`.
        offset: :math:`c` ``(e,)``, :math:`\mu_a - J \, \mathrm{at}`.
        mean: :math:`\mu_a` ``(e,)``, the projected mean of ``a``.
        cov: :math:`S_a` ``(e, e)``, its projected covariance (noise included).
        noise: :math:`\operatorname{Cov}[\epsilon]` ``(e, e)``, :math:`S_a - J P J^\top`.
        y: for a measurement, the observed entries of ``y_t`` ``(e,)`` it conditions on (``e``
            counts only those); ``None`` for a transition.

    Example:
        >>> import torch
        >>> one = torch.ones(1, 1)
        >>> LinearFit(
        ...     torch.zeros(1), 2 * one, torch.zeros(1), torch.zeros(1), 5 * one, one
        ... ).jacobian.item()
        2.0
    """

    at: Tensor
    jacobian: Tensor
    offset: Tensor
    mean: Tensor
    cov: Tensor
    noise: Tensor
    y: Tensor | None = None


class Factors:
    """The transition and observation factors of ``ssm``, fitted by ``projection``.

    Args:
        ssm: a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`.
        projection: a :class:`~pyro_smc.infer.gaussian.projections.Projection` (its
            :meth:`~pyro_smc.infer.gaussian.projections.Projection.for_factor` picks the settings
            of each factor).

    Example:
        >>> import torch
        >>> from pyro_smc.infer.gaussian.projections import Linearization
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(1)
        >>> factors = Factors(
        ...     LinearGaussianSSM(eye, eye, 3 * eye, eye, torch.zeros(1), eye), Linearization()
        ... )
        >>> message, fit = factors.measurement((torch.zeros(1), eye), torch.ones(1), None, 0)
        >>> fit.jacobian.item(), message[1].item()                    # Lambda = J^T R^{-1} J
        (3.0, 9.0)
    """

    def __init__(self, ssm: GaussianStateSpaceModel, projection: Projection):
        self.ssm = ssm
        self.projection = projection
        self.transition_projection = projection.for_factor("transition")
        self.observation_projection = projection.for_factor("observation")

    def transition(self, cavity: Natural, t: int, power: float = 1.0) -> LinearFit:
        r"""The implicit linear model of :math:`x_{t+1} = f(x_t) + w` at the cavity on :math:`x_t`;
        with ``power`` :math:`\alpha < 1` its linearisation error is scaled by :math:`\alpha`
        (``powered_noise`` below)."""
        mean, cov = to_moment(*cavity)
        Q = self.ssm.transition_cov
        M, S, C = self.transition_projection.moments(self.ssm.transition_fn, mean, cov, t, Q)
        J = torch.linalg.solve(cov, C).transpose(-1, -2)  # C^T P^{-1}
        return LinearFit(mean, J, M - J @ mean, M, S, powered_noise(S - J @ C, Q, power))

    def measurement(
        self, cavity: Natural, y: Tensor, observed: Tensor | None, t: int, power: float = 1.0
    ) -> tuple[Natural, LinearFit]:
        r"""The measurement message of ``y``'s entries where ``observed`` (``None``: all of them)
        and the implicit linear model it comes from; with ``power`` :math:`\alpha < 1` the
        model's linearisation error is scaled by :math:`\alpha` (``powered_noise`` below)."""
        mean, cov = to_moment(*cavity)
        R = self.ssm.observation_cov
        mu, S_y, C = self.observation_projection.moments(self.ssm.observation_fn, mean, cov, t, R)
        if observed is not None:
            y, mu, S_y, C = observed_moments(y, observed, mu, S_y, C)
            R = R[observed][:, observed]
        J = torch.linalg.solve(cov, C).transpose(-1, -2)
        noise = powered_noise(S_y - J @ C, R, power)
        c = mu - J @ mean
        # J^T E^{-1} [J, y - c] in one Cholesky solve.
        rhs = torch.cat([J, (y - c).unsqueeze(-1)], -1)
        sol = torch.cholesky_solve(rhs, torch.linalg.cholesky(noise))
        message = (J.transpose(-1, -2) @ sol[:, -1], symmetrize(J.transpose(-1, -2) @ sol[:, :-1]))
        return message, LinearFit(mean, J, c, mu, S_y, noise, y)

    def transitions_batch(self, mean: Tensor, cov: Tensor) -> LinearFit:
        """The transitions out of ``t = 0 .. B-1`` fitted at the cavities ``N(mean (B, d), cov (B, d, d))``."""
        ssm = self.ssm
        M, S, C = self.transition_projection.moments_batch(ssm.transition_fn, mean, cov, range(mean.shape[0]), ssm.transition_cov)
        F = torch.linalg.solve(cov, C).transpose(-1, -2)
        return LinearFit(mean, F, M - (F @ mean.unsqueeze(-1)).squeeze(-1), M, S, symmetrize(S - F @ C))

    def measurements_batch(self, mean: Tensor, cov: Tensor, steps: list[int]) -> LinearFit:
        """The measurements at ``steps`` fitted at the cavities ``N(mean (B, d), cov (B, d, d))``,
        all entries (``y`` is ``None``: the caller masks the missing ones)."""
        ssm = self.ssm
        mu, S, C = self.observation_projection.moments_batch(ssm.observation_fn, mean, cov, steps, ssm.observation_cov)
        H = torch.linalg.solve(cov, C).transpose(-1, -2)
        Hm = (H @ mean.unsqueeze(-1)).squeeze(-1)
        return LinearFit(mean, H, mu - Hm, mu, S, symmetrize(S - H @ C))


def powered_noise(residual: Tensor, noise: Tensor, power: float) -> Tensor:
    r"""The noise of the linear model whose message power EP sends for a factor with additive
    Gaussian noise (``docs/math/ep.md#power-ep``): :math:`\alpha (S_a - J P J^\top - N) + N`.

    The powered factor :math:`f^\alpha` is the same map with the noise :math:`N / \alpha`; fitted at
    the cavity, its linear model has the error :math:`E_{\mathrm{lin}} + N / \alpha`, where
    :math:`E_{\mathrm{lin}} = S_a - J P J^\top - N` is what the map's nonlinearity adds (a GP's
    predictive variance included), and the message is that model's to the power
    :math:`1 / \alpha`: noise :math:`\alpha E_{\mathrm{lin}} + N`.

    Args:
        residual: :math:`S_a - J P J^\top` ``(e, e)``, noise included.
        noise: :math:`N` ``(e, e)``, the factor's additive noise covariance.
        power: :math:`\alpha` in ``(0, 1]``; 1 returns ``residual`` (symmetrised).

    Returns:
        ``(e, e)``, symmetric.

    Example:
        >>> import torch
        >>> powered_noise(torch.full((1, 1), 3.0), torch.ones(1, 1), 0.5).item()  # 0.5 * 2 + 1
        2.0
    """
    if power == 1.0:
        return symmetrize(residual)
    return symmetrize(power * residual + (1.0 - power) * noise)


def forward_message(fit: LinearFit) -> Natural:
    r"""The forward message of a transition fit: its projected prediction :math:`\mathcal N(M, S)`."""
    return to_natural(fit.mean, fit.cov)


def backward_message(fit: LinearFit, data: Natural) -> Natural:
    r"""The backward message of a transition fit given the data message :math:`(\eta_m, \Lambda_m)` on
    :math:`x_{t+1}`: with :math:`E = \operatorname{Cov}[\epsilon]` and :math:`H = (I + \Lambda_m E)^{-1}`,
    :math:`\Lambda = J^\top H \Lambda_m J`, :math:`\eta = J^\top H (\eta_m - \Lambda_m c)`. It never inverts
    :math:`\Lambda_m`, singular whenever ``y`` has fewer dimensions than ``x``."""
    J, c, noise = fit.jacobian, fit.offset, fit.noise
    eta_m, lam_m = data
    eye = torch.eye(lam_m.shape[-1], dtype=lam_m.dtype, device=lam_m.device)
    h = torch.linalg.solve(eye + lam_m @ noise, torch.cat([lam_m, (eta_m - lam_m @ c).unsqueeze(-1)], -1))
    return J.transpose(-1, -2) @ h[:, -1], symmetrize(J.transpose(-1, -2) @ h[:, :-1] @ J)


def ep_log_evidence_increments(init_mean: Tensor, init_cov: Tensor, measurements: list, transitions: list, ys: Tensor) -> Tensor:
    """The EP evidence's terms ``(T,)`` (``docs/math/ep.md#the-ep-evidence``): the Kalman filter's
    prediction-error decomposition on the fitted linear-Gaussian chain, from
    ``N(init_mean, init_cov)``.

    Args:
        init_mean: ``(d,)``.
        init_cov: ``(d, d)``.
        measurements: ``T`` measurement :class:`LinearFit` (``None`` at a step without data).
        transitions: ``T - 1`` transition :class:`LinearFit`, the one out of each step.
        ys: ``(T, e)``, for its length, dtype and device.

    Returns:
        ``(T,)``, 0 at a step without data.

    Raises:
        ValueError: an innovation covariance of the filter is not positive definite (naming the step).
    """
    m, P = init_mean, init_cov
    increments = []
    for t in range(ys.shape[0]):
        if t > 0:
            fit = transitions[t - 1]
            m, P = predict(m, P, fit.jacobian, fit.noise)
            m = m + fit.mean - fit.jacobian @ fit.at
        increment = ys.new_zeros(())
        fit = measurements[t]
        if fit is not None:
            try:
                m, P, increment = update(m, P, fit.y - fit.offset, fit.jacobian, fit.noise)  # y - c = J x + v
            except torch.linalg.LinAlgError as error:
                raise ValueError(
                    f"EPSmoother: the EP evidence's Kalman filter over the fitted linear-Gaussian model failed at time step {t}: "
                    f"its innovation covariance is not positive definite; {failure_hint(1)}"
                ) from error
        increments.append(increment)
    return torch.stack(increments) if increments else ys.new_zeros(0)
