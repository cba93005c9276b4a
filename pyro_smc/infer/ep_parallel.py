r"""The parallel EP schedule: every factor refitted at once, then the messages of the fitted chain.

See ``docs/math/ep.md#the-parallel-schedule``.

With ``power=1`` an EP message update is, given the factor's implicit linear model
``a = J x + c + eps`` fitted at its cavity, the exact belief-propagation message of that linear
factor. A fixed point of EP is therefore a set of cavities at which

1. each factor's linear model is the one its projection fits at its cavity, and
2. the messages are the exact messages of the linear-Gaussian chain those models make.

The sequential schedule (:meth:`~pyro_smc.EPSmoother._sweep`) refits one factor and then moves
one message, ``4 T`` small updates per sweep. This schedule alternates the two conditions over the
whole sequence instead: it fits all ``T - 1`` transitions and ``T`` measurements at their cavities
with one batched projection (:meth:`~pyro_smc.infer.projections.Projection.moments_batch`), then
solves the chain exactly with :func:`~pyro_smc.ops.affine_chain.affine_chain_smoother` (a
parallel-scan Kalman filter and smoother). It has the same fixed points, so the same marginals,
evidence and implicit gradient, at a small fraction of the cost per iteration.

The cavities are what the filter and smoother hand back: the cavity of the transition out of
``t`` (everything at ``t`` but that transition's backward message) is the filtering distribution
``p(x_t | y_{0:t})`` of the fitted chain, and the cavity of the measurement at ``t`` is the
smoothed marginal divided by the measurement's message ``N^{-1}(J^T E^{-1} (y - c), J^T E^{-1} J)``.
The iteration's state is these cavities in natural form, damped as EP damps its messages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.ep_sites import failure_hint
from pyro_smc.ops.affine_chain import affine_chain_smoother
from pyro_smc.ops.gaussian import NotPositiveDefiniteError, check_finite_steps, is_proper, symmetrize, to_moment, to_natural
from pyro_smc.ops.kalman import mask_missing
from pyro_smc.ops.results import EPIteration

__all__: list[str] = []  # internal: EPSmoother(schedule="parallel") is the interface


class _Fitted(NamedTuple):
    """One parallel iteration's output: the new cavities (natural, packed as in
    :class:`_Cavities`), the smoothed marginals, the evidence terms, and how many updates were
    kept at their old value because the new cavity was not a proper Gaussian."""

    theta: Tensor
    means: Tensor
    covs: Tensor
    increments: Tensor
    skipped: int


class _Cavities:
    """The cavities of the transitions (out of ``t = 0 .. T-2``) and of the measurements (at the
    steps with data), in natural form, as one flat vector ``theta``: etas then precisions."""

    def __init__(self, T: int, d: int, measured: list[int], device: torch.device | None = None):
        self.T, self.d, self.measured = T, d, measured
        self.n = (T - 1) + len(measured)
        self.index = torch.tensor(measured, dtype=torch.long, device=device)  # built once, used every iteration

    def pack(self, eta: Tensor, lam: Tensor) -> Tensor:
        return torch.cat([eta.reshape(-1), lam.reshape(-1)])

    def unpack(self, theta: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``((eta, Lambda) of the transitions, (eta, Lambda) of the measurements)``."""
        n, d, k = self.n, self.d, self.T - 1
        eta, lam = theta[: n * d].reshape(n, d), theta[n * d :].reshape(n, d, d)
        return (eta[:k], lam[:k]), (eta[k:], lam[k:])


def initial_cavities(sites, cavities: _Cavities) -> Tensor:
    """The cavities of the sequential sites ``sites`` (:class:`~pyro_smc.infer.ep_sites._Sites`)."""
    transitions = [sites.marginal(t, "bwd") for t in range(cavities.T - 1)]
    measurements = [sites.marginal(t, "meas") for t in cavities.measured]
    parts = transitions + measurements
    like = sites.messages["fwd"][0][0]
    if not parts:
        return like.new_zeros(0)
    return cavities.pack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def _natural_where_proper(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`to_natural` of a batch, with the members whose ``cov`` is not positive definite
    converted from the identity instead and flagged ``False`` in the third output."""
    ok = is_proper(cov)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
    eta, lam = to_natural(mean, torch.where(ok[..., None, None], cov, eye))
    return eta, lam, ok


def parallel_iteration(smoother, cavities: _Cavities, theta: Tensor, ys: Tensor, observed: Tensor, gamma: float) -> _Fitted:
    """One iteration of the parallel schedule from the cavities ``theta``: fit every factor at its
    cavity, solve the fitted chain, and damp the cavities towards the chain's (``gamma``)."""
    ssm = smoother.ssm
    T, d, k = cavities.T, cavities.d, cavities.T - 1
    (eta_tr, lam_tr), (eta_ms, lam_ms) = cavities.unpack(theta)
    like = ssm.init_mean
    # 1. The transitions' implicit linear models, x_{t+1} = J x_t + c + eps, at their cavities.
    if k:
        m, P = to_moment(eta_tr, lam_tr)
        M, S, C = smoother._transition_projection.moments_batch(ssm.transition_fn, m, P, range(k), ssm.transition_cov)
        F = torch.linalg.solve(P, C).transpose(-1, -2)
        offset, noise = M - (F @ m.unsqueeze(-1)).squeeze(-1), symmetrize(S - F @ C)
    else:
        F, offset, noise = like.new_zeros(0, d, d), like.new_zeros(0, d), like.new_zeros(0, d, d)
    # 2. The measurements' models y_t = H x_t + c + eps at theirs (zero rows where unobserved).
    e = ys.shape[-1]
    H, resid = like.new_zeros(T, e, d), like.new_zeros(T, e)
    R = torch.eye(e, dtype=like.dtype, device=like.device).expand(T, e, e)
    mask = torch.zeros(T, e, dtype=torch.bool, device=like.device)
    idx = cavities.index
    if cavities.measured:
        m, P = to_moment(eta_ms, lam_ms)
        mu, S, C = smoother._observation_projection.moments_batch(ssm.observation_fn, m, P, cavities.measured, ssm.observation_cov)
        Hm = torch.linalg.solve(P, C).transpose(-1, -2)
        obs = observed[idx]
        # Unobserved entries made uninformative once, here: the measurement messages below
        # need the same masked model as the chain.
        Hm, resid_m, Rm = mask_missing(Hm, ys[idx] - mu + (Hm @ m.unsqueeze(-1)).squeeze(-1), symmetrize(S - Hm @ C), obs)
        H, resid, R, mask = H.index_copy(0, idx, Hm), resid.index_copy(0, idx, resid_m), R.index_copy(0, idx, Rm), mask.index_copy(0, idx, obs)
    # 3. The exact messages of the fitted chain.
    chain = affine_chain_smoother(ssm.init_mean, ssm.init_cov, F, offset, noise, H, resid, R, mask)
    # 4. The new cavities: the filtering distributions, and the marginals less the measurement messages.
    new_eta, new_lam, usable = [], [], []
    if k:
        eta, lam, ok = _natural_where_proper(chain.filtered_means[:k], chain.filtered_covs[:k])
        new_eta.append(eta)
        new_lam.append(lam)
        usable.append(ok)
    if cavities.measured:
        Hm, Rm, rm = H[idx], R[idx], resid[idx]
        chol, info = torch.linalg.cholesky_ex(Rm)
        if bool((info != 0).any()):
            step = cavities.measured[int((info != 0).nonzero()[0, 0])]
            raise NotPositiveDefiniteError(
                f"the noise S - J P J^T of the measurement model fitted at time step {step} is not positive definite "
                "(it cancels to rounding where the measurement noise is tiny next to the state's spread)"
            )
        sol = torch.cholesky_solve(torch.cat([Hm, rm.unsqueeze(-1)], -1), chol)
        eta_q, lam_q, ok = _natural_where_proper(chain.smoothed_means[idx], chain.smoothed_covs[idx])
        new_eta.append(eta_q - (Hm.transpose(-1, -2) @ sol[..., -1:]).squeeze(-1))
        new_lam.append(symmetrize(lam_q - Hm.transpose(-1, -2) @ sol[..., :-1]))
        usable.append(ok)
    new_eta = torch.cat(new_eta) if new_eta else like.new_zeros(0, d)
    new_lam = torch.cat(new_lam) if new_lam else like.new_zeros(0, d, d)
    # An update whose cavity would not be proper keeps the old cavity (counted, as in EP); so
    # does one whose marginal from the chain is not (rounding, in float32 at extreme scales).
    eta_old, lam_old = torch.cat([eta_tr, eta_ms]), torch.cat([lam_tr, lam_ms])
    eta_new = (1 - gamma) * eta_old + gamma * new_eta
    lam_new = (1 - gamma) * lam_old + gamma * new_lam
    proper = is_proper(lam_new)
    if usable:
        proper = proper & torch.cat(usable)
    skipped = int((~proper).sum())
    if skipped:
        eta_new = torch.where(proper.unsqueeze(-1), eta_new, eta_old)
        lam_new = torch.where(proper.unsqueeze(-1).unsqueeze(-1), lam_new, lam_old)
    return _Fitted(cavities.pack(eta_new, lam_new), chain.smoothed_means, chain.smoothed_covs, chain.log_evidence_increments, skipped)


def _checked_iteration(smoother, cavities: _Cavities, theta: Tensor, ys: Tensor, observed: Tensor, gamma: float, index: int) -> _Fitted:
    """:func:`parallel_iteration`, with a failed factorisation or non-finite marginals turned into
    a ``ValueError`` naming the iteration (``index``, 0-based, the first sweep counted) and the
    first cavity or time step at fault."""
    where = f"EPSmoother(schedule='parallel'): in iteration {index + 1}"
    try:
        fitted = parallel_iteration(smoother, cavities, theta, ys, observed, gamma)
    except (NotPositiveDefiniteError, torch.linalg.LinAlgError) as error:
        detail = str(error).splitlines()[0]
        if "time step" not in detail:  # locate it: the first improper cavity, if any
            (_, lam_tr), (_, lam_ms) = cavities.unpack(theta)
            proper = is_proper(torch.cat([lam_tr, lam_ms])).tolist()
            if not all(proper):
                i = proper.index(False)
                step = i if i < cavities.T - 1 else cavities.measured[i - cavities.T + 1]
                detail = f"the cavity of the {'transition out of' if i < cavities.T - 1 else 'measurement at'} time step {step} is improper ({detail})"
            else:
                detail = f"solving the fitted linear-Gaussian chain failed ({detail})"
        raise ValueError(f"{where}, {detail}; {failure_hint(index)}") from error
    check_finite_steps(where, {"marginal mean": fitted.means, "marginal covariance": fitted.covs, "log-evidence increment": fitted.increments}, failure_hint(index))
    return fitted


def iterate_parallel(smoother, ys: Tensor, observed: Tensor, status: list, start: tuple | None = None):
    """The first sweep (or ``start``), then parallel iterations until ``tol`` or
    ``max_iter``: the cavity layout, the last cavities, the last iteration's (means,
    covariances, evidence terms), the history, the first sweep's result, whether EP converged
    and the damping reached."""
    ssm = smoother.ssm
    T = ys.shape[0]
    cavities = _Cavities(T, ssm.state_dim, [t for t in range(T) if status[t]], ys.device)
    first_sweep, history, converged = None, [], False
    if start is None:
        sites, _, history, first_sweep, _ = smoother._iterate(ys, observed, status, sweeps=1)
        means, covs = first_sweep.means, first_sweep.covariances
        theta = initial_cavities(sites, cavities)
    else:
        theta, means, covs = start
    # ``step``: the damping of the move the next change measures (the first sweep: none).
    # The damping adapts: halved when the change grows (refitting every factor at once can
    # overshoot where one-at-a-time updates would not), grown back towards ``damping`` when
    # it shrinks.
    gamma, step, residual = smoother.damping, 1.0, float("inf")
    for _ in range(len(history), smoother.max_iter):
        fitted = _checked_iteration(smoother, cavities, theta, ys, observed, gamma, len(history))
        change = max(float((fitted.means - means).detach().abs().max()), float((fitted.covs - covs).detach().abs().max()))
        theta, means, covs = fitted.theta, fitted.means, fitted.covs
        history.append(EPIteration(change, fitted.skipped))
        # The change the undamped map would make, so that damping cannot fake convergence.
        residual, previous = change / step, residual
        if residual < smoother.tol:
            converged = True
            break
        step = gamma
        gamma = max(gamma / 2, smoother.damping / 8) if residual > previous else min(gamma * 1.5, smoother.damping)
    return cavities, theta, (means, covs, fitted.increments), history, first_sweep, converged, gamma


def parallel_implicit_gradient(smoother, cavities: _Cavities, theta: Tensor, values: tuple, ys: Tensor, observed: Tensor, history: list, converged: bool, gamma: float) -> tuple:
    """``EPSmoother._with_implicit_gradient`` for the parallel schedule: its fixed point is
    differentiated through one parallel iteration (damped by ``gamma``, the damping the
    iteration ended with), which also gives the outputs."""
    skipped = []

    def iteration(u: Tensor) -> Tensor:
        fitted = parallel_iteration(smoother, cavities, u, ys, observed, gamma)
        skipped.append(fitted.skipped)
        return fitted.theta

    def outputs_at(z: Tensor) -> tuple:
        fitted = parallel_iteration(smoother, cavities, z, ys, observed, gamma)
        return fitted.means, fitted.covs, fitted.increments

    return smoother._implicit_values(iteration, outputs_at, theta, values, history, converged, skipped)
