"""The Gaussian filters and smoothers never return a non-finite answer, and every bad input or
numerical failure is a ValueError naming the argument or the time step."""

import math

import pytest
import torch

from pyro_smc.infer import (
    extended_kalman_filter,
    extended_rts_smoother,
    gaussian_filter,
    gp_adf,
    gp_rtss,
    unscented_kalman_filter,
    unscented_rts_smoother,
)
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM, time_dependent

ENGINES = {
    "ekf": extended_kalman_filter,
    "eks": extended_rts_smoother,
    "ukf": unscented_kalman_filter,
    "urtss": unscented_rts_smoother,
    "gp_adf": gp_adf,
    "gp_rtss": gp_rtss,
}


def nan_model():
    """A transition that puts NaN into the unobserved coordinate of x_6 (``f(x_5, 5)``): with
    linearisation the filter then carried NaN means at steps 6..11 and a finite evidence."""

    @time_dependent
    def f(x, t):
        bump = torch.zeros_like(x)
        bump[..., 1] = float("nan") if t == 5 else 0.0
        return 0.9 * x + bump

    eye = torch.eye(2, dtype=torch.float64)
    ssm = NonlinearGaussianSSM(f, 0.1 * eye, lambda x: x[..., :1], eye[:1, :1], torch.zeros(2, dtype=torch.float64), eye)
    return ssm, torch.randn(12, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def blowup_model():
    """``x_2 <- x_2 + x_2^3`` from ``x_2 = 1``, unobserved: the state overflows within ten steps."""

    def f(x):
        return torch.stack([0.5 * x[..., 0], x[..., 1] + x[..., 1] ** 3], -1)

    eye = torch.eye(2, dtype=torch.float64)
    ssm = NonlinearGaussianSSM(f, 0.1 * eye, lambda x: x[..., :1], eye[:1, :1], torch.tensor([0.0, 1.0], dtype=torch.float64), 0.1 * eye)
    return ssm, torch.randn(30, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def first_ekf_overflow(T=30):
    """The first step whose EKF moments are not finite, by the scalar EKF recursion of the
    unobserved coordinate of :func:`blowup_model` (its covariance stays diagonal)."""
    m, P = 1.0, 0.1
    for t in range(1, T):
        J = 1 + 3 * m * m
        m, P = m + m**3, J * J * P + 0.1
        if not (math.isfinite(m) and math.isfinite(P)):
            return t
    return None


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_non_finite_moments_are_an_error_naming_the_step(engine):
    # Before: the EKF returned NaN means at steps 6..11 with log_evidence -18.35, the EKS NaN
    # means at every step; the sigma-point ones raised a bare LinAlgError.
    ssm, ys = nan_model()
    with pytest.raises(ValueError, match=r"time step 6\b.*not finite"):
        ENGINES[engine](ssm, ys)


def test_an_overflowing_model_is_an_error_naming_the_step_where_it_overflowed():
    # Before: torch._C._LinAlgError: linalg.cholesky: ... the leading minor of order 1 is not
    # positive-definite, from every filter and smoother.
    ssm, ys = blowup_model()
    t = first_ekf_overflow()
    assert t is not None
    for engine in (extended_kalman_filter, extended_rts_smoother):
        with pytest.raises(ValueError, match=rf"time step {t}\b.*(not finite|not positive definite).*diverg"):
            engine(ssm, ys)
    for engine in (unscented_kalman_filter, unscented_rts_smoother):
        with pytest.raises(ValueError, match=r"time step \d+.*(not finite|not positive definite).*diverg"):
            engine(ssm, ys)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("observations", [torch.zeros(0, 1), []], ids=["tensor", "list"])
def test_no_time_steps_is_an_error_naming_observations(engine, observations):
    # Before: RuntimeError "stack expects a non-empty TensorList" (filters) or IndexError (smoothers).
    ssm, _ = nan_model()
    observations = observations.double() if isinstance(observations, torch.Tensor) else observations
    with pytest.raises(ValueError, match="observations.*at least one time step"):
        ENGINES[engine](ssm, observations)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_observations_of_another_dtype_are_an_error_saying_how_to_fix_it(engine):
    # Before: RuntimeError: expected m1 and m2 to have the same dtype, but got: double != float.
    eye = torch.eye(2, dtype=torch.float32)
    ssm = NonlinearGaussianSSM(torch.sin, eye, lambda x: x, eye, torch.zeros(2, dtype=torch.float32), eye)
    with pytest.raises(ValueError, match=r"observations.*torch.float64.*torch.float32.*\.to\("):
        ENGINES[engine](ssm, torch.zeros(5, 2, dtype=torch.float64))


def test_a_linear_model_that_overflows_float32_is_an_error_naming_the_step():
    # x_t = 1e3 x_{t-1}: the filtering covariance grows by 1e6 per missing step and overflows
    # float32 (3.4e38) at step 7.
    one = torch.ones(1, 1, dtype=torch.float32)
    lin = LinearGaussianSSM(1e3 * one, one, one, one, torch.zeros(1, dtype=torch.float32), one)
    ys = torch.full((12, 1), float("nan"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"time step 7\b"):
        gaussian_filter(lin, ys, "linearization")


_NEGATIVE = [[1.0, 0.0], [0.0, -0.1]]
_ASYMMETRIC = [[1.0, 0.5], [0.0, 1.0]]


@pytest.mark.parametrize(
    "name, bad",
    [("init_cov", _NEGATIVE), ("transition_cov", _NEGATIVE), ("transition_cov", _ASYMMETRIC), ("init_cov", _ASYMMETRIC), ("observation_cov", [[-0.2]])],
)
def test_a_covariance_assigned_after_construction_is_checked_at_the_call(name, bad):
    """A covariance replaced after the model was built (as learnable covariances are) with a
    negative eigenvalue in a direction the observations do not see gave the extended smoothers
    negative variances (-0.52) and a finite log-evidence, silently; an asymmetric one passed every
    engine. Now every Gaussian engine refuses it, naming the attribute."""
    from pyro_smc import EPSmoother
    from pyro_smc.infer import extended_kalman_filter, extended_rts_smoother, unscented_rts_smoother

    eye = torch.eye(2, dtype=torch.float64)
    ssm = NonlinearGaussianSSM(lambda x: 0.9 * x, 0.5 * eye, lambda x: x[..., :1], torch.eye(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), eye)
    ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))[1]
    setattr(ssm, name, torch.tensor(bad, dtype=torch.float64))
    for run in (extended_kalman_filter, extended_rts_smoother, unscented_rts_smoother, lambda m, y: EPSmoother(m, max_iter=3).smooth(y)):
        with pytest.raises(ValueError, match=name):
            run(ssm, ys)
