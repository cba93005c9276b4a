r"""Iterated expectation-propagation smoothing for nonlinear Gaussian state-space models.

See ``docs/math/ep.md#expectation-propagation`` and ``docs/math/ep.md#the-iteration``.

The posterior marginal of each state is a product of three Gaussian messages,
``q(x_t) = q_fwd(x_t) q_meas(x_t) q_bwd(x_t)``, stored in natural form ``(eta, Lambda)``
(Deisenroth and Mohamed, 2012). An EP update of message ``i`` removes it
(the cavity ``q / q_i^alpha``), projects the cavity through the factor's nonlinearity with a
:class:`~pyro_smc.infer.projections.Projection` and puts back the message the projected factor
implies. The model is any :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`
(``NonlinearGaussianSSM``, ``LinearGaussianSSM``, ...). Missing data follow the rule of
:mod:`pyro_smc.models.protocol`: an all-NaN step has no measurement message; a partly NaN one
gets the message of its observed entries.

With the paper's consistent derivatives the projection is the implicit linear model
``a = J x + c + eps``, ``J = C^T P^{-1}``, ``Cov[eps] = S_a - J P J^T`` fitted at the cavity, and
the tilted distribution is exactly Gaussian, so each new message has a closed form:

* measurement ``y_t = J x_t + c + eps``: ``Lambda = J^T Cov[eps]^{-1} J``,
  ``eta = J^T Cov[eps]^{-1} (y_t - c)``;
* forward (prediction through the transition at ``t - 1``): ``N(M, S - (1 - alpha) J P J^T)``;
* backward, given the data message ``(eta_m, Lambda_m)`` on ``x_{t+1}`` (everything at ``t + 1``
  but ``q_fwd^alpha``): with ``E = Cov[eps] / alpha`` and ``H = (I + Lambda_m E)^{-1}``,
  ``Lambda = J^T H Lambda_m J / alpha``, ``eta = J^T H (eta_m - Lambda_m c) / alpha``.
  This form never inverts ``Lambda_m``, which is singular whenever ``y`` has fewer dimensions
  than ``x``.

Every message is then positive semi-definite by construction, and a cavity is proper as long as
``q_fwd`` is (it is a prediction). The first sweep runs with ``alpha = 1`` and no damping and
equals the matching Gaussian smoother (EKS, URTSS, GP-RTSS); later sweeps use ``power`` and
``damping`` and refine the linearisation points. With ``power=1`` a linear-Gaussian model
converges in one sweep to the Kalman smoother (``power < 1`` keeps its means but not its
covariances: ``docs/math/ep.md#power-ep``).

``log_evidence`` is the EP evidence (``docs/math/ep.md#the-ep-evidence``): the exact
log-likelihood of the linear-Gaussian model that the last sweep's projections fitted, by a Kalman
filter run over it. It is the Kalman evidence on a linear-Gaussian model and, after one sweep
(``max_iter=1``), the matching Gaussian filter's evidence.

Example:
    >>> import torch
    >>> from pyro_smc import EPSmoother
    >>> from pyro_smc.infer.projections import Unscented
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> one = torch.ones(1, 1, dtype=torch.float64)
    >>> ssm = NonlinearGaussianSSM(lambda x: 0.5 * x + torch.sin(x), one, lambda x: x**2 / 20, one,
    ...                            torch.zeros(1, dtype=torch.float64), one)
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

from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.ep_parallel import iterate_parallel, parallel_implicit_gradient
from pyro_smc.infer.ep_sites import Natural, _improper, _in_sweep, _non_finite, _Sites, failure_hint, site_name
from pyro_smc.infer.gaussian_smoothers import observation_status, observed_moments
from pyro_smc.infer.projections import Projection, as_projection
from pyro_smc.models.protocol import GaussianStateSpaceModel
from pyro_smc.observations import check_observations
from pyro_smc.ops.gaussian import NotPositiveDefiniteError, check_finite_steps, is_proper, symmetrize, to_moment, to_natural
from pyro_smc.ops.fixed_point import implicit_fixed_point
from pyro_smc.ops.kalman import predict, update
from pyro_smc.ops.results import EPIteration, EPState, GaussianSmootherResult

__all__ = ["EPConvergenceWarning", "EPSmoother"]

GRADIENTS = ("implicit", "unrolled")
SCHEDULES = ("sequential", "parallel")


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
    """Iterated EP smoother (EP-EKS, EP-URTSS, EP-GPADS, ...).

    Args:
        ssm: a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`.
        projection: a :class:`~pyro_smc.infer.projections.Projection`
            (``MomentMatching()``, ``Linearization()``, ``Unscented(...)`` or a subclass), or the
            name of a default one: ``"moment_matching"`` (exact for GP components, unscented
            otherwise), ``"linearization"`` or ``"unscented"``.
        max_iter: maximum number of forward-backward sweeps (the first is the plain smoother).
        damping: ``gamma`` in ``(0, 1]``; messages move to ``(1 - gamma) old + gamma new`` in
            natural parameters from the second sweep on. 1 is no damping.
        power: ``alpha`` in ``(0, 1]`` of power EP (cavities ``q / q_i^alpha``), from the second
            sweep on. 1 is plain EP.
        tol: stop when no marginal's mean or covariance entry changed by more than this.
        unscented: deprecated (``FutureWarning``): sigma-point settings, one dict or
            ``{"transition": {...}, "observation": {...}}``; use ``projection=Unscented(...)``.
        gradient: how the results are differentiated in the model's tensors (its parameters):
            ``"implicit"`` (default) by implicit differentiation at the EP fixed point, with the
            memory of two sweeps whatever the number of sweeps; the backward pass raises if EP did
            not converge. ``"unrolled"`` through every recorded sweep (memory linear in the
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
        >>> torch.allclose(out.log_evidence, ssm.log_evidence(ys), atol=1e-5)  # the Kalman evidence
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
        unscented: dict | None = None,
        gradient: str = "implicit",
        schedule: str = "sequential",
    ):
        strategy = as_projection(projection, unscented)
        if int(max_iter) < 1:
            raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")
        for name, value in (("damping", damping), ("power", power)):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
        if not tol > 0:
            raise ValueError(f"tol must be > 0, got {tol!r}")
        if gradient not in GRADIENTS:
            raise ValueError(f"gradient must be one of {GRADIENTS}, got {gradient!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule == "parallel" and power != 1:
            raise ValueError(f'schedule="parallel" is plain EP (power=1); got power={power!r}: use schedule="sequential" for power EP')
        self.ssm = ssm
        self.projection = projection
        self.max_iter = int(max_iter)
        self.damping = float(damping)
        self.power = float(power)
        self.tol = float(tol)
        self.unscented = unscented
        self.gradient = gradient
        self.schedule = schedule
        self.strategy = strategy
        self._transition_projection = strategy.for_factor("transition")
        self._observation_projection = strategy.for_factor("observation")

    # --- one projection per factor ------------------------------------------------------------
    def _transition(self, cavity: Natural, t: int):
        """Implicit linear model of ``x_{t+1} = f(x_t) + w`` at the cavity on ``x_t``."""
        mean, cov = to_moment(*cavity)
        M, S, C = self._transition_projection.moments(self.ssm.transition_fn, mean, cov, t, self.ssm.transition_cov)
        J = torch.linalg.solve(cov, C).transpose(-1, -2)  # C^T P^{-1}
        return mean, J, M, S, symmetrize(S - J @ C)

    def _measurement(self, cavity: Natural, y: Tensor, observed: Tensor | None, t: int) -> tuple[Natural, tuple]:
        """The measurement message of ``y``'s entries where ``observed`` (``None``: all of them),
        and the implicit linear model ``(J, c, noise, y_observed)`` it comes from."""
        mean, cov = to_moment(*cavity)
        mu, S_y, C = self._observation_projection.moments(self.ssm.observation_fn, mean, cov, t, self.ssm.observation_cov)
        if observed is not None:
            y, mu, S_y, C = observed_moments(y, observed, mu, S_y, C)
        J = torch.linalg.solve(cov, C).transpose(-1, -2)
        noise = symmetrize(S_y - J @ C)
        c = mu - J @ mean
        # J^T E^{-1} [J, y - c] in one Cholesky solve.
        rhs = torch.cat([J, (y - c).unsqueeze(-1)], -1)
        sol = torch.cholesky_solve(rhs, torch.linalg.cholesky(noise))
        return (J.transpose(-1, -2) @ sol[:, -1], symmetrize(J.transpose(-1, -2) @ sol[:, :-1])), (J, c, noise, y)

    @staticmethod
    def _forward(lin, alpha: float) -> Natural:
        _, J, M, S, noise = lin
        return to_natural(M, S if alpha == 1.0 else noise + alpha * (S - noise))

    @staticmethod
    def _backward(lin, data: Natural, alpha: float) -> Natural:
        mean, J, M, _, noise = lin
        eta_m, lam_m = data
        c = M - J @ mean
        eye = torch.eye(lam_m.shape[-1], dtype=lam_m.dtype, device=lam_m.device)
        h = torch.linalg.solve(eye + lam_m @ noise / alpha, torch.cat([lam_m, (eta_m - lam_m @ c).unsqueeze(-1)], -1))
        return J.transpose(-1, -2) @ h[:, -1] / alpha, symmetrize(J.transpose(-1, -2) @ h[:, :-1] @ J) / alpha

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
            :class:`~pyro_smc.ops.results.GaussianSmootherResult` with the EP marginals,
            ``first_sweep``, ``history`` (a tuple of :class:`~pyro_smc.ops.results.EPIteration`)
            ``converged``, the EP evidence ``log_evidence`` ``()`` and its per-step terms
            ``log_evidence_increments`` ``(T,)`` (0 at a step without data): the Kalman
            prediction-error decomposition on the last sweep's linearised model
            (``docs/math/ep.md#the-ep-evidence``). A factor not refitted in the last sweep
            (improper cavity) keeps its latest earlier linearisation.

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
        ys, observed = check_observations(observations, ssm.obs_dim, like=ssm.init_mean)
        status = observation_status(observed)
        start = self._warm_start(init, status)
        implicit = self.gradient == "implicit" and self.max_iter > 1 and torch.is_grad_enabled()
        with pinned_posteriors(ssm.transition_fn, ssm.observation_fn):
            # Implicit mode iterates without a graph; the gradient comes from one more sweep.
            parallel = self.schedule == "parallel" and self.max_iter > 1
            with torch.no_grad() if implicit else contextlib.nullcontext():
                if parallel:
                    cavities, theta, (means, covs, increments), history, first_sweep, converged, gamma = iterate_parallel(self, ys, observed, status, start)
                    state = EPState("parallel", theta.detach(), tuple(status))
                else:
                    sites, models, history, first_sweep, converged = self._iterate(ys, observed, status, start)
                    means, covs = sites.moments()
                    increments = _ep_log_evidence_increments(ssm.init_mean, ssm.init_cov, models, ys)
                    state = EPState("sequential", sites.pack().detach(), tuple(status))
            if implicit and parallel:
                means, covs, increments = parallel_implicit_gradient(self, cavities, theta, (means, covs, increments), ys, observed, history, converged, gamma)
            elif implicit:
                means, covs, increments = self._with_implicit_gradient(sites, models, (means, covs, increments), ys, observed, status, history, converged)
        check_finite_steps("EPSmoother", {"marginal mean": means, "marginal covariance": covs, "log-evidence increment": increments}, failure_hint(None))
        if not converged and self.max_iter > 1:
            warnings.warn(
                f"EPSmoother: EP did not converge in max_iter={self.max_iter} sweeps (last change {history[-1].change:.3g} > "
                f"tol={self.tol:g}); the result is the last sweep's, not an EP fixed point. Raise max_iter, damp (damping < 1), "
                f"use power < 1{' (sequential schedule)' if self.schedule == 'parallel' else ''}, or keep the first sweep "
                "(max_iter=1, the Gaussian smoother); result.history has the changes",
                EPConvergenceWarning,
                stacklevel=2,
            )
        return GaussianSmootherResult(
            means, covs, first_sweep=first_sweep, history=tuple(history), converged=converged,
            log_evidence=increments.sum(0), log_evidence_increments=increments, ep_state=state,
        )

    def _warm_start(self, init: GaussianSmootherResult | None, status: list) -> tuple | None:
        """``(theta, means, covariances)`` to start from (detached), or ``None`` for a cold start."""
        if init is None:
            return None
        state = getattr(init, "ep_state", None)
        if state is None or state.schedule != (self.schedule if self.max_iter > 1 else "sequential"):
            raise ValueError(f"init must be the result of an EPSmoother with schedule={self.schedule!r} (its ep_state), got {state and state.schedule!r}")
        if tuple(state.steps) != tuple(status):
            raise ValueError("init comes from observations with other steps missing (or another length); warm starts need the same pattern")
        return state.theta, init.means.detach(), init.covariances.detach()

    def _iterate(self, ys: Tensor, observed: Tensor, status: list, start: tuple | None = None, sweeps: int | None = None):
        """The EP sweeps until ``tol`` or ``sweeps`` (default ``max_iter``), from ``start`` (see
        :meth:`_warm_start`): the sites, the last sweep's models, the history, the first sweep's
        result and whether EP converged."""
        ssm = self.ssm
        T, d, prior = ys.shape[0], ssm.state_dim, to_natural(ssm.init_mean, ssm.init_cov)
        sites = _Sites(prior, T, d) if start is None else _Sites.unpack(prior, start[0], T, d, status)
        history: list[EPIteration] = []
        first_sweep, previous, converged = None, None if start is None else start[1:], False
        models: list = [None] * (2 * ys.shape[0])  # the last sweep's measurement models, then transitions
        for sweep in range(self.max_iter if sweeps is None else sweeps):
            first = sweep == 0 and start is None
            alpha = 1.0 if first else self.power
            gamma = 1.0 if first else self.damping
            skipped = self._sweep(sites, ys, observed, status, alpha, gamma, models, sweep=len(history))
            try:
                means, covs = sites.moments()
            except NotPositiveDefiniteError as error:
                raise _improper(sites, len(history), skipped) from error
            change = float("inf") if previous is None else max(float((means - previous[0]).detach().abs().max()), float((covs - previous[1]).detach().abs().max()))
            if not bool(torch.isfinite(means).all() & torch.isfinite(covs).all()):  # or the sweeps would go on to max_iter
                raise _non_finite(sites, len(history))
            history.append(EPIteration(change, skipped))
            if first:
                first_sweep = GaussianSmootherResult(means, covs)
            previous = (means, covs)
            if change < self.tol:
                converged = True
                break
        return sites, models, history, first_sweep, converged

    def _fixed_point_error(self, history: list, converged: bool, skipped: list) -> str | None:
        """Why the implicit gradient does not exist (``None``: it does)."""
        remedy = "use power < 1" if self.schedule == "sequential" else 'try schedule="sequential"'
        if not converged:
            return (
                f"EPSmoother: EP did not converge in max_iter={self.max_iter} sweeps (last change "
                f"{history[-1].change:.3g} > tol={self.tol:g}), so its result is not a fixed point and the "
                f"implicit gradient would be wrong; raise max_iter, damp (damping < 1), {remedy}, "
                'or differentiate the sweeps themselves with gradient="unrolled"'
            )
        if sum(skipped):  # a skipped update is the identity map, not the fixed-point equation
            return "EPSmoother: an EP update was skipped at the fixed point (improper cavity), so the implicit gradient is undefined"
        return None

    def _with_implicit_gradient(self, sites: _Sites, models: list, values: tuple, ys: Tensor, observed: Tensor, status: list, history: list, converged: bool) -> tuple:
        """``values`` (means, covariances, evidence terms of the converged EP) carrying the implicit
        gradient: the fixed point ``theta* = F(theta*)`` of one sweep ``F`` is differentiated through
        one sweep with the graph, and the evidence is refitted at the result by a second one.
        The values themselves stay those of the iteration."""
        ssm = self.ssm
        T, d = ys.shape[0], ssm.state_dim
        prior = to_natural(ssm.init_mean, ssm.init_cov)
        skipped = []

        def sweep(theta: Tensor, fitted: list | None = None) -> Tensor:
            at = _Sites.unpack(prior, theta, T, d, status)
            skipped.append(self._sweep(at, ys, observed, status, self.power, self.damping, list(models) if fitted is None else fitted))
            return at.pack()

        def outputs_at(z: Tensor) -> tuple:
            fitted = list(models)
            sweep(z, fitted)
            at = _Sites.unpack(prior, z, T, d, status)
            return (*at.moments(), _ep_log_evidence_increments(ssm.init_mean, ssm.init_cov, fitted, ys))

        return self._implicit_values(sweep, outputs_at, sites.pack(), values, history, converged, skipped)

    def _implicit_values(self, iteration, outputs_at, theta: Tensor, values: tuple, history: list, converged: bool, skipped: list) -> tuple:
        """``values`` carrying the gradient of the fixed point ``theta = iteration(theta)``
        (either schedule's map; it records in ``skipped`` the updates it skipped), with
        ``outputs_at(z)`` the outputs recomputed from the differentiable fixed point ``z``. The
        values themselves stay those of the iteration."""
        error = lambda: self._fixed_point_error(history, converged, skipped)  # noqa: E731
        adjoint_tol = max(self.tol, 100 * torch.finfo(theta.dtype).eps)
        z = implicit_fixed_point(iteration, theta, tol=adjoint_tol, max_iter=max(2 * self.max_iter, 50), error=error)
        if not z.requires_grad:
            return values  # no tensor of the model requires grad: nothing to differentiate
        if error() is not None:
            # Known now (the one evaluation of ``iteration`` has run): each output gets its own
            # path to z, whose hook raises, so no refused backward pass consumes a shared graph.
            return tuple(v.detach() + 0 * z.sum() for v in values)
        return tuple(v.detach() + (g - g.detach()) for v, g in zip(values, outputs_at(z)))

    def _sweep(self, sites: _Sites, ys: Tensor, observed: Tensor, status: list, alpha: float, gamma: float, models: list, sweep: int | None = None) -> int:
        """One forward-backward pass of site updates; returns the number of updates skipped
        because a cavity or the updated marginal was not a proper Gaussian. Writes each step's
        measurement model and transition linearisation computed in this sweep into ``models[t]``
        and ``models[T + t]`` (an entry not computed keeps the previous sweep's). ``sweep`` (its
        0-based index) only names it in an error."""
        skipped = 0
        T = ys.shape[0]
        # The backward update at t uses the same cavity q(t) / q_bwd(t)^alpha as the forward
        # update at t + 1 (neither q_fwd(t), q_meas(t) nor q_bwd(t) changes in between), so
        # each transition is projected once per sweep.
        transitions: list = [None] * T
        site = ("fwd", 0)  # the update under way, for the error message
        try:
            for t in range(T):
                if t > 0:
                    site = ("fwd", t)
                    cavity = sites.marginal(t - 1, "bwd", alpha)
                    if bool(is_proper(cavity[1])):
                        transitions[t - 1] = self._transition(cavity, t - 1)
                        skipped += not sites.accept("fwd", t, self._forward(transitions[t - 1], alpha), gamma)
                    else:
                        skipped += 1
                if status[t]:
                    site = ("meas", t)
                    cavity = sites.marginal(t, "meas", alpha)
                    if bool(is_proper(cavity[1])):
                        update, models[t] = self._measurement(cavity, ys[t], observed[t] if status[t] == 1 else None, t)
                        skipped += not sites.accept("meas", t, update, gamma)
                    else:
                        skipped += 1
            models[T:] = [new or kept for new, kept in zip(transitions, models[T:])]
            for t in range(T - 2, -1, -1):
                site = ("bwd", t)
                if transitions[t] is None:  # its cavity was improper in the forward sweep
                    skipped += 1
                    continue
                skipped += not sites.accept("bwd", t, self._backward(transitions[t], sites.marginal(t + 1, "fwd", alpha), alpha), gamma)
        except (NotPositiveDefiniteError, torch.linalg.LinAlgError) as error:
            kind, t = site
            raise ValueError(
                f"EPSmoother: {_in_sweep(sweep)}, the update of the {site_name(kind, t)} failed "
                f"({str(error).splitlines()[0]}); {failure_hint(sweep)}"
            ) from error
        return skipped


def _ep_log_evidence_increments(init_mean: Tensor, init_cov: Tensor, models: list, ys: Tensor) -> Tensor:
    """The EP evidence's terms ``(T,)`` (``docs/math/ep.md#the-ep-evidence``): the Kalman filter's
    prediction-error decomposition on the implicit linear-Gaussian model of the last sweep, from
    ``N(init_mean, init_cov)``. ``models[t]`` is ``(J, c, noise, y_observed)`` or ``None`` (no
    observation), ``models[T + t]`` the transition ``(mean, J, M, S, noise)`` from ``t``."""
    T = ys.shape[0]
    m, P = init_mean, init_cov
    increments = []
    for t in range(T):
        if t > 0:
            mean, J, M, _, noise = models[T + t - 1]
            m, P = predict(m, P, J, noise)
            m = m + M - J @ mean
        increment = ys.new_zeros(())
        if models[t] is not None:
            J, c, noise, y = models[t]
            try:
                m, P, increment = update(m, P, y - c, J, noise)  # y - c = J x + v
            except torch.linalg.LinAlgError as error:
                raise ValueError(
                    f"EPSmoother: the EP evidence's Kalman filter over the fitted linear-Gaussian model failed at time step {t}: "
                    f"its innovation covariance is not positive definite; {failure_hint(1)}"
                ) from error
        increments.append(increment)
    return torch.stack(increments) if increments else ys.new_zeros(0)
