"""Properties of the Gaussian filters and smoothers (EKF/EKS, UKF/URTSS, GP-ADF/GP-RTSS) over drawn
linear-Gaussian problems (hypothesis).

The invariant: a clear ``ValueError`` naming the argument or the time step, or a finite answer
equal to the Kalman filter's and RTS smoother's (every projection is exact on a linear model), to
the tolerance derived from the dtype and the conditioning in ``tests/ops/test_kalman_properties.py``,
whose dense joint Gaussian is the oracle here too. The problems: dimensions 1-3, float32 and
float64, T in {1, 2, 5}, missing rows and entries, covariances at scales 1e-6 .. 1e6. Bad inputs
(T = 0, observations of the wrong shape or dtype, inf) must be refused by name.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.infer import gaussian_filter, gaussian_smoother
from pyro_smc.models import LinearGaussianSSM
from tests.ops.test_kalman_properties import assert_evidence_close, assert_gaussian_close, dense_oracle, linear_problems, model_args
from tests.property_cases import ENGINE, assert_clear_error

PROJECTIONS = st.sampled_from(["linearization", "unscented", "moment_matching"])


def linear_model(problem):
    return LinearGaussianSSM(*model_args(problem))


@ENGINE
@given(linear_problems(), PROJECTIONS)
def test_property_filters_and_smoothers_equal_kalman_on_linear_models(problem, projection):
    ssm, ys = linear_model(problem), problem["ys"].to(problem["dtype"])
    oracle = dense_oracle(problem)
    try:
        filtered = gaussian_filter(ssm, ys, projection)
        smoothed = gaussian_smoother(ssm, ys, projection)
    except ValueError as error:
        assert_clear_error(error, "time step")
        return
    assert_gaussian_close(filtered.means, filtered.covariances, oracle["filter"], problem, f"{projection} filter")
    assert_gaussian_close(smoothed.means, smoothed.covariances, oracle["smoother"], problem, f"{projection} smoother")
    assert_evidence_close(filtered.log_evidence, oracle["log_evidence"], problem, f"{projection} log_evidence")
    assert torch.equal(smoothed.log_evidence, filtered.log_evidence)
    steps_without_data = torch.isnan(problem["ys"]).all(-1)
    assert bool((filtered.log_evidence_increments[steps_without_data] == 0).all())


BAD_OBSERVATIONS = st.sampled_from(["T=0", "empty list", "dtype", "width", "rank", "inf"])


def bad_observations(problem, bad):
    """``(observations, the name the error must give)``."""
    ys = problem["ys"].to(problem["dtype"])
    if bad == "T=0":
        return ys[:0], "observations"
    if bad == "empty list":
        return [], "observations"
    if bad == "dtype":
        return ys.to(torch.float32 if problem["dtype"] == torch.float64 else torch.float64), "observations"
    if bad == "width":
        return torch.cat([ys, ys[:, :1]], -1), "observations"
    if bad == "rank":
        return ys[..., None], "observations"
    ys = ys.clone()
    ys[-1, -1] = float("inf")
    return ys, "time step"


@ENGINE
@given(linear_problems(), BAD_OBSERVATIONS, PROJECTIONS, st.booleans())
def test_property_bad_observations_are_refused_by_name(problem, bad, projection, smooth):
    ssm = linear_model(problem)
    observations, name = bad_observations(problem, bad)
    if bad == "rank" and problem["ys"].shape[-1] == 1:
        name = "observations"  # (T, 1, 1) for e = 1: still not (T, 1)
    try:
        (gaussian_smoother if smooth else gaussian_filter)(ssm, observations, projection)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, name)
    else:
        raise AssertionError(f"{bad} observations were accepted")
