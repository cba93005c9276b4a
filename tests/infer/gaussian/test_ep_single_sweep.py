"""``EPSmoother(max_iter=1)``, either schedule: one cold sweep computed as the Gaussian smoother it
equals (``SequentialSchedule.smoother_sweep``), against the sweep of ``4 T`` message updates that
computed it before (``SequentialSchedule.sweeps(sweeps=1)``, its evidence on the fitted factors),
the Kalman/RTS smoother, and the gradient of that sweep."""

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.gaussian.factors import Factors, ep_log_evidence_increments
from pyro_smc.infer.gaussian.observed import observation_status
from pyro_smc.infer.gaussian.projections import as_projection
from pyro_smc.infer.gaussian.schedule import EPProblem, EPSettings
from pyro_smc.infer.gaussian.sequential import SequentialSchedule

from .test_ep_gradients import _gp_model, _linear, _linear_parameters, _pendulum_model, _scalar_model


def _data(ssm, T, seed, missing=True):
    with torch.no_grad():
        _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(seed))
    if missing:
        ys[3] = float("nan")  # a step without data
        ys[-1] = float("nan")  # the last one too
        if ys.shape[-1] > 1:
            ys[6, 0] = float("nan")  # a partly observed step
    return ys


def _swept(ssm, ys, projection):
    """The single sweep of message updates: ``(means, covariances, increments, theta)``."""
    problem = EPProblem(ys, ~ys.isnan(), observation_status(ys))
    schedule = SequentialSchedule(Factors(ssm, as_projection(projection)), EPSettings(1, 1.0, 1.0, 1e-6))
    with pinned_posteriors(ssm.transition_fn, ssm.observation_fn):
        sites, run = schedule.sweeps(problem, sweeps=1)
        increments = ep_log_evidence_increments(ssm.init_mean, ssm.init_cov, *run.fits, ys)
    return run.means, run.covariances, increments, sites.pack()


def _check(out, ref, atol=1e-10):
    means, covs, increments, theta = ref
    assert torch.allclose(out.means, means, atol=atol, rtol=0)
    assert torch.allclose(out.covariances, covs, atol=atol, rtol=0)
    assert torch.allclose(out.log_evidence_increments, increments, atol=atol, rtol=0)
    assert torch.allclose(out.ep_state.theta, theta.detach(), atol=atol, rtol=1e-10)
    assert out.ep_state.schedule == "sequential"  # the state of a sweep, as before
    assert not out.converged and len(out.history) == 1 and out.history[0].change == float("inf") and out.history[0].skipped == 0
    assert torch.equal(out.first_sweep.means, out.means)


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
@pytest.mark.parametrize(
    "model, projection", [(_scalar_model, "unscented"), (_scalar_model, "linearization"), (_pendulum_model, "unscented"), (_pendulum_model, "linearization")]
)
def test_one_sweep_equals_the_sweep_of_message_updates_with_its_gradient(model, projection, schedule, monkeypatch):
    ssm = model()
    ys = _data(ssm, 20, 1)
    params = [p for p in ssm.parameters() if p.requires_grad]
    with monkeypatch.context() as patch:  # the smoother pass, not the message updates
        patch.setattr(SequentialSchedule, "sweep", lambda *args, **kwargs: pytest.fail("the sweep of message updates ran"))
        out = EPSmoother(ssm, projection=projection, max_iter=1, schedule=schedule).smooth(ys)
    ref = _swept(ssm, ys, projection)
    _check(out, ref)
    # The gradient of the sweep (max_iter=1 differentiates it directly).
    w = torch.linspace(-1, 1, ys.shape[0])
    for f, g in ((lambda r: r.log_evidence, lambda r: r[2].sum()), (lambda r: (w[:, None] * r.means).sum() + r.covariances.sum(), lambda r: (w[:, None] * r[0]).sum() + r[1].sum())):
        new = torch.autograd.grad(f(out), params, retain_graph=True)
        old = torch.autograd.grad(g(ref), params, retain_graph=True)
        for a, b in zip(new, old):
            assert torch.allclose(a, b, atol=1e-9, rtol=1e-9), (a, b)


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_one_sweep_on_a_linear_gaussian_model_is_kalman_rts(schedule):
    params = _linear_parameters(0)
    ssm = _linear(*params)
    ys = _data(ssm, 25, 3)
    out = EPSmoother(ssm, projection="unscented", max_iter=1, schedule=schedule).smooth(ys)
    _check(out, _swept(ssm, ys, "unscented"))
    lin = _linear(*params)  # its own graph from the parameters
    smoothed, exact = lin.rts_smoother(ys), lin.log_evidence(ys)
    assert torch.allclose(out.means, smoothed.means, atol=1e-10) and torch.allclose(out.covariances, smoothed.covariances, atol=1e-10)
    assert abs(float((out.log_evidence - exact).detach())) < 1e-10
    for a, b in zip(torch.autograd.grad(out.log_evidence, params), torch.autograd.grad(exact, params)):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-9), (a, b)


def test_one_sweep_on_a_gp_model_and_warm_start_from_it():
    ssm = _gp_model(0)
    ys = _data(ssm, 12, 5)
    out = EPSmoother(ssm, max_iter=1, schedule="parallel").smooth(ys)
    _check(out, _swept(ssm, ys, "moment_matching"))
    # Its state starts the sequential schedule as the swept one's does.
    warm = EPSmoother(ssm, max_iter=50, tol=1e-10).smooth(ys, init=out)
    cold = EPSmoother(ssm, max_iter=50, tol=1e-10).smooth(ys)
    assert warm.converged and torch.allclose(warm.means, cold.means, atol=1e-8)
