r"""The sequential EP schedule: forward-backward sweeps of single-message updates.

See ``docs/math/ep.md#the-iteration``. Each update removes one message from its marginal (the
cavity ``q / q_i^alpha``), refits the factor at the cavity (:class:`~pyro_smc.infer.gaussian.factors.Factors`)
and puts back the message the fitted linear model implies, damped. The first sweep runs without
damping; with ``power=1`` it is the matching Gaussian smoother (``docs/math/ep.md#power-ep`` for
what the power changes in it).

Example:
    >>> import torch
    >>> from pyro_smc.infer.gaussian.factors import Factors
    >>> from pyro_smc.infer.gaussian.observed import observation_status
    >>> from pyro_smc.infer.gaussian.projections import Unscented
    >>> from pyro_smc.infer.gaussian.schedule import EPProblem, EPSettings
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(1, dtype=torch.float64)
    >>> ssm = LinearGaussianSSM(
    ...     0.5 * eye, eye, eye, eye, torch.zeros(1, dtype=torch.float64), eye
    ... )
    >>> _, ys = ssm.simulate(4, generator=torch.Generator().manual_seed(0))
    >>> schedule = SequentialSchedule(
    ...     Factors(ssm, Unscented()), EPSettings(5, 1.0, 1.0, 1e-8)
    ... )
    >>> run = schedule.iterate(EPProblem(ys, ~ys.isnan(), observation_status(ys)))
    >>> run.converged, torch.allclose(run.means, ssm.rts_smoother(ys).means)
    (True, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.factors import Factors, backward_message, ep_log_evidence_increments, forward_message
from pyro_smc.infer.gaussian.observed import ObservationStatus
from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult
from pyro_smc.infer.gaussian.schedule import EPProblem, EPRun, EPSettings, FixedPointMap, WarmStart
from pyro_smc.infer.gaussian.sites import Sites, failure_hint, improper_error, in_sweep, non_finite_error, site_name
from pyro_smc.infer.gaussian.smoothers import smoother_pass
from pyro_smc.ops.gaussian import NotPositiveDefiniteError, is_proper, moment_change, moment_change_floor, symmetrize, to_natural

__all__ = ["SequentialSchedule"]


class SequentialSchedule:
    """Forward-backward sweeps of single-message EP updates (:class:`~pyro_smc.EPSmoother`'s
    ``schedule="sequential"``); its state ``theta`` is the site messages (``Sites.pack``).

    Args:
        factors: the model's factors and their projections.
        settings: ``max_iter``, ``damping``, ``power``, ``tol``.

    Example:
        See the module docstring.
    """

    name = "sequential"

    def __init__(self, factors: Factors, settings: EPSettings):
        self.factors = factors
        self.settings = settings

    def _prior(self):
        ssm = self.factors.ssm
        return to_natural(ssm.init_mean, ssm.init_cov)

    def iterate(self, problem: EPProblem, start: WarmStart | None = None) -> EPRun:
        """EP sweeps from the first one (or ``start``) until ``tol`` or ``max_iter``. A single
        cold sweep (``max_iter=1``) of plain EP (``power=1``) is computed as the Gaussian
        smoother it equals (:meth:`smoother_sweep`)."""
        if start is None and self.settings.max_iter == 1 and self.settings.power == 1.0:
            run = self.smoother_sweep(problem)
            if run is not None:
                return run
        sites, run = self.sweeps(problem, start)
        measurements, transitions = run.fits
        ssm = self.factors.ssm
        increments = ep_log_evidence_increments(ssm.init_mean, ssm.init_cov, measurements, transitions, problem.ys)
        return run._replace(increments=increments)

    def smoother_sweep(self, problem: EPProblem) -> EPRun | None:
        """The first sweep's run (its ``increments`` included) from one filter-smoother pass
        (:func:`~pyro_smc.infer.gaussian.smoothers.smoother_pass`) instead of ``4 T`` message
        updates: the same marginals, evidence and messages to rounding, several times cheaper.

        With ``alpha = 1`` the sweep leaves, in natural form, the forward message into ``t`` =
        the prediction, the measurement message = filtered - predicted, and the backward message
        = smoothed - filtered; its evidence is the filter's. ``None`` where the pass fails or one
        of those marginals is not proper: then the sweep itself runs (it skips such updates or
        raises naming the site). ``fits`` is ``None``: only the implicit gradient of later
        sweeps uses them.
        """
        ssm, (ys, _, status) = self.factors.ssm, problem
        try:
            run = smoother_pass(ssm, ys, self.factors.projection)
        except (ValueError, NotPositiveDefiniteError, torch.linalg.LinAlgError):
            return None
        filtered, T, d = run.filtered, ys.shape[0], ssm.state_dim
        pred_mean, pred_cov = ssm.init_mean.unsqueeze(0), ssm.init_cov.unsqueeze(0)
        if T > 1:
            pred_mean, pred_cov = torch.cat([pred_mean, filtered.predictions[0]]), torch.cat([pred_cov, filtered.predictions[1]])
        try:  # one batched factorisation: it tests the marginals' properness too
            eta, lam = to_natural(torch.cat([pred_mean, filtered.means, run.means]), torch.cat([pred_cov, filtered.covariances, run.covariances]))
        except NotPositiveDefiniteError:
            return None
        (eta_p, eta_f, eta_s), (lam_p, lam_f, lam_s) = eta.reshape(3, T, d), lam.reshape(3, T, d, d)
        prior = self._prior()
        measured = torch.tensor([s != ObservationStatus.MISSING for s in status], device=ys.device)
        last = torch.arange(T, device=ys.device) == T - 1
        zero = eta_p.new_zeros(())
        # The prior and the zero messages as the sweep leaves them: exact, not differences.
        eta_fwd, lam_fwd = torch.cat([prior[0].unsqueeze(0), eta_p[1:]]), torch.cat([prior[1].unsqueeze(0), lam_p[1:]])
        eta_ms = torch.where(measured[:, None], eta_f - eta_p, zero)
        lam_ms = torch.where(measured[:, None, None], symmetrize(lam_f - lam_p), zero)
        eta_bw = torch.where(last[:, None], zero, eta_s - eta_f)
        lam_bw = torch.where(last[:, None, None], zero, symmetrize(lam_s - lam_f))
        theta = torch.cat([torch.stack([eta_fwd, eta_ms, eta_bw]).reshape(-1), torch.stack([lam_fwd, lam_ms, lam_bw]).reshape(-1)])
        history: list[EPIteration] = []
        self.settings.record(history, EPIteration(float("inf"), 0))
        first = GaussianSmootherResult(run.means, run.covariances)
        return EPRun(theta, run.means, run.covariances, filtered.increments, history, first, False, self.settings.damping)

    def sweeps(self, problem: EPProblem, start: WarmStart | None = None, sweeps: int | None = None) -> tuple[Sites, EPRun]:
        """The sweeps until ``tol`` or ``sweeps`` (default ``max_iter``): the sites and the run
        (its ``increments`` not computed yet: an empty tensor)."""
        T, d = problem.ys.shape[0], self.factors.ssm.state_dim
        prior = self._prior()
        sites = Sites(prior, T, d) if start is None else Sites.unpack(prior, start.theta, T, d, problem.status)
        history: list[EPIteration] = []
        first_sweep, previous, converged = None, None if start is None else start[1:], False
        fits: tuple[list, list] = ([None] * T, [None] * T)  # the last sweep's measurement and transition models
        for sweep in range(self.settings.max_iter if sweeps is None else sweeps):
            first = sweep == 0 and start is None
            gamma = 1.0 if first else self.settings.damping
            skipped = self.sweep(sites, problem, self.settings.power, gamma, fits, sweep=len(history))
            try:
                means, covs = sites.moments()
            except NotPositiveDefiniteError as error:
                raise improper_error(sites, len(history), skipped) from error
            change = float("inf") if previous is None else moment_change(means, covs, *previous)
            if not bool(torch.isfinite(means).all() & torch.isfinite(covs).all()):  # or the sweeps would go on to max_iter
                raise non_finite_error(sites, len(history))
            self.settings.record(history, EPIteration(change, skipped))
            if first:
                first_sweep = GaussianSmootherResult(means, covs)
            previous = (means, covs)
            # The change the undamped sweep would make (as the parallel schedule measures it): a
            # sweep damped by gamma moves about gamma times as far, so heavy damping alone used to
            # stop the sweeps far from the fixed point and report them converged.
            if change / gamma < max(self.settings.tol, moment_change_floor(means.dtype)):
                converged = True
                break
        run = EPRun(sites.pack(), means, covs, means.new_zeros(0), history, first_sweep, converged, self.settings.damping, fits)
        return sites, run

    def fixed_point(self, problem: EPProblem, run: EPRun) -> FixedPointMap:
        """One sweep with ``power`` and ``damping`` as the map ``theta -> F(theta)``; the outputs
        at ``z`` are its marginals and the evidence of the factors one more sweep refits there."""
        ssm = self.factors.ssm
        T, d = problem.ys.shape[0], ssm.state_dim
        prior = self._prior()
        measurements, transitions = run.fits
        skipped: list[int] = []

        def step(theta: Tensor, fitted: tuple | None = None) -> Tensor:
            at = Sites.unpack(prior, theta, T, d, problem.status)
            fitted = (list(measurements), list(transitions)) if fitted is None else fitted
            skipped.append(self.sweep(at, problem, self.settings.power, self.settings.damping, fitted))
            return at.pack()

        def outputs(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            fitted = (list(measurements), list(transitions))
            step(z, fitted)
            at = Sites.unpack(prior, z, T, d, problem.status)
            return (*at.moments(), ep_log_evidence_increments(ssm.init_mean, ssm.init_cov, *fitted, problem.ys))

        return FixedPointMap(step, outputs, skipped)

    def sweep(self, sites: Sites, problem: EPProblem, alpha: float, gamma: float, fits: tuple[list, list], sweep: int | None = None) -> int:
        """One forward-backward pass of site updates; returns the number of updates skipped
        because a cavity or the updated marginal was not a proper Gaussian.

        Writes each measurement and transition model fitted in this sweep into
        ``fits = (measurements, transitions)`` at its step (an entry not refitted keeps the
        previous sweep's). ``sweep`` (its 0-based index) only names it in an error.
        """
        factors, (ys, observed, status) = self.factors, problem
        measurements, transitions_kept = fits
        skipped = 0
        T = ys.shape[0]
        # Each message is power EP's update of the one-step factor it stands for
        # (docs/math/ep.md#power-ep): the transition's forward and backward messages are fitted
        # at q(t) / q_bwd(t) and q(t) / q_bwd(t)^alpha, and neither changes between the forward
        # update at t + 1 and the backward one at t; with alpha = 1 they are the same cavity, so
        # the transition is projected once per sweep.
        transitions: list = [None] * T
        site = ("fwd", 0)  # the update under way, for the error message
        try:
            for t in range(T):
                if t > 0:
                    site = ("fwd", t)
                    cavity = sites.marginal(t - 1, "bwd")
                    if bool(is_proper(cavity[1])):
                        transitions[t - 1] = factors.transition(cavity, t - 1)
                        skipped += not sites.accept("fwd", t, forward_message(transitions[t - 1]), gamma)
                    else:
                        skipped += 1
                if status[t] != ObservationStatus.MISSING:
                    site = ("meas", t)
                    cavity = sites.marginal(t, "meas", alpha)
                    if bool(is_proper(cavity[1])):
                        partly = status[t] == ObservationStatus.PARTLY_OBSERVED
                        update, measurements[t] = factors.measurement(cavity, ys[t], observed[t] if partly else None, t, alpha)
                        skipped += not sites.accept("meas", t, update, gamma)
                    else:
                        skipped += 1
            for t in range(T - 2, -1, -1):
                site = ("bwd", t)
                if alpha != 1.0:
                    cavity = sites.marginal(t, "bwd", alpha)
                    transitions[t] = factors.transition(cavity, t, alpha) if bool(is_proper(cavity[1])) else None
                if transitions[t] is None:  # an improper cavity
                    skipped += 1
                    continue
                message = backward_message(transitions[t], sites.marginal(t + 1, "fwd"))
                skipped += not sites.accept("bwd", t, message, gamma)
            # The evidence's transition models: those of the backward messages, fitted at
            # q(t) / q_bwd(t)^alpha (with alpha = 1 the forward messages' too).
            transitions_kept[:] = [new or kept for new, kept in zip(transitions, transitions_kept)]
        except (NotPositiveDefiniteError, torch.linalg.LinAlgError) as error:
            kind, t = site
            raise ValueError(
                f"EPSmoother: {in_sweep(sweep)}, the update of the {site_name(kind, t)} failed "
                f"({str(error).splitlines()[0]}); {failure_hint(sweep)}"
            ) from error
        return skipped
