r"""Iterated expectation-propagation smoothing for nonlinear Gaussian state-space models.

See ``docs/math/ep.md#expectation-propagation`` and ``docs/math/ep.md#the-iteration``.

The posterior marginal of each state is a product of three Gaussian messages,
:math:`q(x_t) = q_{\mathrm{fwd}}(x_t) \, q_{\mathrm{meas}}(x_t) \, q_{\mathrm{bwd}}(x_t)`, stored in natural form :math:`(\eta, \Lambda)`
(Deisenroth and Mohamed, 2012). An EP update of message ``i`` removes it
(the cavity :math:`q / q_i^\alpha`), projects the cavity through the factor's nonlinearity with a
:class:`~pyro_smc.infer.gaussian.projections.Projection` and puts back the message the projected
factor implies (``pyro_smc.infer.gaussian.factors``). The order of the updates is a schedule:
:class:`~pyro_smc.infer.gaussian.sequential.SequentialSchedule` (sweeps of single updates) or
:class:`~pyro_smc.infer.gaussian.parallel.ParallelSchedule` (every factor at once). The model is any :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`
(``NonlinearGaussianSSM``, ``LinearGaussianSSM``, ...). Missing data follow the rule of
:mod:`pyro_smc.models.protocol`: an all-NaN step has no measurement message; a partly NaN one
gets the message of its observed entries.

With the paper's consistent derivatives the projection is the implicit linear model
:math:`a = J x + c + \epsilon`, :math:`J = C^\top P^{-1}`, :math:`\operatorname{Cov}[\epsilon] = S_a - J P J^\top` fitted at the cavity, and
the tilted distribution is exactly Gaussian, so each new message has a closed form:

* measurement :math:`y_t = J x_t + c + \epsilon`: :math:`\Lambda = J^\top \operatorname{Cov}[\epsilon]^{-1} J`,
  :math:`\eta = J^\top \operatorname{Cov}[\epsilon]^{-1} (y_t - c)`;
* forward (prediction through the transition at :math:`t - 1`, fitted at everything known of
  :math:`x_{t-1}` but :math:`q_{\mathrm{bwd}}`): :math:`\mathcal N(M, S)`;
* backward, given the data message :math:`(\eta_m, \Lambda_m)` on :math:`x_{t+1}` (everything at :math:`t + 1`
  but :math:`q_{\mathrm{fwd}}`): with :math:`E = \operatorname{Cov}[\epsilon]` and :math:`H = (I + \Lambda_m E)^{-1}`,
  :math:`\Lambda = J^\top H \Lambda_m J`, :math:`\eta = J^\top H (\eta_m - \Lambda_m c)`.
  This form never inverts :math:`\Lambda_m`, which is singular whenever ``y`` has fewer dimensions
  than ``x``.

With ``power`` :math:`\alpha < 1` (power EP, ``docs/math/ep.md#power-ep``) the measurement and backward
messages are fitted at the cavities :math:`q / q_i^\alpha` and their models' linearisation error
(:math:`\operatorname{Cov}[\epsilon]` less the model's noise covariance) is scaled by :math:`\alpha`.

Every message is then positive semi-definite by construction, and a cavity is proper as long as
:math:`q_{\mathrm{fwd}}` is (it is a prediction). The first sweep runs without damping; with ``power=1``
it equals the matching Gaussian smoother (EKS, URTSS, GP-RTSS). Later sweeps use ``damping`` and
refine the linearisation points. A linear-Gaussian model converges in one sweep to the Kalman
smoother, whatever the power.

``log_evidence`` is the EP evidence (``docs/math/ep.md#the-ep-evidence``): the exact
log-likelihood of the linear-Gaussian model that the last sweep's projections fitted, by a Kalman
filter run over it. It is the Kalman evidence on a linear-Gaussian model and, after one sweep
(``max_iter=1``), the matching Gaussian filter's evidence.

Example:
    >>> import torch
    >>> from pyro_smc import EPSmoother
    >>> from pyro_smc.infer import Unscented
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> one = torch.ones(1, 1, dtype=torch.float64)
    >>> ssm = NonlinearGaussianSSM(
    ...     lambda x: 0.5 * x + torch.sin(x),
    ...     one,
    ...     lambda x: x**2 / 20,
    ...     one,
    ...     torch.zeros(1, dtype=torch.float64),
    ...     one,
    ... )
    >>> _, ys = ssm.simulate(30, generator=torch.Generator().manual_seed(0))
    >>> out = EPSmoother(ssm, projection=Unscented(), max_iter=20).smooth(ys)
    >>> out.means.shape, len(out.history) <= 20, out.first_sweep is not None
    (torch.Size([30, 1]), True, True)
    >>> out.history[0].change
    inf
    >>> bool(torch.isfinite(out.log_evidence)), out.log_evidence_increments.shape
    (True, torch.Size([30]))

References:
    Deisenroth, Mohamed (2012). Expectation propagation in Gaussian process dynamical systems.
    Minka (2001, 2004). Expectation propagation; power EP.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import Tensor

from pyro_smc.checks import int_at_least
from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.gaussian.factors import Factors
from pyro_smc.infer.gaussian.observed import observation_status
from pyro_smc.infer.gaussian.parallel import ParallelSchedule
from pyro_smc.infer.gaussian.projections import Projection, as_projection
from pyro_smc.infer.gaussian.result import EPIteration, EPState, GaussianSmootherResult
from pyro_smc.infer.gaussian.schedule import EPProblem, EPRun, EPSettings, FixedPointMap, WarmStart
from pyro_smc.infer.gaussian.sequential import SequentialSchedule
from pyro_smc.infer.gaussian.sites import failure_hint
from pyro_smc.models.protocol import GaussianStateSpaceModel, check_noise_covariances, require_gaussian_model
from pyro_smc.observations import check_observations
from pyro_smc.ops.fixed_point import implicit_fixed_point
from pyro_smc.ops.gaussian import check_finite_steps
from pyro_smc.progress import logger, progress, progress_enabled

__all__ = ["EPConvergenceWarning", "EPSmoother"]

#: The values of ``EPSmoother(gradient=...)``.
GRADIENTS = ("implicit", "unroll")
#: The values of ``EPSmoother(schedule=...)``.
SCHEDULES = {"sequential": SequentialSchedule, "parallel": ParallelSchedule}


class EPConvergenceWarning(UserWarning):
    """:meth:`EPSmoother.smooth` stopped at ``max_iter`` without reaching ``tol``: the result is the
    last sweep's, not an EP fixed point (``result.converged`` is ``False``; ``result.history`` has
    the changes). Warned once per call.

    Example:
        >>> import warnings
        >>> issubclass(EPConvergenceWarning, UserWarning)
        True
    """


class EPSmoother:
    r"""Iterated EP smoother (EP-EKS, EP-URTSS, EP-GPADS, ...).

    Args:
        ssm: a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`.
        projection: a :class:`~pyro_smc.infer.gaussian.projections.Projection`
            (``MomentMatching()``, ``Linearization()``, ``Unscented(...)`` or a subclass), or the
            name of a default one: ``"moment_matching"`` (exact for GP components, unscented
            otherwise), ``"linearization"`` or ``"unscented"``.
        max_iter: maximum number of forward-backward sweeps (with ``power=1`` the first is the
            plain smoother).
        damping: :math:`\gamma` in ``(0, 1]``; messages move to :math:`(1 - \gamma) \, \mathrm{old} + \gamma \, \mathrm{new}` in
            natural parameters from the second sweep on. 1 is no damping.
        power: :math:`\alpha` in ``(0, 1]`` of power EP, in every sweep: the measurement and backward
            messages are fitted at the cavities :math:`q / q_i^\alpha` (nearer the marginal as
            :math:`\alpha` falls) with the linearisation error scaled by :math:`\alpha`
            (``docs/math/ep.md#power-ep``). 1 is plain EP. Exact on a linear-Gaussian model
            for every power.
        tol: stop when no marginal's mean or covariance entry changed by more than this in a
            sweep, in units of the marginal's spread (a mean by ``tol`` standard deviations, a
            covariance entry by ``tol`` times the product of two; :func:`~pyro_smc.ops.gaussian.moment_change`),
            so that the rule reads the same in any units of the state (floored at 100 machine
            epsilons, :func:`~pyro_smc.ops.gaussian.moment_change_floor`: 1.2e-5 in float32); the change is divided by the
            sweep's damping (what the undamped sweep would change), so that heavy damping cannot stop
            the sweeps early.
        gradient: how the results are differentiated in the model's tensors (its parameters):
            ``"implicit"`` (default) by implicit differentiation at the EP fixed point, with the
            memory of two sweeps whatever the number of sweeps; the backward pass raises if EP did
            not converge. ``"unroll"`` through every recorded sweep (memory linear in the
            sweeps; exact for the truncated iteration; the implicit gradient's test oracle).
            ``docs/math/ep.md#the-gradient-of-the-ep-evidence``. With ``max_iter=1`` both
            differentiate the single sweep.
        schedule: the order of the updates after the first sweep. ``"sequential"`` (default):
            forward-backward sweeps of single-message updates. ``"parallel"``: each iteration
            refits every factor at its cavity in one batched projection and then takes all
            messages of the fitted linear-Gaussian chain from a parallel-scan Kalman smoother
            (``docs/math/ep.md#the-parallel-schedule``); the same fixed points, far fewer
            operations per iteration. Requires ``power=1``. ``history`` counts the first
            sweep and then the parallel iterations.
        progress_bar: a tqdm bar over the sweeps of :meth:`smooth` (its postfix the last
            change): ``None`` (default) in interactive use only, ``True`` always, ``False``
            never (:mod:`pyro_smc.progress`). Each sweep is also logged at ``DEBUG`` to the
            ``pyro_smc`` logger.

    An update whose cavity is not a proper Gaussian is skipped; one that would make the marginal
    improper is retried with the damping halved (up to three times) and then skipped. Both are
    counted in ``history[k].skipped``.

    Raises:
        ValueError: ``max_iter < 1``, ``damping`` or ``power`` outside ``(0, 1]``, ``tol <= 0``,
            an unknown projection name, an unknown ``gradient`` or ``schedule``, or
            ``schedule="parallel"`` with ``power < 1``.

    Example:
        On a linear-Gaussian model EP converges to the Kalman (RTS) smoother:

        >>> import torch
        >>> from pyro_smc import EPSmoother
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> _, ys = ssm.simulate(5)                                   # (T, dy)
        >>> out = EPSmoother(ssm).smooth(ys)
        >>> out.means.shape, out.covariances.shape                    # (T, d), (T, d, d)
        (torch.Size([5, 1]), torch.Size([5, 1, 1]))
        >>> out.converged, torch.allclose(out.means, ssm.rts_smoother(ys).means, atol=1e-5)
        (True, True)
        >>> # the Kalman evidence
        >>> torch.allclose(out.log_evidence, ssm.log_evidence(ys), atol=1e-5)
        True

        The evidence is differentiable in the model's tensors; here its gradient is the Kalman score:

        >>> a = torch.tensor(0.5, requires_grad=True)
        >>> def lin():                        # a new graph from ``a`` for each backward pass
        ...     return LinearGaussianSSM(a * eye, eye, eye, eye, torch.zeros(1), eye)
        >>> grad, = torch.autograd.grad(EPSmoother(lin()).smooth(ys).log_evidence, a)
        >>> score, = torch.autograd.grad(lin().log_evidence(ys), a)
        >>> torch.allclose(grad, score, atol=1e-5)
        True
    """


    def __init__(
        self,
        ssm: GaussianStateSpaceModel,
        projection: Projection | str = "moment_matching",
        max_iter: int = 10,
        damping: float = 1.0,
        power: float = 1.0,
        tol: float = 1e-6,
        gradient: str = "implicit",
        schedule: str = "sequential",
        progress_bar: bool | None = None,
    ):
        strategy = as_projection(projection)
        max_iter = int_at_least("max_iter", max_iter, 1)
        for name, value in (("damping", damping), ("power", power)):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
        if not tol > 0:
            raise ValueError(f"tol must be > 0, got {tol!r}")
        if gradient not in GRADIENTS:
            raise ValueError(f"gradient must be one of {GRADIENTS}, got {gradient!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        if schedule == "parallel" and power != 1:
            raise ValueError(f'schedule="parallel" is plain EP (power=1); got power={power!r}: use schedule="sequential" for power EP')
        require_gaussian_model(ssm, "EPSmoother")
        self.ssm = ssm
        self.projection = projection
        self.max_iter = int(max_iter)
        self.damping = float(damping)
        self.power = float(power)
        self.tol = float(tol)
        self.gradient = gradient
        self.schedule = schedule
        self.strategy = strategy
        self.progress_bar = progress_bar
        progress_enabled(progress_bar)  # its TypeError, at construction

    def _schedule(self, on_iteration=None) -> SequentialSchedule | ParallelSchedule:
        """The schedule object of this run: built per call, so that a changed attribute (a fit's
        copy with ``gradient="unroll"``, another ``max_iter``) takes effect. With one sweep
        there is nothing to schedule in parallel: the sequential schedule computes that sweep as
        one smoother pass (``SequentialSchedule.smoother_sweep``), with the sweep's state."""
        settings = EPSettings(self.max_iter, self.damping, self.power, self.tol, on_iteration)
        kind = SCHEDULES[self.schedule] if self.max_iter > 1 else SequentialSchedule
        return kind(Factors(self.ssm, self.strategy), settings)

    # --- the sweeps -------------------------------------------------------------------------
    def smooth(self, observations: Tensor, init: GaussianSmootherResult | None = None) -> GaussianSmootherResult:
        """Runs EP on ``observations`` ``(T, e)`` (NaN entries are missing; a list of ``(e,)``
        tensors and ``None`` works too).

        Args:
            observations: ``(T, e)``.
            init: a warm start: an earlier result of an ``EPSmoother`` with the same ``schedule``
                on observations with the same steps missing, typically of the same data under
                slightly different parameters (a fit's previous step). EP starts from where that
                run stopped (its ``ep_state``) instead of from the first sweep, so there is no
                ``first_sweep`` and fewer iterations to go. The fixed point is the same when EP
                has a single one.

        Returns:
            :class:`~pyro_smc.infer.gaussian.result.GaussianSmootherResult` with the EP marginals,
            ``first_sweep``, ``history`` (a tuple of
            :class:`~pyro_smc.infer.gaussian.result.EPIteration`), ``converged``, the EP evidence
            ``log_evidence`` ``()`` and its per-step terms ``log_evidence_increments`` ``(T,)``
            (0 at a step without data): the Kalman prediction-error decomposition on the last
            sweep's linearised model (``docs/math/ep.md#the-ep-evidence``). A factor not refitted
            in the last sweep (improper cavity) keeps its latest earlier linearisation.

            With ``gradient="implicit"`` (and ``max_iter > 1``) the means, covariances and
            evidence are differentiable in every tensor the model uses, by implicit
            differentiation at the fixed point (``docs/math/ep.md#the-gradient-of-the-ep-evidence``);
            ``first_sweep`` is then detached. If EP did not converge, their backward pass raises.
            ``ep_state`` is where the iteration stopped, for ``init=``.

        Raises:
            ValueError: ``init`` without an ``ep_state`` of this schedule and missing-data pattern;
                observations of the wrong shape, with no time step, or of another dtype or device
                than the model's; a message, marginal or evidence term that is not finite, or an
                update whose factorisation fails (naming the sweep, the time step and the message,
                with what to try).

        Warns:
            EPConvergenceWarning: EP stopped at ``max_iter`` (> 1) without reaching ``tol``; once
                per call. ``converged`` is then ``False``.
        """
        ssm = self.ssm
        check_noise_covariances(ssm, "EPSmoother")
        ys, observed = check_observations(observations, ssm.obs_dim, like=ssm.init_mean)
        problem = EPProblem(ys, observed, observation_status(ys))
        bar = progress(desc=f"EPSmoother ({self.schedule})", total=self.max_iter, enabled=progress_enabled(self.progress_bar))
        with bar:
            run, values, schedule = self._iterate(problem, init, _Reporter(bar))
        means, covs, increments = values
        check_finite_steps("EPSmoother", {"marginal mean": means, "marginal covariance": covs, "log-evidence increment": increments}, failure_hint(None))
        if not run.converged and self.max_iter > 1:
            warnings.warn(
                f"EPSmoother: EP did not converge in max_iter={self.max_iter} sweeps (last change {run.history[-1].change:.3g} > "
                f"tol={self.tol:g}); the result is the last sweep's, not an EP fixed point. Raise max_iter, "
                f"{'damp more (lower damping)' if self.damping < 1 else 'damp (damping < 1)'}"
                f"{'' if self.power < 1 else ', use power < 1' + (' (sequential schedule)' if self.schedule == 'parallel' else '')}"
                ", or keep the first sweep (max_iter=1; with power=1 the Gaussian smoother); result.history has the changes",
                EPConvergenceWarning,
                stacklevel=2,
            )
        return GaussianSmootherResult(
            means, covs, first_sweep=run.first_sweep, history=tuple(run.history), converged=run.converged,
            log_evidence=increments.sum(0), log_evidence_increments=increments,
            ep_state=EPState(schedule.name, run.theta.detach(), tuple(problem.status)),
        )

    def _iterate(self, problem: EPProblem, init: GaussianSmootherResult | None, on_iteration) -> tuple:
        """The schedule's run from ``init`` (or cold), its outputs with their gradient, and the
        schedule: ``(run, (means, covariances, increments), schedule)``."""
        ssm = self.ssm
        schedule = self._schedule(on_iteration)
        start = self._warm_start(init, schedule.name, problem)
        implicit = self.gradient == "implicit" and self.max_iter > 1 and torch.is_grad_enabled()
        with pinned_posteriors(ssm.transition_fn, ssm.observation_fn):
            # Implicit mode iterates without a graph; the gradient comes from one more sweep.
            with torch.no_grad() if implicit else contextlib.nullcontext():
                run = schedule.iterate(problem, start)
            values = (run.means, run.covariances, run.increments)
            if implicit:
                values = self._with_implicit_gradient(schedule.fixed_point(problem, run), run)
        return run, values, schedule

    def _warm_start(self, init: GaussianSmootherResult | None, schedule: str, problem: EPProblem) -> WarmStart | None:
        """Where to start from (detached), or ``None`` for a cold start."""
        if init is None:
            return None
        state = getattr(init, "ep_state", None)
        if state is None or state.schedule != schedule:
            raise ValueError(f"init must be the result of an EPSmoother with schedule={self.schedule!r} (its ep_state), got {state and state.schedule!r}")
        if tuple(state.steps) != tuple(problem.status):
            raise ValueError("init comes from observations with other steps missing (or another length); warm starts need the same pattern")
        d, dtype = self.ssm.state_dim, problem.ys.dtype
        if init.means.shape[-1] != d or init.means.dtype != dtype:
            raise ValueError(
                f"init comes from a model with {init.means.shape[-1]}-dimensional states in {init.means.dtype}, this one has "
                f"{d}-dimensional states in {dtype}: warm starts need a result of the same model"
            )
        return WarmStart(state.theta, init.means.detach(), init.covariances.detach())

    def _fixed_point_error(self, run: EPRun, skipped: list) -> str | None:
        """Why the implicit gradient does not exist (``None``: it does)."""
        remedy = "use power < 1" if self.schedule == "sequential" else 'try schedule="sequential"'
        if not run.converged:
            return (
                f"EPSmoother: EP did not converge in max_iter={self.max_iter} sweeps (last change "
                f"{run.history[-1].change:.3g} > tol={self.tol:g}), so its result is not a fixed point and the "
                f"implicit gradient would be wrong; raise max_iter, damp (damping < 1), {remedy}, "
                'or differentiate the sweeps themselves with gradient="unroll"'
            )
        if sum(skipped):  # a skipped update is the identity map, not the fixed-point equation
            return "EPSmoother: an EP update was skipped at the fixed point (improper cavity), so the implicit gradient is undefined"
        return None

    def _with_implicit_gradient(self, fixed_point: FixedPointMap, run: EPRun) -> tuple:
        r"""The run's (means, covariances, evidence terms) carrying the gradient of the fixed point
        :math:`\theta = F(\theta)` of the schedule's map, with the outputs recomputed from the
        differentiable fixed point ``z``. The values themselves stay those of the iteration."""
        values = (run.means, run.covariances, run.increments)
        error = lambda: self._fixed_point_error(run, fixed_point.skipped)  # noqa: E731
        adjoint_tol = max(self.tol, 100 * torch.finfo(run.theta.dtype).eps)
        z = implicit_fixed_point(fixed_point.step, run.theta, tol=adjoint_tol, max_iter=max(2 * self.max_iter, 50), error=error)
        if not z.requires_grad:
            return values  # no tensor of the model requires grad: nothing to differentiate
        if error() is not None:
            # Known now (the one evaluation of ``step`` has run): each output gets its own
            # path to z, whose hook raises, so no refused backward pass consumes a shared graph.
            return tuple(v.detach() + 0 * z.sum() for v in values)
        return tuple(v.detach() + (g - g.detach()) for v, g in zip(values, fixed_point.outputs(z)))


class _Reporter:
    """Called with each sweep as it is recorded: the bar moves on and the sweep is logged."""

    def __init__(self, bar):
        self.bar, self.count = bar, 0

    def __call__(self, iteration: EPIteration) -> None:
        self.count += 1
        self.bar.update(1)
        self.bar.set_postfix(change=f"{iteration.change:.3g}", refresh=False)
        logger.debug("EPSmoother: sweep %d, largest change %.3g, %d updates skipped", self.count, iteration.change, iteration.skipped)
