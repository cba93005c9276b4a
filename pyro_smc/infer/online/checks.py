r"""What :class:`~pyro_smc.OnlineVariationalFilter` checks so that it never reports a wrong number
silently: its settings, each step's fitted marginal and ELBO increment, and whether the running
ELBO still estimates a lower bound.

See ``docs/math/streaming.md#monte-carlo-error-of-the-running-elbo``.

The running ELBO :math:`L_t = \mathbb E[U_{t-1}(x_{t-1}) + \delta_t]` evaluates the regression :math:`U_{t-1}`, fitted
on draws of :math:`q_{t-1}`, at the new kernel's draws of :math:`x_{t-1}`. Exact kernels draw from the
smoothing distribution, which lies inside the filtering one; a kernel that puts :math:`x_{t-1}` far
outside it (a failed optimisation) extrapolates the regression, whose error is then unbounded in
both directions, so the estimate can exceed :math:`\log p(y)`. :func:`extrapolation` measures it and
:class:`OnlineFilterWarning` reports it.

Example:
    >>> import torch
    >>> from pyro_smc.guides.streaming.family import gaussian
    >>> from pyro_smc.infer.online.checks import extrapolation
    >>> previous = gaussian(torch.zeros(2), torch.ones(2))  # q_{t-1} = N(0, I)
    >>> extrapolation(previous, torch.randn(100, 2)) is None                  # inside
    True
    >>> round(extrapolation(previous, torch.full((100, 2), 10.0)))  # 10 sds off in each
    200
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_smc.guides.streaming.family import StreamingFamily
from pyro_smc.regression import QuadraticRegressor, Regressor

__all__ = [
    "EXTRAPOLATION_LIMIT",
    "INITIALIZE",
    "OnlineFilterWarning",
    "check_marginal",
    "check_model_and_guide",
    "check_settings",
    "check_targets",
    "extrapolation",
    "mahalanobis_squared",
    "standard_error",
    "warn_extrapolated",
    "warn_unconverged",
    "warn_if_few_regression_samples",
]

#: How far (in mean squared Mahalanobis distance under ``q_{t-1}``, beyond the ``d`` of its own
#: draws) a step's kernel may put ``x_{t-1}`` before the value regression counts as extrapolated.
#: 25 is a shift of 5 standard deviations: exact kernels (the smoothing distribution, inside the
#: filtering one) exceed it only after an observation that is a 5-sd surprise about ``x_{t-1}``.
EXTRAPOLATION_LIMIT = 25.0

#: The filter's ``initialize`` settings: how each step's optimisation starts (``pyro_smc.infer.online.start``).
INITIALIZE = ("laplace", "predict", "previous")


class OnlineFilterWarning(UserWarning):
    r"""A step of :class:`~pyro_smc.OnlineVariationalFilter` whose running ELBO cannot be trusted.

    The running ELBO :math:`L_t = \mathbb E[U_{t-1}(x_{t-1}) + \delta_t]` evaluates the value regression
    :math:`U_{t-1}` at the draws of the new backward kernel :math:`q_t(x_{t-1} \mid x_t)`. :math:`U_{t-1}` was fitted
    on draws of :math:`q_{t-1}`; when the kernel puts :math:`x_{t-1}` far outside them (mean squared
    Mahalanobis distance under :math:`q_{t-1}` above ``d + EXTRAPOLATION_LIMIT``, that is ``d + 25``),
    the regression is extrapolated, its error is unbounded in both directions, and
    ``log_evidence`` is no longer an estimate of a lower bound (it can exceed :math:`\log p(y)`). This
    happens when the step's optimisation fails: too few ``num_iterations`` to recover from a poor
    start, or too large an ``lr``. Emitted once per stream, at the first such step; every such
    step is listed in ``OnlineVariationalFilter.unreliable_steps``.

    Example:
        A ``UserWarning``, so the usual filters apply; to stop a stream at its first failed step:

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", OnlineFilterWarning)
        ...     try:
        ...         warnings.warn(
        ...             OnlineFilterWarning("step 3: the optimisation of the step failed")
        ...         )
        ...     except OnlineFilterWarning as failed:
        ...         print(failed)
        step 3: the optimisation of the step failed
    """


def check_model_and_guide(model: Any, guide: Any) -> None:
    """``model`` has the ``init``/``step`` protocol and ``guide`` is a streaming family in its
    online role (one marginal, one kernel, no ``num_steps``).

    Raises:
        ValueError: naming ``model`` or ``guide``.

    Example:
        >>> import torch
        >>> from pyro_smc.guides import StreamingFilterGuide
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> check_model_and_guide(ssm, StreamingFilterGuide(2))
        >>> check_model_and_guide(object(), StreamingFilterGuide(2))
        Traceback (most recent call last):
            ...
        ValueError: model must have init(state, ...) and step(state, y, ...) methods
    """
    if not (hasattr(model, "init") and hasattr(model, "step")):
        raise ValueError("model must have init(state, ...) and step(state, y, ...) methods")
    if not isinstance(guide, StreamingFamily):
        raise ValueError(f"guide must be a StreamingFilterGuide, got {type(guide).__name__}")
    if getattr(guide, "num_steps", None) is not None or guide.num_kernels != 1:
        raise ValueError("guide must be in online mode (StreamingFilterGuide(state_dim) without num_steps)")


def check_settings(model: Any, guide: Any, state_key: Any, initialize: Any) -> None:
    """The filter's arguments that are not numbers: ``model`` and ``guide``
    (:func:`check_model_and_guide`), ``state_key`` (``None`` or a str) and ``initialize`` (one of
    ``INITIALIZE``).

    Raises:
        ValueError: naming the argument.

    Example:
        >>> import torch
        >>> from pyro_smc.guides import StreamingFilterGuide
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> check_settings(ssm, StreamingFilterGuide(2), state_key=None, initialize="predict")
        >>> check_settings(ssm, StreamingFilterGuide(2), state_key=None, initialize="newton")
        Traceback (most recent call last):
            ...
        ValueError: initialize must be one of ('laplace', 'predict', 'previous'), got 'newton'
    """
    check_model_and_guide(model, guide)
    if state_key is not None and not isinstance(state_key, str):
        raise ValueError(f"state_key must be None or the name (a str) of the state entry holding the latent, got {state_key!r}")
    if initialize not in INITIALIZE:
        raise ValueError(f"initialize must be one of {INITIALIZE}, got {initialize!r}")


def warn_if_few_regression_samples(regressor: Regressor, state_dim: int, num_samples: int) -> None:
    """Warns when a quadratic value regression has fewer than twice as many samples as features.

    Measured: at ``d = 10`` (66 features) 64 samples give NaN and 128 a runaway parameter.

    Example:
        >>> import warnings
        >>> from pyro_smc.regression import QuadraticRegressor
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_if_few_regression_samples(
        ...         QuadraticRegressor(), state_dim=10, num_samples=64
        ...     )
        >>> len(caught)
        1
    """
    if not isinstance(regressor, QuadraticRegressor):
        return
    features = 1 + state_dim + state_dim * (state_dim + 1) // 2
    if num_samples < 2 * features:
        warnings.warn(
            f"num_regression_samples={num_samples} is below twice the {features} quadratic features of a "
            f"{state_dim}-d state; the regressions (and online parameter learning) can diverge",
            stacklevel=3,
        )


def check_marginal(guide: StreamingFamily, where: str) -> None:
    """The fitted marginal and kernel have finite parameters and standard deviations in ``(0, inf)``
    (:meth:`~pyro_smc.guides.StreamingFamily.invalid_parameter`), so the filtering mean and
    covariance are finite.

    Args:
        guide: the family after the step's optimisation.
        where: the step, for the message (``"step 3"``).

    Raises:
        ValueError: naming the step and the parameter (raised before anything of the step is
            carried on).

    Example:
        >>> import torch
        >>> q = StreamingFamily(2)
        >>> check_marginal(q, "step 0")  # finite: nothing happens
        >>> _ = q.loc.detach().fill_(float("nan"))
        >>> try:
        ...     check_marginal(q, "step 0")
        ... except ValueError as error:
        ...     print(str(error)[:61])
        at step 0: the filtering mean or covariance is not finite (th
    """
    bad = guide.invalid_parameter()
    if bad is not None:
        raise ValueError(
            f"at {where}: the filtering mean or covariance is not finite (the variational parameter {bad!r} is not finite, "
            "or a standard deviation is 0 or inf): the model's log-density or its gradient was not finite at the draws, "
            "or lr is too large (an iteration moves each log standard deviation by about lr)"
        )


def check_targets(targets: Tensor, where: str) -> None:
    """The step's ELBO increments (regression targets) ``(N,)`` are finite.

    Raises:
        ValueError: naming the step and how many draws are not finite.

    Example:
        >>> import torch
        >>> try:
        ...     check_targets(torch.tensor([0.0, -float("inf")]), "step 2")
        ... except ValueError as error:
        ...     print(str(error)[:62])
        at step 2: the ELBO increment is not finite at 1 of 2 draws of
    """
    finite = torch.isfinite(targets)
    if not bool(finite.all()):
        raise ValueError(
            f"at {where}: the ELBO increment is not finite at {int((~finite).sum())} of {len(targets)} draws of q_t "
            "(the model's log-density log f + log g is NaN or -inf there, or q_t puts mass where the model has none, or "
            f"it exceeds the range of {targets.dtype}): check the model's transition and observation at this step"
        )


def standard_error(values: Tensor) -> Tensor:
    r"""The standard error :math:`\mathrm{sd} / \sqrt{N}` of the mean of ``values`` ``(N,)``, computed on values
    scaled by their largest deviation, so that it does not overflow where the variance would
    (float32 holds 3e38: deviations of 2e19 already overflow its square).

    Example:
        >>> import torch
        >>> float(standard_error(torch.tensor([1.0, 3.0])))                 # sd sqrt(2), N = 2
        1.0
        >>> # var 8e38: overflow
        >>> f"{float(standard_error(torch.tensor([0.0, 4e19], dtype=torch.float32))):.3g}"
        '2e+19'
    """
    deviation = values - values.mean()
    scale = deviation.abs().max()
    if not bool(scale > 0):
        return scale
    n = values.shape[0]
    return scale * ((deviation / scale).square().sum() / (n - 1)).sqrt() / n**0.5


def mahalanobis_squared(marginal: dist.TorchDistribution, x: Tensor) -> Tensor:
    r""":math:`(x - m)^\top S^{-1} (x - m)` ``(N,)`` per row of ``x`` ``(N, d)`` under a Gaussian marginal
    (``Normal(...).to_event(1)`` or ``MultivariateNormal``).

    Example:
        >>> import torch
        >>> from pyro_smc.guides.streaming.family import gaussian
        >>> mahalanobis_squared(
        ...     gaussian(torch.zeros(2), 2 * torch.ones(2)), torch.tensor([[2.0, 4.0]])
        ... )
        tensor([5.])
    """
    diff = x - marginal.mean
    if isinstance(marginal, dist.MultivariateNormal):
        z = torch.linalg.solve_triangular(marginal.scale_tril, diff.unsqueeze(-1), upper=False).squeeze(-1)
    else:
        z = diff / marginal.base_dist.scale
    return z.square().sum(-1)


def extrapolation(previous: dist.TorchDistribution, x_prev: Tensor) -> float | None:
    """The mean squared Mahalanobis distance of the kernel's draws ``x_prev`` ``(N, d)`` under
    ``q_{t-1}`` when it exceeds ``d + EXTRAPOLATION_LIMIT`` (the regression ``U_{t-1}`` is then
    extrapolated), else ``None``. See the module's example."""
    distance = float(mahalanobis_squared(previous, x_prev).mean())
    return distance if distance > x_prev.shape[-1] + EXTRAPOLATION_LIMIT else None


def warn_extrapolated(t: int, distance: float, d: int, initialize: str) -> None:
    """Emits :class:`OnlineFilterWarning` for step ``t``, with the remedies.

    Args:
        t: the step.
        distance: :func:`extrapolation`'s value.
        d: the state dimension.
        initialize: the filter's setting (``initialize="laplace"`` is a remedy when it is another).
    """
    remedy = "more num_iterations or a smaller lr" + ("" if initialize == "laplace" else ", or initialize='laplace'")
    warnings.warn(
        OnlineFilterWarning(
            f"step {t}: the optimisation of the step failed: its backward kernel q_t(x_{{t-1}} | x_t) puts x_{{t-1}} at a "
            f"root-mean-square Mahalanobis distance of {math.sqrt(distance):.3g} from q_{{t-1}}, whose own draws (on which the "
            f"value regression U_{{t-1}} was fitted) lie at about {math.sqrt(d):.2g}. U_{{t-1}} is extrapolated there, so "
            f"log_evidence (the running ELBO) is unreliable from this step on, and can even exceed log p(y). Use {remedy}. "
            "Later such steps are listed in unreliable_steps, not warned"
        ),
        stacklevel=7,  # warn_extrapolated < lambda < mark_unreliable < record_extrapolation < assimilate < step < the caller
    )


def warn_unconverged(t: int, num_iterations: int, initialize: str) -> None:
    r"""Emits :class:`OnlineFilterWarning` for step ``t``, whose optimisation (started by
    ``initialize``, not the Laplace fit) ran all ``num_iterations`` without meeting its stopping
    rule. Its ``q_t`` can then be far from the filtering distribution, and the value regression
    fitted on its draws biased where the next kernel evaluates it: on a Poisson model with
    ``initialize="predict"`` such steps put the running ELBO 12.7 nats (6 standard errors) above
    :math:`\log p(y)`, with every kernel inside the extrapolation limit."""
    warnings.warn(
        OnlineFilterWarning(
            f"step {t}: the step's optimisation ran all num_iterations={num_iterations} iterations without meeting its "
            f"stopping rule (initialize={initialize!r}), so q_t may be far from the filtering distribution and "
            "log_evidence (the running ELBO) is unreliable from this step on: it can even exceed log p(y). Use "
            "initialize='laplace' (the default), more num_iterations or a larger lr. Later such steps are listed in "
            "unreliable_steps, not warned"
        ),
        stacklevel=5,  # warn_unconverged < lambda < mark_unreliable < step < the caller
    )
