r"""The parallel EP schedule: every factor refitted at once, then the messages of the fitted chain.

See ``docs/math/ep.md#the-parallel-schedule``.

With ``power=1`` an EP message update is, given the factor's implicit linear model
:math:`a = J x + c + \epsilon` fitted at its cavity, the exact belief-propagation message of that linear
factor. A fixed point of EP is therefore a set of cavities at which

1. each factor's linear model is the one its projection fits at its cavity, and
2. the messages are the exact messages of the linear-Gaussian chain those models make.

The sequential schedule (:class:`~pyro_smc.infer.gaussian.sequential.SequentialSchedule`) refits one factor and then moves
one message, ``4 T`` small updates per sweep. This schedule alternates the two conditions over the
whole sequence instead: it fits all ``T - 1`` transitions and ``T`` measurements at their cavities
with one batched projection (:meth:`~pyro_smc.infer.gaussian.projections.Projection.moments_batch`), then
solves the chain exactly with :func:`~pyro_smc.ops.affine_chain.affine_chain_smoother` (a
parallel-scan Kalman filter and smoother). It has the same fixed points, so the same marginals,
evidence and implicit gradient, at a small fraction of the cost per iteration.

The cavities are what the filter and smoother hand back: the cavity of the transition out of
``t`` (everything at ``t`` but that transition's backward message) is the filtering distribution
:math:`p(x_t \mid y_{0:t})` of the fitted chain, and the cavity of the measurement at ``t`` is the
smoothed marginal divided by the measurement's message
:math:`\mathcal N^{-1}(J^\top E^{-1} (y - c), J^\top E^{-1} J)` in natural form, :math:`E = \operatorname{Cov}[\epsilon]`.
The iteration's state is these cavities in natural form, damped as EP damps its messages.
"""


from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.factors import Factors, LinearFit
from pyro_smc.infer.gaussian.observed import ObservationStatus
from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult
from pyro_smc.infer.gaussian.schedule import EPProblem, EPRun, EPSettings, FixedPointMap, WarmStart
from pyro_smc.infer.gaussian.sequential import SequentialSchedule
from pyro_smc.infer.gaussian.sites import Sites, failure_hint
from pyro_smc.infer.gaussian.smoothers import SmootherPass, smoother_pass
from pyro_smc.ops.affine_chain import affine_chain_smoother
from pyro_smc.ops.gaussian import NotPositiveDefiniteError, check_finite_steps, is_proper, moment_change, moment_change_floor, symmetrize, to_moment, to_natural
from pyro_smc.ops.kalman import mask_missing

__all__ = ["CavityLayout", "ParallelIteration", "ParallelSchedule"]


class ParallelIteration(NamedTuple):
    """One parallel iteration's output.

    Attributes:
        theta: ``(n,)`` the new cavities (natural, packed as in :class:`CavityLayout`).
        means: ``(T, d)`` the smoothed marginals of the fitted chain.
        covariances: ``(T, d, d)``.
        increments: ``(T,)`` the chain's evidence terms.
        skipped: cavities kept at their old value because the new one was not a proper Gaussian.

    Example:
        >>> import torch
        >>> ParallelIteration(
        ...     torch.zeros(3), torch.zeros(2, 1), torch.ones(2, 1, 1), torch.zeros(2), 0
        ... ).skipped
        0
    """

    theta: Tensor
    means: Tensor
    covariances: Tensor
    increments: Tensor
    skipped: int


class CavityLayout:
    """The cavities of the transitions (out of ``t = 0 .. T-2``) and of the measurements (at the
    steps with data), in natural form, as one flat vector ``theta``: etas then precisions.

    Args:
        T: time steps.
        d: state dimension.
        measured: the steps with data.
        device: where the index of ``measured`` lives.

    Example:
        >>> import torch
        >>> layout = CavityLayout(3, 1, [0, 2])
        >>> (eta_tr, _), (eta_ms, _) = layout.unpack(
        ...     layout.pack(torch.arange(4.0).reshape(4, 1), torch.ones(4, 1, 1))
        ... )
        >>> eta_tr.flatten().tolist(), eta_ms.flatten().tolist()
        ([0.0, 1.0], [2.0, 3.0])
    """

    def __init__(self, T: int, d: int, measured: list[int], device: torch.device | None = None):
        self.T, self.d, self.measured = T, d, measured
        self.n = (T - 1) + len(measured)
        self.index = torch.tensor(measured, dtype=torch.long, device=device)  # built once, used every iteration

    def pack(self, eta: Tensor, lam: Tensor) -> Tensor:
        """``(n, d)`` etas and ``(n, d, d)`` precisions as one vector."""
        return torch.cat([eta.reshape(-1), lam.reshape(-1)])

    def unpack(self, theta: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``((eta, Lambda) of the transitions, (eta, Lambda) of the measurements)``."""
        n, d, k = self.n, self.d, self.T - 1
        eta, lam = theta[: n * d].reshape(n, d), theta[n * d :].reshape(n, d, d)
        return (eta[:k], lam[:k]), (eta[k:], lam[k:])

    def of_sites(self, sites: Sites) -> Tensor:
        """The cavities of the sequential schedule's ``sites``, packed."""
        transitions = [sites.marginal(t, "bwd") for t in range(self.T - 1)]
        measurements = [sites.marginal(t, "meas") for t in self.measured]
        parts = transitions + measurements
        like = sites.messages["fwd"][0][0]
        if not parts:
            return like.new_zeros(0)
        return self.pack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))

    def locate(self, theta: Tensor) -> str | None:
        """The first improper cavity of ``theta`` in words, or ``None``."""
        (_, lam_tr), (_, lam_ms) = self.unpack(theta)
        proper = is_proper(torch.cat([lam_tr, lam_ms])).tolist()
        if all(proper):
            return None
        i = proper.index(False)
        step = i if i < self.T - 1 else self.measured[i - self.T + 1]
        return f"the cavity of the {'transition out of' if i < self.T - 1 else 'measurement at'} time step {step} is improper"


def _natural_where_proper(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`to_natural` of a batch, with the members whose ``cov`` is not positive definite
    converted from the identity instead and flagged ``False`` in the third output."""
    ok = is_proper(cov)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
    eta, lam = to_natural(mean, torch.where(ok[..., None, None], cov, eye))
    return eta, lam, ok


class _Chain(NamedTuple):
    # The fitted linear-Gaussian chain in the form of affine_chain_smoother, and its measurements
    # at the measured steps (unobserved entries made uninformative, as in the chain).
    transitions: LinearFit | None
    H: Tensor
    resid: Tensor
    R: Tensor
    mask: Tensor


class ParallelSchedule:
    """EP's parallel schedule (:class:`~pyro_smc.EPSmoother`'s ``schedule="parallel"``, plain EP,
    ``power=1``): EP's first sweep (computed as the matching Gaussian smoother; or a warm start), then iterations
    that refit every factor at its cavity and take all messages from the fitted chain. Its state
    ``theta`` is the cavities (``CavityLayout``).

    Args:
        factors: the model's factors and their projections.
        settings: ``max_iter``, ``damping`` (the largest damping; it adapts), ``tol``.

    Example:
        >>> import torch
        >>> from pyro_smc.infer.gaussian.observed import observation_status
        >>> from pyro_smc.infer.gaussian.projections import Unscented
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> ssm = LinearGaussianSSM(
        ...     0.5 * eye, eye, eye, eye, torch.zeros(1, dtype=torch.float64), eye
        ... )
        >>> _, ys = ssm.simulate(6, generator=torch.Generator().manual_seed(0))
        >>> schedule = ParallelSchedule(
        ...     Factors(ssm, Unscented()), EPSettings(5, 1.0, 1.0, 1e-8)
        ... )
        >>> run = schedule.iterate(EPProblem(ys, ~ys.isnan(), observation_status(ys)))
        >>> run.converged, torch.allclose(run.means, ssm.rts_smoother(ys).means)
        (True, True)
    """

    name = "parallel"

    def __init__(self, factors: Factors, settings: EPSettings):
        self.factors = factors
        self.settings = settings
        self.sequential = SequentialSchedule(factors, settings)

    def layout(self, problem: EPProblem) -> CavityLayout:
        """Where each cavity sits in ``theta`` for ``problem``."""
        measured = [t for t, s in enumerate(problem.status) if s != ObservationStatus.MISSING]
        return CavityLayout(problem.ys.shape[0], self.factors.ssm.state_dim, measured, problem.ys.device)

    def iterate(self, problem: EPProblem, start: WarmStart | None = None) -> EPRun:
        """The first sweep (or ``start``), then parallel iterations until ``tol`` or ``max_iter``."""
        settings, cavities = self.settings, self.layout(problem)
        first_sweep, history, converged = None, [], False
        if start is None:
            theta, first_sweep, history = self.first_sweep(problem, cavities)
            means, covs = first_sweep.means, first_sweep.covariances
        else:
            theta, means, covs = start
        # ``step``: the damping of the move the next change measures (the first sweep: none).
        # The damping adapts: halved when the change grows (refitting every factor at once can
        # overshoot where one-at-a-time updates would not), grown back towards ``damping`` when
        # it shrinks.
        gamma, step, residual = settings.damping, 1.0, float("inf")
        for _ in range(len(history), settings.max_iter):
            fitted = self.checked_iteration(cavities, theta, problem, gamma, len(history))
            change = moment_change(fitted.means, fitted.covariances, means, covs)
            theta, means, covs = fitted.theta, fitted.means, fitted.covariances
            settings.record(history, EPIteration(change, fitted.skipped))
            # The change the undamped map would make, so that damping cannot fake convergence.
            residual, previous = change / step, residual
            if residual < max(settings.tol, moment_change_floor(means.dtype)):
                converged = True
                break
            step = gamma
            gamma = max(gamma / 2, settings.damping / 8) if residual > previous else min(gamma * 1.5, settings.damping)
        return EPRun(theta, means, covs, fitted.increments, history, first_sweep, converged, gamma)

    def first_sweep(self, problem: EPProblem, cavities: CavityLayout) -> tuple[Tensor, GaussianSmootherResult, list[EPIteration]]:
        """EP's first sweep (``alpha = 1``, undamped) and the cavities it leaves: ``(theta,
        marginals, history)``.

        The first sweep is the matching Gaussian smoother, so it is computed as one
        (:func:`~pyro_smc.infer.gaussian.smoothers.smoother_pass`: a filter and one reverse scan,
        several times cheaper than ``4 T`` message updates). Its cavities: the transition's out of
        ``t`` is the filtering marginal at ``t``; the measurement's at ``t`` is the smoothed
        marginal without the measurement's message, i.e. in natural form
        ``smoothed - filtered + predicted``. Where that pass fails, or a cavity is not proper, the
        sequential schedule's first sweep runs instead (it skips such updates, or raises naming
        the site).
        """
        try:
            run = smoother_pass(self.factors.ssm, problem.ys, self.factors.projection)
            theta = self._cavities_of_pass(cavities, run)
        except (ValueError, NotPositiveDefiniteError, torch.linalg.LinAlgError):
            theta = None
        if theta is None:
            sites, first = self.sequential.sweeps(problem, sweeps=1)
            return cavities.of_sites(sites), first.first_sweep, first.history
        history: list[EPIteration] = []
        self.settings.record(history, EPIteration(float("inf"), 0))
        return theta, GaussianSmootherResult(run.means, run.covariances), history

    def _cavities_of_pass(self, cavities: CavityLayout, run: SmootherPass) -> Tensor | None:
        # The cavities of the first sweep (see first_sweep), packed; None if one is not proper.
        ssm, filtered = self.factors.ssm, run.filtered
        T = filtered.means.shape[0]
        eta_f, lam_f = to_natural(filtered.means, filtered.covariances)
        if T > 1:
            M, S, _ = filtered.predictions
            pred_mean, pred_cov = torch.cat([ssm.init_mean.unsqueeze(0), M]), torch.cat([ssm.init_cov.unsqueeze(0), S])
        else:
            pred_mean, pred_cov = ssm.init_mean.unsqueeze(0), ssm.init_cov.unsqueeze(0)
        index = cavities.index
        eta_p, lam_p = to_natural(pred_mean[index], pred_cov[index])
        eta_s, lam_s = to_natural(run.means[index], run.covariances[index])
        # At the last step the smoothed marginal is the filtered one: the cavity is the prediction.
        eta_ms, lam_ms = eta_p + (eta_s - eta_f[index]), symmetrize(lam_p + (lam_s - lam_f[index]))
        last = index == T - 1
        eta_ms = torch.where(last[:, None], eta_p, eta_ms)
        lam_ms = torch.where(last[:, None, None], lam_p, lam_ms)
        if not bool(is_proper(lam_ms).all()):
            return None
        return cavities.pack(torch.cat([eta_f[:-1], eta_ms]), torch.cat([lam_f[:-1], lam_ms]))

    def fixed_point(self, problem: EPProblem, run: EPRun) -> FixedPointMap:
        """One parallel iteration (damped by the damping the run ended with) as the map
        ``theta -> F(theta)``; it also gives the outputs."""
        cavities, skipped = self.layout(problem), []

        def step(u: Tensor) -> Tensor:
            fitted = self.iteration(cavities, u, problem, run.damping)
            skipped.append(fitted.skipped)
            return fitted.theta

        def outputs(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            fitted = self.iteration(cavities, z, problem, run.damping)
            return fitted.means, fitted.covariances, fitted.increments

        return FixedPointMap(step, outputs, skipped)

    def checked_iteration(self, cavities: CavityLayout, theta: Tensor, problem: EPProblem, gamma: float, index: int) -> ParallelIteration:
        """:meth:`iteration`, with a failed factorisation or non-finite marginals turned into a
        ``ValueError`` naming the iteration (``index``, 0-based, the first sweep counted) and the
        first cavity or time step at fault."""
        where = f"EPSmoother(schedule='parallel'): in iteration {index + 1}"
        try:
            fitted = self.iteration(cavities, theta, problem, gamma)
        except (NotPositiveDefiniteError, torch.linalg.LinAlgError) as error:
            detail = str(error).splitlines()[0]
            if "time step" not in detail:  # locate it: the first improper cavity, if any
                located = cavities.locate(theta)
                detail = f"{located} ({detail})" if located else f"solving the fitted linear-Gaussian chain failed ({detail})"
            raise ValueError(f"{where}, {detail}; {failure_hint(index)}") from error
        values = {"marginal mean": fitted.means, "marginal covariance": fitted.covariances, "log-evidence increment": fitted.increments}
        check_finite_steps(where, values, failure_hint(index))
        return fitted

    def iteration(self, cavities: CavityLayout, theta: Tensor, problem: EPProblem, gamma: float) -> ParallelIteration:
        """One iteration from the cavities ``theta``: fit every factor at its cavity, solve the
        fitted chain, and damp the cavities towards the chain's (``gamma``)."""
        ssm = self.factors.ssm
        chain = self._fit(cavities, theta, problem)
        transitions = chain.transitions
        d = cavities.d
        like = ssm.init_mean
        if transitions is None:
            F, offset, noise = like.new_zeros(0, d, d), like.new_zeros(0, d), like.new_zeros(0, d, d)
        else:
            F, offset, noise = transitions.jacobian, transitions.offset, transitions.noise
        solved = affine_chain_smoother(ssm.init_mean, ssm.init_cov, F, offset, noise, chain.H, chain.resid, chain.R, chain.mask)
        new_eta, new_lam, usable = self._new_cavities(cavities, chain, solved)
        # An update whose cavity would not be proper keeps the old cavity (counted, as in EP); so
        # does one whose marginal from the chain is not (rounding, in float32 at extreme scales).
        (eta_tr, lam_tr), (eta_ms, lam_ms) = cavities.unpack(theta)
        eta_old, lam_old = torch.cat([eta_tr, eta_ms]), torch.cat([lam_tr, lam_ms])
        eta_new = (1 - gamma) * eta_old + gamma * new_eta
        lam_new = (1 - gamma) * lam_old + gamma * new_lam
        proper = is_proper(lam_new)
        if usable is not None:
            proper = proper & usable
        skipped = int((~proper).sum())
        if skipped:
            eta_new = torch.where(proper.unsqueeze(-1), eta_new, eta_old)
            lam_new = torch.where(proper.unsqueeze(-1).unsqueeze(-1), lam_new, lam_old)
        return ParallelIteration(cavities.pack(eta_new, lam_new), solved.means, solved.covariances, solved.log_evidence_increments, skipped)

    def _fit(self, cavities: CavityLayout, theta: Tensor, problem: EPProblem) -> _Chain:
        """Every factor's implicit linear model at its cavity, as the chain to solve."""
        ys, observed = problem.ys, problem.observed
        T, d, k = cavities.T, cavities.d, cavities.T - 1
        (eta_tr, lam_tr), (eta_ms, lam_ms) = cavities.unpack(theta)
        like = self.factors.ssm.init_mean
        # 1. The transitions x_{t+1} = J x_t + c + eps at their cavities.
        transitions = self.factors.transitions_batch(*to_moment(eta_tr, lam_tr)) if k else None
        # 2. The measurements y_t = H x_t + c + eps at theirs (zero rows where unobserved).
        e = ys.shape[-1]
        H, resid = like.new_zeros(T, e, d), like.new_zeros(T, e)
        R = torch.eye(e, dtype=like.dtype, device=like.device).expand(T, e, e)
        mask = torch.zeros(T, e, dtype=torch.bool, device=like.device)
        idx = cavities.index
        if cavities.measured:
            fit = self.factors.measurements_batch(*to_moment(eta_ms, lam_ms), cavities.measured)
            obs = observed[idx]
            # Unobserved entries made uninformative once, here: the measurement messages
            # need the same masked model as the chain.
            Hm, resid_m, Rm = mask_missing(fit.jacobian, ys[idx] - fit.mean + (fit.jacobian @ fit.at.unsqueeze(-1)).squeeze(-1), fit.noise, obs)
            H, resid, R, mask = H.index_copy(0, idx, Hm), resid.index_copy(0, idx, resid_m), R.index_copy(0, idx, Rm), mask.index_copy(0, idx, obs)
        return _Chain(transitions, H, resid, R, mask)

    @staticmethod
    def _new_cavities(cavities: CavityLayout, chain: _Chain, solved) -> tuple[Tensor, Tensor, Tensor | None]:
        """The chain's cavities: the filtering distributions, and the marginals less the
        measurement messages; and which of them are proper (``None``: there are none)."""
        d, k, idx = cavities.d, cavities.T - 1, cavities.index
        like = chain.resid
        new_eta, new_lam, usable = [], [], []
        if k:
            eta, lam, ok = _natural_where_proper(solved.filtering_means[:k], solved.filtering_covariances[:k])
            new_eta.append(eta)
            new_lam.append(lam)
            usable.append(ok)
        if cavities.measured:
            Hm, Rm, rm = chain.H[idx], chain.R[idx], chain.resid[idx]
            chol, info = torch.linalg.cholesky_ex(Rm)
            if bool((info != 0).any()):
                step = cavities.measured[int((info != 0).nonzero()[0, 0])]
                raise NotPositiveDefiniteError(
                    f"the noise S - J P J^T of the measurement model fitted at time step {step} is not positive definite "
                    "(it cancels to rounding where the measurement noise is tiny next to the state's spread)"
                )
            sol = torch.cholesky_solve(torch.cat([Hm, rm.unsqueeze(-1)], -1), chol)
            eta_q, lam_q, ok = _natural_where_proper(solved.means[idx], solved.covariances[idx])
            new_eta.append(eta_q - (Hm.transpose(-1, -2) @ sol[..., -1:]).squeeze(-1))
            new_lam.append(symmetrize(lam_q - Hm.transpose(-1, -2) @ sol[..., :-1]))
            usable.append(ok)
        new_eta = torch.cat(new_eta) if new_eta else like.new_zeros(0, d)
        new_lam = torch.cat(new_lam) if new_lam else like.new_zeros(0, d, d)
        return new_eta, new_lam, torch.cat(usable) if usable else None
