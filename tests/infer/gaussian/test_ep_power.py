"""Power EP (``EPSmoother(power=alpha)``, sequential schedule; ``docs/math/ep.md#power-ep``).

Each message is power EP's update of the one-step factor it stands for: the measurement
likelihood, the transition integrated against what is known of the previous state (forward) and
of the next one (backward). The oracle is that update written from its definition, in moment
form: the projection of the tilted distribution ``cavity * f^alpha`` (the factor's noise divided by
``alpha``), then ``message^alpha = projected / cavity``. The schedule computes the same messages
in closed form from the implicit linear models, so the two agree to rounding, in every sweep."""

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.infer import unscented_rts_smoother
from pyro_smc.infer.gaussian.factors import Factors
from pyro_smc.infer.gaussian.projections import as_projection
from pyro_smc.models import NonlinearGaussianSSM

from .test_ep_gradients import _linear, _linear_parameters


def _natural(mean, cov):
    lam = torch.linalg.inv(cov)
    return lam @ mean, lam


def _moment(eta, lam):
    cov = torch.linalg.inv(lam)
    return cov @ eta, cov


def _oracle(ssm, ys, alpha, sweeps, projection="unscented"):
    """Power EP's sweeps from their definition: the marginals ``(T, d)``, ``(T, d, d)``.

    Messages are kept as full messages ``m_i`` in natural form; an update projects
    ``cavity * f^alpha`` with ``cavity = q / m_i^alpha`` and sets ``m_i^alpha = projected / cavity``.
    """
    factors = Factors(ssm, as_projection(projection))
    h, g = ssm.transition_fn, ssm.observation_fn
    Q, R = ssm.transition_cov, ssm.observation_cov
    T, d = ys.shape[0], ssm.state_dim
    zero = (torch.zeros(d), torch.zeros(d, d))
    fwd = [_natural(ssm.init_mean, ssm.init_cov)] + [zero] * (T - 1)
    meas, bwd = [zero] * T, [zero] * T

    def q(t, minus=None, weight=1.0):
        parts = [m[t] for m in (fwd, meas, bwd)]
        eta, lam = sum(p[0] for p in parts), sum(p[1] for p in parts)
        if minus is not None:
            eta, lam = eta - weight * minus[t][0], lam - weight * minus[t][1]
        return eta, lam

    def power_message(state, cavity):
        return (state[0] - cavity[0]) / alpha, (state[1] - cavity[1]) / alpha

    for _ in range(sweeps):
        for t in range(T):
            if t > 0:
                # The forward factor is the transition integrated against everything known of
                # x_{t-1} but what came from x_t: its projection is the prediction, a Gaussian,
                # whose power-EP message is itself.
                m, P = _moment(*q(t - 1, bwd))
                M, S, _ = factors.transition_projection.moments(h, m, P, t - 1, Q)
                fwd[t] = _natural(M, S)
            if not bool(ys[t].isnan().all()):
                cavity = q(t, meas, alpha)
                m, P = _moment(*cavity)
                mu, S_g, C = factors.observation_projection.moments(g, m, P, t, None)
                K = C @ torch.linalg.inv(S_g + R / alpha)  # f^alpha: the noise R / alpha
                state = _natural(m + K @ (ys[t] - mu), P - K @ C.T)
                meas[t] = power_message(state, cavity)
        for t in range(T - 2, -1, -1):
            # The backward factor is the transition integrated against everything known of
            # x_{t+1} but what came from x_t, lam = q(t+1) / m_fwd(t+1); powered: the transition
            # noise Q / alpha and lam^alpha.
            cavity = q(t, bwd, alpha)
            m, P = _moment(*cavity)
            M, S_h, C = factors.transition_projection.moments(h, m, P, t, None)
            Z = S_h + Q / alpha
            G = C @ torch.linalg.inv(Z)
            lam = q(t + 1, fwd)
            eta_z, lam_z = _natural(M, Z)
            mu, Sigma = _moment(eta_z + alpha * lam[0], lam_z + alpha * lam[1])
            state = _natural(m + G @ (mu - M), P + G @ (Sigma - Z) @ G.T)
            bwd[t] = power_message(state, cavity)
    moments = [_moment(*q(t)) for t in range(T)]
    return torch.stack([m for m, _ in moments]), torch.stack([P for _, P in moments])


def _scalar():
    one = torch.eye(1)
    return NonlinearGaussianSSM(lambda x: 0.8 * x + torch.sin(x), 0.5 * one, lambda x: x**2 / 4, 0.3 * one, torch.ones(1), one)


def _pendulum():
    dt = 0.1
    q = 0.5 * torch.tensor([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]])

    def step(x):
        return torch.stack([x[..., 0] + dt * x[..., 1], x[..., 1] - 9.81 * dt * torch.sin(x[..., 0])], -1)

    return NonlinearGaussianSSM(step, q, lambda x: torch.sin(x[..., :1]) + 0.3 * x[..., 1:] ** 2, 0.1 * torch.eye(1), torch.tensor([1.5, 0.0]), 0.1 * torch.eye(2))


@pytest.mark.parametrize("projection", ["unscented", "linearization"])
@pytest.mark.parametrize("model, alpha", [(_scalar, 0.5), (_scalar, 0.1), (_pendulum, 0.3)])
@pytest.mark.parametrize("sweeps", [1, 3])
def test_power_ep_sweeps_equal_the_power_ep_updates_from_their_definition(model, alpha, sweeps, projection):
    ssm = model()
    _, ys = ssm.simulate(15, generator=torch.Generator().manual_seed(4))
    ys[5] = float("nan")  # a step without data
    out = None
    for _ in range(sweeps):  # one sweep at a time, so that every sweep is checked
        out = EPSmoother(ssm, projection, max_iter=1, power=alpha).smooth(ys, init=out)
    means, covs = _oracle(ssm, ys, alpha, sweeps, projection)
    # The same updates, the closed forms against explicit inverses: rounding only.
    torch.testing.assert_close((out.means, out.covariances), (means, covs), rtol=0, atol=1e-9)


@pytest.mark.parametrize("model", [_scalar, _pendulum])
def test_first_sweep_at_power_below_one_is_not_the_smoother_and_power_one_is(model):
    # Power 1 keeps the first sweep the unscented RTS smoother; power < 1 changes it already
    # (the linearisation errors are scaled by alpha), so the first sweep depends on the power.
    ssm = model()
    _, ys = ssm.simulate(20, generator=torch.Generator().manual_seed(1))
    urts = unscented_rts_smoother(ssm, ys)
    plain = EPSmoother(ssm, "unscented", max_iter=3, power=1.0).smooth(ys).first_sweep
    torch.testing.assert_close((plain.means, plain.covariances), (urts.means, urts.covariances), rtol=0, atol=1e-10)
    powered = EPSmoother(ssm, "unscented", max_iter=3, power=0.3).smooth(ys).first_sweep
    assert (powered.covariances - urts.covariances).abs().max() > 1e-3


@pytest.mark.parametrize("alpha", [0.8, 0.3])
def test_converged_power_ep_is_a_fixed_point_of_its_sweep(alpha):
    ssm = _pendulum()
    _, ys = ssm.simulate(20, generator=torch.Generator().manual_seed(2))
    out = EPSmoother(ssm, "unscented", max_iter=300, power=alpha, tol=1e-11).smooth(ys)
    assert out.converged
    again = EPSmoother(ssm, "unscented", max_iter=1, power=alpha).smooth(ys, init=out)
    # tol bounds the last sweep's change; EP contracts, so the next one is smaller still.
    torch.testing.assert_close((again.means, again.covariances), (out.means, out.covariances), rtol=0, atol=1e-10)
    # And not the fixed point of another power: the power changes the answer.
    plain = EPSmoother(ssm, "unscented", max_iter=300, tol=1e-11).smooth(ys)
    assert (plain.means - out.means).abs().max() > 1e-4


@pytest.mark.parametrize("alpha", [1.0, 0.7, 0.3, 0.1])
@pytest.mark.parametrize("projection", ["unscented", "linearization"])
def test_power_ep_on_a_linear_gaussian_model_is_the_kalman_smoother(alpha, projection):
    # Every one-step factor of a linear-Gaussian chain is Gaussian, so power EP is exact for
    # every power, in its first sweep and at its fixed point (missing data included).
    params = [p.detach() for p in _linear_parameters(2)]
    ssm = _linear(*params)
    _, ys = ssm.simulate(20, generator=torch.Generator().manual_seed(3))
    ys[4] = float("nan")
    ys[9, 0] = float("nan")
    rts = ssm.rts_smoother(ys)
    out = EPSmoother(ssm, projection, max_iter=20, power=alpha, tol=1e-12).smooth(ys)
    assert out.converged and len(out.history) == 2  # the second sweep only confirms the first
    for result in (out.first_sweep, out):
        torch.testing.assert_close((result.means, result.covariances), (rts.means, rts.covariances), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.log_evidence, ssm.log_evidence(ys), rtol=0, atol=1e-9)

