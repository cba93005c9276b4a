r"""One step's Monte Carlo estimate by the online variational filter, once ``phi_t`` is fitted.

See ``docs/math/streaming.md#value-function-regression`` and
``docs/math/streaming.md#monte-carlo-error-of-the-running-elbo``.

On ``N = num_regression_samples`` fresh draws of ``q_t(x_t) q_t(x_{t-1} | x_t)`` (those of the
gradient check that stopped the step's optimisation, when one did: they are draws of the guide
as fitted) the targets ``U_{t-1}(x_{t-1}) + delta`` give the running ELBO ``L_t`` (their mean)
and its standard error (this step's, combined in quadrature with the earlier steps'), ``U_t`` is
the value regression of the targets on ``x_t``, and with ``learn_parameters`` the same draws feed
the parameter update (:mod:`~pyro_smc.infer.online.learning`). A kernel that puts ``x_{t-1}``
outside the draws ``U_{t-1}`` was fitted on is recorded in ``unreliable_steps``
(:class:`~pyro_smc.infer.online.checks.OnlineFilterWarning`). The draws' state batch is carried
on to the next step.

Example:
    >>> import torch
    >>> from pyro_smc import OnlineVariationalFilter
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(3)
    >>> vf = OnlineVariationalFilter(
    ...     ssm, StreamingFilterGuide(2), num_iterations=2, num_regression_samples=64
    ... ).run(ys)
    >>> # step 2's N draws
    >>> vf.last_increments.shape, bool(vf.log_evidence_standard_error > 0)
    (torch.Size([64]), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pyro_smc.infer.online.checks import check_targets, extrapolation, standard_error, warn_extrapolated
from pyro_smc.infer.online.context import StepContext
from pyro_smc.infer.online.objective import draw, increment

if TYPE_CHECKING:
    from pyro_smc.infer.online.filter import OnlineVariationalFilter

__all__ = ["assimilate", "mark_unreliable", "record_extrapolation"]


def assimilate(vf: OnlineVariationalFilter, context: StepContext) -> None:
    """The step's estimate on fresh draws of ``vf.guide``, written into ``vf``: ``log_evidence``
    with its increment and standard error, ``last_increments``, the value regression ``U_t`` and,
    with ``learn_parameters``, the parameter update; carries the state batch on.

    Args:
        vf: the filter, after the step's optimisation (its ``t`` is the step's).
        context: the step, with its latent site discovered.

    Raises:
        ValueError: naming the step, a target that is not finite (before anything is written) or
            a parameter that the online update made not finite.
    """
    learn = vf.learn_parameters and bool(vf._learner.theta)
    checked = vf._optimiser.checked
    if checked is not None and not learn:
        # The gradient check that stopped the step drew from the guide as fitted: its draws
        # are as good as fresh ones, and their model run is already done.
        pairs, delta, state = checked.pairs, checked.delta, checked.state
    else:
        if checked is not None:
            pairs = checked.pairs
        else:
            with torch.no_grad():
                pairs = draw(vf.guide, context, vf.num_regression_samples, reparameterise=False)
        with torch.set_grad_enabled(learn):
            delta, state = increment(context, pairs)
    past = 0.0 if pairs.x_prev is None else vf._value(pairs.x_prev).reshape(-1)
    increments = delta.detach()
    targets = past + increments
    check_targets(targets, f"step {vf.t}")
    if pairs.x_prev is not None:
        record_extrapolation(vf, pairs.x_prev)
    vf.last_increments = increments
    estimate = targets.mean()
    vf.log_evidence_increment = estimate - vf.log_evidence
    vf.log_evidence = estimate
    se = standard_error(targets)
    # The first step's error is its own (the zero init() left has the default device, not the model's).
    vf.log_evidence_standard_error = se if vf.t == 0 else torch.hypot(vf.log_evidence_standard_error, se)
    vf._value = vf._value_regressor.fit(pairs.x_t, targets)
    if learn:
        vf._learner.update(delta, pairs.x_t, pairs.x_prev, vf.t)
        bad = [name for name, leaf in vf._learner.theta.items() if not bool(torch.isfinite(leaf).all())]
        if bad:
            raise ValueError(f"at step {vf.t}: the online update made parameter {bad[0]!r} not finite; use a smaller parameter_lr")
    vf._state = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in state.items()}


def record_extrapolation(vf: OnlineVariationalFilter, x_prev: Tensor) -> None:
    """Records in ``vf.unreliable_steps`` (and warns at the first) a step whose kernel puts the
    draws ``x_prev`` ``(N, d)`` of ``x_{t-1}`` outside the draws of ``q_{t-1}`` that ``U_{t-1}`` was
    fitted on (:func:`~pyro_smc.infer.online.checks.extrapolation`)."""
    distance = extrapolation(vf._previous, x_prev)
    if distance is not None:
        mark_unreliable(vf, lambda: warn_extrapolated(vf.t, distance, x_prev.shape[-1], vf.initialize))


def mark_unreliable(vf: OnlineVariationalFilter, warn: Callable[[], None]) -> None:
    """Lists the current step in ``vf.unreliable_steps`` (once) and calls ``warn`` if it is the
    stream's first: every reason a step's estimate is unreliable shares the list and the one
    warning."""
    if vf.unreliable_steps[-1:] == [vf.t]:
        return
    vf.unreliable_steps.append(vf.t)
    if len(vf.unreliable_steps) == 1:
        warn()
