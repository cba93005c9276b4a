"""EP never returns a non-finite answer or stops short without saying so: a failure is a ValueError
naming the sweep, the time step and the message (both schedules); a run that did not converge
warns (EPConvergenceWarning)."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.models import NonlinearGaussianSSM
from tests.infer.gaussian.test_smoothers_errors import blowup_model, nan_model
from tests.models.test_nonlinear_gaussian import _lorenz96

SCHEDULES = ["sequential", "parallel"]


def _ep_convergence_warning():
    from pyro_smc.infer.gaussian.ep import EPConvergenceWarning

    return EPConvergenceWarning


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("projection", ["linearization", "unscented"])
def test_a_non_finite_message_is_an_error_naming_the_step_and_the_message(projection, schedule):
    # Before: linearization ran 10 sweeps and returned NaN means and a NaN evidence with
    # converged=False; unscented raised "cov must be positive definite (Cholesky failed)".
    ssm, ys = nan_model()
    with pytest.raises(ValueError, match=r"EPSmoother.*sweep 1.*forward message into time step 6\b.*(not finite|failed).*diverged"):
        EPSmoother(ssm, projection=projection, schedule=schedule).smooth(ys)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("projection", ["linearization", "unscented"])
def test_a_failed_factorisation_names_the_step_the_message_and_what_to_try(projection, schedule):
    # Before: ValueError "cov must be positive definite (Cholesky failed)" (linearization) or
    # "prec must be positive definite (Cholesky failed)", with no step and no hint.
    ssm, ys = blowup_model()
    message = r"EPSmoother.*sweep 1.*((forward|measurement|backward) message (into|at)|marginal at) time step \d+.*(not finite|failed|not a proper).*diverged"
    with pytest.raises(ValueError, match=message):
        EPSmoother(ssm, projection=projection, schedule=schedule).smooth(ys)


def test_a_failure_after_the_first_sweep_suggests_damping_power_and_projection():
    from pyro_smc.infer.gaussian.sites import failure_hint

    assert all(word in failure_hint(1) for word in ("damping < 1", "power < 1", "projection", "max_iter=1"))
    assert "diverged" in failure_hint(0) and "damping" not in failure_hint(0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("observations", [torch.zeros(0, 1, dtype=torch.float64), []], ids=["tensor", "list"])
def test_no_time_steps_is_an_error_naming_observations(schedule, observations):
    # Before: IndexError: list index out of range.
    ssm, _ = nan_model()
    with pytest.raises(ValueError, match="observations.*at least one time step"):
        EPSmoother(ssm, schedule=schedule).smooth(observations)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_observations_of_another_dtype_are_an_error_saying_how_to_fix_it(schedule):
    # Before: RuntimeError: Expected b and A to have the same dtype, but found b of type Double
    # and A of type Float instead.
    eye = torch.eye(2, dtype=torch.float32)
    ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(2, dtype=torch.float32), eye)
    with pytest.raises(ValueError, match=r"observations.*torch.float64.*torch.float32.*\.to\("):
        EPSmoother(ssm, schedule=schedule).smooth(torch.zeros(5, 2, dtype=torch.float64))


def _lorenz96_sine_sensor(d=20, T=20):
    eye = torch.eye(d, dtype=torch.float64)
    init = 8 + torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ssm = NonlinearGaussianSSM(_lorenz96, 0.1 * eye, torch.sin, eye, init, eye)
    return ssm, ssm.simulate(T, generator=torch.Generator().manual_seed(1))[1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_default_smoother_warns_once_when_it_stops_at_max_iter(schedule):
    # Before: EPSmoother(ssm).smooth(ys) on Lorenz-96 (d = 20) returned converged=False and said nothing.
    ssm, ys = _lorenz96_sine_sensor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = EPSmoother(ssm, schedule=schedule).smooth(ys)
    assert not out.converged and len(out.history) == 10
    ours = [w for w in caught if issubclass(w.category, _ep_convergence_warning())]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "max_iter=10" in message and "damping" in message and ours[0].filename == __file__


def test_a_converged_run_and_a_single_sweep_do_not_warn():
    ssm, ys = _lorenz96_sine_sensor(d=4, T=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ep_convergence_warning())
        assert not EPSmoother(ssm, max_iter=1).smooth(ys).converged  # one sweep by request
    eye = torch.eye(2, dtype=torch.float64)
    linear = NonlinearGaussianSSM(lambda x: 0.5 * x, eye, lambda x: x, eye, torch.zeros(2, dtype=torch.float64), eye)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ep_convergence_warning())
        assert EPSmoother(linear).smooth(torch.ones(4, 2, dtype=torch.float64)).converged


class _PyroProgram:
    """A random walk written as a Pyro init/step program: SMC's kind of model, not EP's."""

    def init(self, state):
        state["x"] = pyro.sample("x_0", dist.Normal(0.0, 1.0))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


def test_a_pyro_program_gets_a_type_error_naming_what_it_lacks():
    from pyro_smc.infer import gaussian_filter, unscented_rts_smoother

    for call in (lambda: EPSmoother(_PyroProgram()), lambda: gaussian_filter(_PyroProgram(), torch.zeros(3, 1)),
                 lambda: unscented_rts_smoother(_PyroProgram(), torch.zeros(3, 1))):
        with pytest.raises(TypeError, match=r"needs a GaussianStateSpaceModel .* _PyroProgram without state_dim, obs_dim, init_mean.*runs on SMC"):
            call()


@pytest.mark.parametrize("power, damping", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (0.5, 0.5)])
def test_the_convergence_warning_suggests_only_what_the_run_does_not_use(power, damping):
    # Before: a run at power 0.5 was told to "use power < 1", and a damped one to "damp (damping < 1)".
    from tests.test_docs_claims import _nonlinear_model_and_data

    ssm, ys = _nonlinear_model_and_data()
    with pytest.warns(_ep_convergence_warning()) as caught:
        EPSmoother(ssm, projection="unscented", max_iter=2, power=power, damping=damping).smooth(ys)
    message = str(caught[0].message)
    assert ("use power < 1" in message) == (power == 1.0)
    assert ("damp (damping < 1)" in message) == (damping == 1.0)
    assert ("damp more" in message) == (damping < 1.0)
