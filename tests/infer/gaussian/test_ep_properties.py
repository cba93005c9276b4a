"""Properties of ``EPSmoother`` (both schedules, every projection) over drawn linear-Gaussian
problems (hypothesis).

The invariant: a clear ``ValueError`` naming the argument, the sweep or the time step, or finite
marginals equal to the RTS smoother's and an EP evidence equal to the Kalman evidence (on a linear
model every projection is exact and plain EP's fixed point is the exact posterior), to the
tolerance of ``tests/ops/test_kalman_properties.py`` (dense joint Gaussian oracle). And: the
evidence's implicit gradient equals the Kalman score. Bad observations must be refused by name.
"""

import math
import warnings

import pytest

import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc import EPSmoother
from pyro_smc.infer.gaussian.ep import EPConvergenceWarning
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM
from pyro_smc.ops.kalman import kalman_filter
from tests.infer.gaussian.test_smoothers_properties import BAD_OBSERVATIONS, PROJECTIONS, bad_observations, linear_model
from tests.ops.test_kalman_properties import assert_evidence_close, assert_gaussian_close, dense_oracle, linear_problems, model_args
from tests.property_cases import ENGINE, assert_clear_error

SCHEDULES = st.sampled_from(["sequential", "parallel"])


@ENGINE
@given(linear_problems(), PROJECTIONS, SCHEDULES, st.sampled_from([1.0, 0.6]))
def test_property_ep_equals_the_rts_smoother_and_the_kalman_evidence(problem, projection, schedule, damping):
    ssm, ys = linear_model(problem), problem["ys"].to(problem["dtype"])
    oracle = dense_oracle(problem)
    try:
        with warnings.catch_warnings():
            # The exact answer comes after one sweep; float32 rounding may keep the change above tol.
            warnings.simplefilter("ignore", EPConvergenceWarning)
            out = EPSmoother(ssm, projection=projection, schedule=schedule, damping=damping, max_iter=3).smooth(ys)
    except ValueError as error:
        assert_clear_error(error, "time step")
        return
    assert_gaussian_close(out.means, out.covariances, oracle["smoother"], problem, f"EP ({projection}, {schedule})")
    assert_evidence_close(out.log_evidence, oracle["log_evidence"], problem, f"EP ({projection}, {schedule}) log_evidence")
    assert out.log_evidence_increments.shape == problem["ys"].shape[:1]


@ENGINE
@given(linear_problems(scales=st.sampled_from([1e-3, 1.0, 1e3]), dtypes=st.just(torch.float64)), PROJECTIONS, SCHEDULES)
def test_property_the_ep_evidence_gradient_is_the_kalman_score(problem, projection, schedule):
    A, Q, C, R, m0, P0 = model_args(problem)
    ys = problem["ys"]
    leaves = [A.clone().requires_grad_(), C.clone().requires_grad_()]
    ssm = LinearGaussianSSM(leaves[0], Q, leaves[1], R, m0, P0)
    out = EPSmoother(ssm, projection=projection, schedule=schedule, tol=1e-9 * problem["scale"], max_iter=5).smooth(ys)
    assert out.converged
    if not out.log_evidence.requires_grad:  # nothing observed: the evidence is the constant 0
        assert float(out.log_evidence) == 0.0 and bool(torch.isnan(ys).all())
        return
    grads = torch.autograd.grad(out.log_evidence, leaves, allow_unused=True)
    score = torch.autograd.grad(kalman_filter(ys, leaves[0], Q, leaves[1], R, m0, P0).log_evidence, leaves, allow_unused=True)
    for name, g, s in zip("AC", grads, score):
        g = torch.zeros_like(leaves[0 if name == "A" else 1]) if g is None else g
        s = torch.zeros_like(g) if s is None else s
        bound = 1e-6 * problem["kappa"] * (1 + s.abs().max())
        assert (g - s).abs().max() <= bound, f"d log Z / d {name}: {g} vs the Kalman score {s}"


@ENGINE
@given(linear_problems(), BAD_OBSERVATIONS, PROJECTIONS, SCHEDULES)
def test_property_bad_observations_are_refused_by_name(problem, bad, projection, schedule):
    observations, name = bad_observations(problem, bad)
    try:
        EPSmoother(linear_model(problem), projection=projection, schedule=schedule).smooth(observations)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, name)
    else:
        raise AssertionError(f"{bad} observations were accepted")



def _cubic_sensor(scale: float):
    """A 1-d model with an asymmetric sensor, written in units ``scale`` times the natural ones."""
    one = torch.ones(1, 1)
    return NonlinearGaussianSSM(
        lambda x: scale * (0.9 * (x / scale) + torch.sin(x / scale)),
        0.5 * scale**2 * one,
        lambda x: scale * ((x / scale) + (x / scale) ** 3 / 10),
        0.1 * scale**2 * one,
        scale * torch.ones(1),
        2 * scale**2 * one,
    )


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_the_stopping_rule_reads_the_same_in_any_units(schedule):
    """Before: ``tol`` was an absolute change, so the model written in units of 1e-7 (every
    change below 1e-6) "converged" after 2 sweeps, its means 0.35 standard deviations and its
    log-evidence 0.25 nats from the fixed point that the model in natural units reaches (and at
    1e3 it ran 45 sweeps where 26 were enough). EP commutes with a change of units: the means
    scale, the log-evidence shifts by ``-T log(scale)``, the sweeps are the same."""
    T = 50
    ys = _cubic_sensor(1.0).simulate(T, generator=torch.Generator().manual_seed(1))[1]
    ref = EPSmoother(_cubic_sensor(1.0), schedule=schedule, max_iter=100).smooth(ys)
    assert ref.converged
    for scale in (1e-7, 1e-3, 1e3):
        out = EPSmoother(_cubic_sensor(scale), schedule=schedule, max_iter=100).smooth(ys * scale)
        assert out.converged and len(out.history) == len(ref.history)
        assert torch.allclose(out.means / scale, ref.means, atol=1e-6)
        assert torch.allclose(out.covariances / scale**2, ref.covariances, atol=1e-6)
        assert abs(float(out.log_evidence + T * math.log(scale) - ref.log_evidence)) < 1e-6

