r"""Where each step's optimisation of the online variational filter starts.

See ``docs/math/streaming.md#initialising-a-step`` and
``docs/math/streaming.md#laplace-approximation-by-newton-steps``.

Before fitting ``phi_t`` the filter may set the current marginal and kernel in closed form:

* ``"predict"``: ``q_t(x_t)`` at the model's one-step prediction from ``q_{t-1}`` (its mean and,
  by the law of total covariance over the ``q_{t-1}`` draws, its covariance), and the kernel at
  the linear regression of ``x_{t-1}`` on ``x_t`` under that prediction (which does not depend
  on ``y_t``);
* ``"laplace"``: the same, then ``q_t`` at the Laplace approximation of the prediction times
  ``g(y_t | x_t)`` (clipped-curvature Newton steps with backtracking; the Kalman update for a
  linear-Gaussian observation).

The prediction's moments and the kernel take the linear part of the transition mean in the
whitened draws of ``q_{t-1}`` as a control variate (:func:`_joint_prediction`), so both are exact
to rounding for linear-Gaussian models: the Kalman update and the exact backward kernel, with no
Monte Carlo error (then the default gradient rule stops the step before any iteration).

Example:
    >>> import torch
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.infer.online.context import StepContext
    >>> from pyro_smc.infer.online.start import initialise
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2, dtype=torch.float64)
    >>> ssm = LinearGaussianSSM(
    ...     0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2, dtype=torch.float64), eye
    ... )
    >>> state = {}
    >>> ssm.init(state)
    >>> y = torch.ones(2, dtype=torch.float64)
    >>> ctx, prior = StepContext(ssm, dict(vars(ssm)), state, None, y, False, 0).discover(
    ...     8, 2
    ... )
    >>> guide = StreamingFilterGuide(2, covariance="full").double()
    >>> initialise(guide, ctx, prior, laplace=True)
    >>> # the Kalman update: 1 / (1 + 0.1) = 0.909...
    >>> [round(v, 4) for v in guide.loc.tolist()]
    [0.9091, 0.9091]
"""

from __future__ import annotations

import torch
from pyro.distributions import MultivariateNormal, TorchDistribution
from torch import Tensor

from pyro_smc.guides.streaming.family import StreamingFamily
from pyro_smc.infer.online.context import Discovery, StepContext
from pyro_smc.ops.gaussian import symmetrize
from pyro_smc.ops.laplace import gram_scale_tril, jittered, laplace_newton, posterior_scale_tril, regression_kernel
from pyro_smc.ops.weights import all_finite

__all__ = ["NEWTON_STEPS", "initialise"]

NEWTON_STEPS = 5


@torch.no_grad()
def initialise(guide: StreamingFamily, context: StepContext, prior: Discovery, laplace: bool) -> None:
    r"""Sets ``guide``'s marginal at the prediction (and, with ``laplace``, the Laplace update) and
    its kernel at the regression of ``x_{t-1}`` on ``x_t`` under the prediction.

    Args:
        guide: the per-step family, changed in place.
        context: the step, with its latent site discovered.
        prior: the discovery run's draws (:meth:`StepContext.discover`).
        laplace: take up to ``NEWTON_STEPS`` Newton steps on :math:`\log g(y_t \mid x_t)`; ``False`` for a
            missing observation or ``initialize="predict"``.

    Raises:
        ValueError: the prediction's moments are not finite (naming the step).
    """
    d = guide.state_dim
    joint = None if prior.x_prev is None or len(prior.x_prev) <= 2 * d + 1 else _joint_prediction(prior, context.previous, d)
    if joint is None:  # the first step, too few draws, or a prediction that is not finite
        m, cov = _prediction(prior, d)
        kernel = None if prior.x_prev is None else regression_kernel(prior.x_prior, prior.x_prev, return_scale_tril=True)
        if not _finite(m, cov):  # (a joint prediction is finite: _joint_prediction checked it)
            raise ValueError(
                f"at step {context.t}: the model's one-step prediction of x_t (its mean and covariance from the draws of "
                "q_{t-1}) is not finite: check the model's transition at this step"
            )
    else:
        m, cov, kernel = joint
    if laplace:
        # As a factor: a precise observation makes the posterior covariance too ill-conditioned
        # to pass as a matrix in float32 (it is not numerically positive definite).
        m, tril = _laplace_update(context, m, cov, prior.x_prev)
        guide.set_marginal(m, scale_tril=tril)
    else:
        guide.set_marginal(m, cov)
    if kernel is not None:
        weight, bias, tril = kernel
        guide.set_kernel(weight, bias, scale_tril=tril)


def _transition_moments(prior: Discovery, d: int) -> tuple[Tensor, Tensor]:
    """The transition's mean at each draw ``(N, d)`` and its mean covariance ``(d, d)`` where the
    distribution has them, else the draws themselves and zero."""
    x_prior, prior_fn = prior.x_prior, prior.prior_fn
    try:
        mean = prior_fn.mean.expand(x_prior.shape[:-1] + (d,)).reshape(-1, d)
        var = prior_fn.covariance_matrix if hasattr(prior_fn, "covariance_matrix") else torch.diag_embed(prior_fn.variance)
        within = var.expand(mean.shape[:-1] + (d, d)).mean(0)
    except (NotImplementedError, AttributeError):
        mean, within = x_prior, torch.zeros(d, d, dtype=x_prior.dtype, device=x_prior.device)
    return mean, within


def _prediction(prior: Discovery, d: int) -> tuple[Tensor, Tensor]:
    """Mean ``(d,)`` and covariance ``(d, d)`` of ``x_t`` under the model's one-step prediction: the
    transition's moments where the distribution has them, else the draws'."""
    mean, within = _transition_moments(prior, d)
    m = mean.mean(0)
    centred = mean - m
    cov = symmetrize(within + centred.T @ centred / max(len(mean), 1))
    # Jittered only where it is not numerically positive definite: exact moments stay exact.
    return m, cov if int(torch.linalg.cholesky_ex(cov).info) == 0 else jittered(cov)


def _joint_prediction(prior: Discovery, previous: TorchDistribution, d: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]] | None:
    r"""The prediction's mean ``(d,)`` and covariance ``(d, d)``, and the backward kernel
    ``(weight, bias, scale_tril)`` of ``x_{t-1}`` given ``x_t`` under it, with the linear part of the
    transition mean as a control variate (``docs/math/streaming.md#initialising-a-step``).

    In the whitened :math:`z = L_{t-1}^{-1} (x_{t-1} - m_{t-1})` (exactly :math:`\mathcal N(0, I)`) the transition
    mean is regressed on the draws, :math:`\mu(x_{t-1}) = a + B z + r(z)`; its mean is :math:`a` and its
    covariance :math:`B B^\top + \operatorname{Cov}(r)`, and :math:`\operatorname{Cov}(x_{t-1}, x_t) = L_{t-1} B^\top` (Stein's lemma: the
    population slope is :math:`\mathbb E[\partial \mu / \partial z]`). For a linear transition :math:`r = 0` and all three are
    exact whatever the draws, so a linear-Gaussian step starts at the Kalman update and the
    Kalman backward kernel with no Monte Carlo error. The kernel's covariance is taken in the
    information form :math:`L_{t-1} (I + B^\top Q^{-1} B)^{-1} L_{t-1}^\top` (:math:`Q` the transition noise plus
    :math:`\operatorname{Cov}(r)`), which a precise transition does not cancel away. ``None`` where a moment is not
    finite or a matrix not numerically positive definite (the caller then falls back to the
    plain moments, which name the step when they are not finite).
    """
    mean, within = _transition_moments(prior, d)
    m_prev = previous.mean
    # Its own factor: a jitter would widen the directions an observation of 1e-4 makes narrow.
    L_prev = previous.scale_tril if isinstance(previous, MultivariateNormal) else torch.diag_embed(previous.base_dist.scale)
    z = torch.linalg.solve_triangular(L_prev, (prior.x_prev - m_prev).T, upper=False).T
    n = len(z)
    zc, mc = z - z.mean(0), mean - mean.mean(0)
    B, info = torch.linalg.solve_ex(zc.T @ zc, zc.T @ mc)  # mu ~ a + B^T z (z is whitened: no jitter)
    if int(info) != 0:
        return None
    B = B.T
    m = mean.mean(0) - B @ z.mean(0)  # E z = 0 exactly
    residuals = mc - zc @ B.T
    noise = symmetrize(within + residuals.T @ residuals / (n - d - 1))
    L_noise, info = torch.linalg.cholesky_ex(noise)
    if int(info) != 0:  # a transition without noise (or moments): jitter, as the plain moments do
        noise = jittered(noise)
        L_noise, info = torch.linalg.cholesky_ex(noise)
    cov = symmetrize(B @ B.T + noise)
    if int(info) != 0 or not _finite(m, cov, L_noise):
        return None
    Bw = torch.linalg.solve_triangular(L_noise, B, upper=False)  # Q^{-1/2} B
    eye = torch.eye(d, dtype=z.dtype, device=z.device)
    S = posterior_scale_tril(eye, Bw.T @ Bw)  # (I + B^T Q^{-1} B)^{-1} = S S^T
    # E[z | x_t] = S S^T B^T Q^{-1} (x_t - m)
    weight_z = torch.linalg.solve_triangular(L_noise.T, Bw @ S @ S.T, upper=True).T
    weight = L_prev @ weight_z
    bias = m_prev - weight @ m
    tril = gram_scale_tril((L_prev @ S).T)  # tril tril^T = L_prev S (L_prev S)^T
    if not _finite(weight, bias, tril):
        return None
    return m, cov, (weight, bias, tril)


def _finite(*tensors: Tensor) -> bool:
    """Whether every entry of ``tensors`` is finite (one check, one synchronisation:
    :func:`~pyro_smc.ops.weights.all_finite`)."""
    return all_finite(torch.cat([t.reshape(-1) for t in tensors]))


def _laplace_update(context: StepContext, m: Tensor, cov: Tensor, x_prev: Tensor | None) -> tuple[Tensor, Tensor]:
    r"""The Laplace approximation of :math:`\mathcal N(x; m, \mathtt{cov}) \, g(y_t \mid x)` as ``(loc, scale_tril)``
    (:func:`pyro_smc.ops.laplace.laplace_newton`).

    One Newton step first, then the step the loop would take next, from that step's curvature:
    when it is below the loop's own tolerance (``1e-6`` relative) the first step was the answer,
    as it is for a linear-Gaussian observation, and the loop's confirming step (three runs of the
    model and a Hessian) is saved. Otherwise the loop runs in full from the start, so the result
    is the loop's.
    """
    # The run needs some x_{t-1}; g(y_t | x_t) does not depend on it, so one q_{t-1} draw does.
    prev = None if x_prev is None else x_prev[:1]

    def log_g(x: Tensor) -> Tensor:
        return context.log_likelihood(x, prev)

    x, tril = laplace_newton(log_g, m, cov, 1, return_scale_tril=True)
    if NEWTON_STEPS > 1 and not _converged(log_g, m, cov, x, tril):
        x, tril = laplace_newton(log_g, m, cov, NEWTON_STEPS, return_scale_tril=True)
    return x, tril


@torch.enable_grad()
def _converged(log_g, m: Tensor, cov: Tensor, x: Tensor, tril: Tensor) -> bool:
    """Whether the Newton step from ``x`` with the posterior factor ``tril`` is within
    :func:`~pyro_smc.ops.laplace.laplace_newton`'s stopping tolerance."""
    xg = x.detach().clone().requires_grad_(True)
    value = log_g(xg) - 0.5 * (torch.linalg.solve_triangular(torch.linalg.cholesky(cov), (xg - m).unsqueeze(-1), upper=False).square().sum())
    (grad,) = torch.autograd.grad(value, xg)
    step = tril @ (tril.T @ grad)
    return bool(torch.isfinite(step).all()) and float(step.abs().max()) <= 1e-6 * (1 + float(x.abs().max()))
