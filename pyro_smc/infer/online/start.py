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

Both are exact for linear-Gaussian models up to Monte Carlo error.

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
from torch import Tensor

from pyro_smc.guides.streaming.family import StreamingFamily
from pyro_smc.infer.online.context import Discovery, StepContext
from pyro_smc.ops.laplace import jittered, laplace_newton, regression_kernel

__all__ = ["NEWTON_STEPS", "initialise"]

NEWTON_STEPS = 5


@torch.no_grad()
def initialise(guide: StreamingFamily, context: StepContext, prior: Discovery, laplace: bool) -> None:
    """Sets ``guide``'s marginal at the prediction (and, with ``laplace``, the Laplace update) and
    its kernel at the regression of ``x_{t-1}`` on ``x_t`` under the prediction.

    Args:
        guide: the per-step family, changed in place.
        context: the step, with its latent site discovered.
        prior: the discovery run's draws (:meth:`StepContext.discover`).
        laplace: take up to ``NEWTON_STEPS`` Newton steps on ``log g(y_t | x_t)``; ``False`` for a
            missing observation or ``initialize="predict"``.

    Raises:
        ValueError: the prediction's moments are not finite (naming the step).
    """
    m, cov = _prediction(prior, guide.state_dim)
    if not (bool(torch.isfinite(m).all()) and bool(torch.isfinite(cov).all())):
        raise ValueError(
            f"at step {context.t}: the model's one-step prediction of x_t (its mean and covariance from the draws of "
            "q_{t-1}) is not finite: check the model's transition at this step"
        )
    if laplace:
        # As a factor: a precise observation makes the posterior covariance too ill-conditioned
        # to pass as a matrix in float32 (it is not numerically positive definite).
        m, tril = _laplace_update(context, m, cov, prior.x_prev)
        guide.set_marginal(m, scale_tril=tril)
    else:
        guide.set_marginal(m, cov)
    if prior.x_prev is not None:
        weight, bias, tril = regression_kernel(prior.x_prior, prior.x_prev, return_scale_tril=True)
        guide.set_kernel(weight, bias, scale_tril=tril)


def _prediction(prior: Discovery, d: int) -> tuple[Tensor, Tensor]:
    """Mean ``(d,)`` and covariance ``(d, d)`` of ``x_t`` under the model's one-step prediction: the
    transition's moments where the distribution has them, else the draws'."""
    x_prior, prior_fn = prior.x_prior, prior.prior_fn
    try:
        mean = prior_fn.mean.expand(x_prior.shape[:-1] + (d,)).reshape(-1, d)
        var = prior_fn.covariance_matrix if hasattr(prior_fn, "covariance_matrix") else torch.diag_embed(prior_fn.variance)
        within = var.expand(mean.shape[:-1] + (d, d)).mean(0)
    except (NotImplementedError, AttributeError):
        mean, within = x_prior, torch.zeros(d, d, dtype=x_prior.dtype, device=x_prior.device)
    m = mean.mean(0)
    centred = mean - m
    cov = within + centred.T @ centred / max(len(mean), 1)
    return m, jittered(cov)


def _laplace_update(context: StepContext, m: Tensor, cov: Tensor, x_prev: Tensor | None) -> tuple[Tensor, Tensor]:
    """The Laplace approximation of ``N(x; m, cov) g(y_t | x)`` as ``(loc, scale_tril)``
    (:func:`pyro_smc.ops.laplace.laplace_newton`)."""
    # The run needs some x_{t-1}; g(y_t | x_t) does not depend on it, so one q_{t-1} draw does.
    prev = None if x_prev is None else x_prev[:1]
    return laplace_newton(lambda x: context.log_likelihood(x, prev), m, cov, NEWTON_STEPS, return_scale_tril=True)
