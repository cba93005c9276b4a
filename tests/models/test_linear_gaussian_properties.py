"""Properties of ``LinearGaussianSSM`` over drawn models (hypothesis): every corrupted argument (a
wrong shape, another dtype, a covariance that is not positive definite, not symmetric or not
finite) is refused with a ``ValueError`` naming it, and a valid model's oracle methods are finite
and agree with each other (``log_evidence`` is the sum of the filter's increments, the smoother's
last marginal is the filter's)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.models import LinearGaussianSSM
from tests.ops.test_kalman_properties import linear_problems, model_args
from tests.property_cases import ENGINE, assert_clear_error, assert_finite

NAMES = ["A", "Q", "C", "R", "init_mean", "init_cov"]
COVARIANCES = {"Q", "R", "init_cov"}
CORRUPTIONS = st.sampled_from(["shape", "dtype", "nan", "negative", "indefinite", "asymmetric"])


def corrupt(value: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "shape":
        return torch.cat([value, value[:1]]) if value.dim() else value[None]
    if kind == "dtype":
        return value.to(torch.float32 if value.dtype == torch.float64 else torch.float64)
    if kind == "nan":
        flat = value.flatten().clone()
        flat[-1] = float("nan")
        return flat.reshape(value.shape)
    if kind == "negative":
        return -value
    if kind == "indefinite":
        out = value.clone()
        out[0, 0] = -out[0, 0]
        return out
    out = value.clone()  # asymmetric: only a matrix of size >= 2 can be
    out[0, -1] += out.abs().max()
    return out


@ENGINE
@given(linear_problems(), st.sampled_from(NAMES), CORRUPTIONS)
def test_property_a_corrupted_argument_is_refused_by_name(problem, name, kind):
    args = dict(zip(NAMES, model_args(problem)))
    if kind in ("negative", "indefinite", "asymmetric") and name not in COVARIANCES:
        kind = "nan"  # only covariances have a definiteness; corrupt the entry instead
    if kind == "asymmetric" and args[name].shape[-1] == 1:
        kind = "negative"
    expected = name
    if kind == "dtype" and name == "A":
        expected = "Q"  # A sets the model's dtype: every other tensor is then the odd one
    args[name] = corrupt(args[name], kind)
    try:
        LinearGaussianSSM(**args)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, expected)
    else:
        raise AssertionError(f"{name} with {kind} was accepted")


@ENGINE
@given(linear_problems())
def test_property_the_oracle_methods_agree(problem):
    ssm, ys = LinearGaussianSSM(*model_args(problem)), problem["ys"].to(problem["dtype"])
    try:
        filtered, smoothed, log_z = ssm.kalman_filter(ys), ssm.rts_smoother(ys), ssm.log_evidence(ys)
    except ValueError as error:
        assert_clear_error(error, "time step")
        return
    assert_finite((filtered, smoothed.means, smoothed.covariances, log_z), "oracle")
    assert torch.equal(log_z, filtered.log_evidence_increments.sum(0)) and torch.equal(smoothed.log_evidence, log_z)
    assert torch.equal(smoothed.means[-1], filtered.means[-1]) and torch.equal(smoothed.covariances[-1], filtered.covariances[-1])
