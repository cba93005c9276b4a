"""NonlinearGaussianSSM rejects bad covariances with a ValueError naming the argument."""

import pytest
import torch

from pyro_smc.models import NonlinearGaussianSSM
from tests.models.test_linear_gaussian import BAD_COVARIANCES


# (transition_cov, negative) is already in tests/infer/gaussian/test_ep.py::test_bad_input.
NONLINEAR_BAD_COVARIANCES = [
    pytest.param(name, make, match, id=f"{name}-{kind}")
    for name in ("transition_cov", "observation_cov", "init_cov")
    for (make, match), kind in zip(BAD_COVARIANCES[:-1], ["negative", "zero", "indefinite", "asymmetric", "nan"])
    if (name, kind) != ("transition_cov", "negative")
]


@pytest.mark.parametrize("name, make, match", NONLINEAR_BAD_COVARIANCES)
def test_nonlinear_gaussian_ssm_rejects_bad_covariances(name, make, match):
    d = 2
    eye = torch.eye(d)
    kwargs = dict(transition=lambda x: x, transition_cov=eye, observation=lambda x: x, observation_cov=eye, init_mean=torch.zeros(d), init_cov=eye)
    kwargs[name] = make(d)
    with pytest.raises(ValueError, match=rf"{name}.*{match}"):
        NonlinearGaussianSSM(**kwargs)


# --- time dependence is explicit: time_dependent(fn), never guessed from the signature ---------
DT = 0.05


def _lorenz96(x, forcing=8.0):
    """One RK4 step of length DT of dx_i/dt = (x_{i+1} - x_{i-2}) x_{i-1} - x_i + forcing."""

    def rhs(z):
        return (torch.roll(z, -1, -1) - torch.roll(z, 2, -1)) * torch.roll(z, 1, -1) - z + forcing

    k1 = rhs(x)
    k2 = rhs(x + DT / 2 * k1)
    k3 = rhs(x + DT / 2 * k2)
    k4 = rhs(x + DT * k3)
    return x + DT / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _l96_ssm(transition, d=8):
    eye = torch.eye(d, dtype=torch.float64)
    init = 8 + torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return NonlinearGaussianSSM(transition, 0.05 * eye, lambda x: x[..., ::2], 0.5 * torch.eye(d // 2, dtype=torch.float64), init, eye)


F = 8.0
DEFAULT_ARGUMENT_MAPS = {
    "def f(x, forcing=8.0)": _lorenz96,
    "lambda x, F=F": lambda x, F=F: _lorenz96(x, F),
}


@pytest.mark.parametrize("name", sorted(DEFAULT_ARGUMENT_MAPS))
def test_a_map_with_a_default_second_argument_is_called_with_x_only(name):
    # Before: the map got t as its second argument (forcing = t): simulate returned NaN states
    # from step 19 on and the filters a wrong answer or a LinAlgError.
    from pyro_smc import EPSmoother
    from pyro_smc.infer import extended_kalman_filter

    plain, model = _l96_ssm(lambda x: _lorenz96(x)), _l96_ssm(DEFAULT_ARGUMENT_MAPS[name])
    xs, ys = model.simulate(150, generator=torch.Generator().manual_seed(1))
    assert bool(torch.isfinite(xs).all() and torch.isfinite(ys).all()), "simulate returned non-finite states"
    xs0, ys0 = plain.simulate(150, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close((xs, ys), (xs0, ys0), rtol=0, atol=0)
    for run in (extended_kalman_filter, lambda ssm, y: EPSmoother(ssm, projection="unscented", max_iter=3).smooth(y)):
        out, oracle = run(model, ys), run(plain, ys)
        torch.testing.assert_close((out.means, out.covariances, out.log_evidence), (oracle.means, oracle.covariances, oracle.log_evidence), rtol=0, atol=0)


def test_time_dependent_marks_a_map_that_takes_t():
    from pyro_smc.models import time_dependent

    def shift(x, t):
        return x + t

    assert time_dependent(shift) is shift  # marks it in place and returns it: usable as a decorator
    eye = torch.eye(1)

    @time_dependent
    def obs(x, t):
        return x * t

    ssm = NonlinearGaussianSSM(shift, eye, obs, eye, torch.zeros(1), eye)
    x = torch.full((4, 1), 2.0)
    torch.testing.assert_close(ssm.transition_fn(x, 3), x + 3)
    torch.testing.assert_close(ssm.observation_mean_var(x, 5)[0], 5 * x)
    assert ssm.transition_takes_time and ssm.observation_takes_time


def test_time_dependent_marks_lambdas_and_modules():
    from pyro_smc.models import time_dependent

    class Drift(torch.nn.Module):
        def forward(self, x, t):
            return 0.5 * x + t

    class Decorated(torch.nn.Module):
        @time_dependent
        def forward(self, x, t):
            return 0.5 * x - t

    eye = torch.eye(1)
    for transition, sign in ((time_dependent(Drift()), 1), (Decorated(), -1), (time_dependent(lambda x, t: 0.5 * x + t), 1)):
        ssm = NonlinearGaussianSSM(transition, eye, lambda x: x, eye, torch.zeros(1), eye)
        torch.testing.assert_close(ssm.transition_fn(torch.ones(1), 4), torch.tensor([0.5 + sign * 4]))


def test_time_dependent_refuses_what_cannot_carry_the_mark():
    from pyro_smc.models import time_dependent

    with pytest.raises(TypeError, match=r"time_dependent.*lambda x, t"):
        time_dependent(torch.sin)  # a builtin has no attributes
    with pytest.raises(TypeError, match="callable"):
        time_dependent(3.0)


@pytest.mark.parametrize("argument", ["transition", "observation"])
def test_an_unmarked_map_with_a_required_second_argument_is_an_error(argument):
    # Before: it was called as f(x, t), silently, whatever its second parameter meant.
    eye = torch.eye(1)
    maps = {"transition": lambda x: x, "observation": lambda x: x}
    maps[argument] = lambda x, t: x * t
    with pytest.raises(ValueError, match=rf"{argument}.*second required positional parameter 't'.*time_dependent"):
        NonlinearGaussianSSM(maps["transition"], eye, maps["observation"], eye, torch.zeros(1), eye)


def test_a_marked_map_that_cannot_take_t_is_an_error():
    from pyro_smc.models import time_dependent

    eye = torch.eye(1)
    with pytest.raises(ValueError, match=r"transition is marked time_dependent.*\(x, t\)"):
        NonlinearGaussianSSM(time_dependent(lambda x: x), eye, lambda x: x, eye, torch.zeros(1), eye)


@pytest.mark.parametrize("name", ["transition_cov", "observation_cov", "init_cov"])
def test_nonlinear_model_with_mixed_dtypes_is_an_error_naming_the_argument(name):
    eye = torch.eye(2, dtype=torch.float64)
    kwargs = dict(transition=lambda x: x, transition_cov=eye, observation=lambda x: x, observation_cov=eye, init_mean=torch.zeros(2, dtype=torch.float64), init_cov=eye)
    kwargs[name] = kwargs[name].float()
    with pytest.raises(ValueError, match=rf"{name} has dtype torch.float32.*init_mean.*torch.float64"):
        NonlinearGaussianSSM(**kwargs)


def test_an_observation_cov_of_the_wrong_size_is_named_beside_the_map():
    # Before: "observation must map a state of shape (3,) to shape (2,), got (3,)": the map was
    # blamed for observation_cov's size.
    eye = torch.eye(3)
    with pytest.raises(ValueError, match=r"observation maps a state of shape \(3,\) to shape \(3,\), but observation_cov is \(2, 2\)"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, torch.eye(2), torch.zeros(3), eye)


def test_an_init_mean_of_the_wrong_size_is_named_beside_the_covariance():
    # Found by tests/models/test_nonlinear_gaussian_properties.py. Before: "transition_cov must
    # have shape (2, 2), got (1, 1)" for an init_mean with one entry too many: init_mean, which
    # sets d, was not named.
    eye = torch.eye(1)
    with pytest.raises(ValueError, match=r"transition_cov must have shape \(2, 2\) \(init_mean has 2 entries\), got \(1, 1\)"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, eye, torch.zeros(2), eye)


_A = torch.tensor([[0.9, 0.2], [-0.1, 0.8]], dtype=torch.float64)


@pytest.mark.parametrize(
    "name, transition, observation, match",
    [
        ("matmul from the left", lambda x: _A @ x, lambda x: x[..., :1], "transition.*it raised"),
        ("indexing the first dim", lambda x: torch.stack([0.9 * x[0] + 0.2 * x[1], 0.8 * x[1]]), lambda x: x[..., :1], r"transition.*returned \(2, 2\)"),
        ("a slice of the first dim", lambda x: x @ _A.T, lambda x: x[:1], r"observation.*returned \(1, 2\)"),
        ("a batch statistic", lambda x: x - x.mean(0) + x.mean(), lambda x: x[..., :1], "transition.*row 0 differs"),
    ],
)
def test_a_map_written_for_one_state_is_refused(name, transition, observation, match):
    """The smoothers call the maps on batches (sigma points, copies of the state for the
    Jacobian). ``A @ x`` with ``d`` copies of a 2-d state has the right shape and the wrong
    numbers: linearisation used to run, report convergence and miss the Kalman means by 2.4."""
    eye, zero = torch.eye(2, dtype=_A.dtype), torch.zeros(2, dtype=_A.dtype)
    with pytest.raises(ValueError, match=match):
        NonlinearGaussianSSM(transition, 0.1 * eye, observation, 0.1 * eye[:1, :1], zero, eye)
    # The same maps written for batches are accepted.
    NonlinearGaussianSSM(lambda x: x @ _A.T, 0.1 * eye, lambda x: x[..., :1], 0.1 * eye[:1, :1], zero, eye)
