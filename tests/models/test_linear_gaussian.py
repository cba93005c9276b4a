"""LinearGaussianSSM rejects bad covariances and shapes with a ValueError naming the argument."""

import math

import pytest
import torch

from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM


def _not_symmetric(d):
    m = torch.eye(d)
    m[0, -1] = 0.5
    return m


BAD_COVARIANCES = [
    (lambda d: -torch.eye(d), "positive definite"),
    (lambda d: torch.zeros(d, d), "positive definite"),
    (lambda d: torch.diag(torch.tensor([1.0] + [-1.0] * (d - 1))), "positive definite"),
    (_not_symmetric, "symmetric"),
    (lambda d: torch.full((d, d), math.nan), "non-finite"),
    (lambda d: torch.eye(d + 1), "shape"),
]


@pytest.mark.parametrize("make, match", BAD_COVARIANCES, ids=["negative", "zero", "indefinite", "asymmetric", "nan", "shape"])
@pytest.mark.parametrize("name", ["Q", "R", "init_cov"])
def test_linear_gaussian_ssm_rejects_bad_covariances(name, make, match):
    d = 2
    eye = torch.eye(d)
    kwargs = dict(A=0.5 * eye, Q=eye, C=eye, R=eye, init_mean=torch.zeros(d), init_cov=eye)
    kwargs[name] = make(d)
    with pytest.raises(ValueError, match=rf"{name}.*{match}|{name} must have shape"):
        LinearGaussianSSM(**kwargs)


def test_ssm_models_reject_wrong_shapes():
    eye = torch.eye(2)
    with pytest.raises(ValueError, match="C must have shape"):
        LinearGaussianSSM(eye, eye, torch.eye(3), eye, torch.zeros(2), eye)
    with pytest.raises(ValueError, match="init_mean"):
        LinearGaussianSSM(eye, eye, eye, eye, torch.zeros(3), eye)
    with pytest.raises(ValueError, match="A must be a square"):
        LinearGaussianSSM(torch.zeros(2, 3), eye, eye, eye, torch.zeros(2), eye)
    with pytest.raises(ValueError, match="init_mean"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, eye, torch.zeros(2, 1), eye)
    with pytest.raises(ValueError, match="observation_cov must have shape"):
        NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, torch.ones(2), torch.zeros(2), eye)


@pytest.mark.parametrize("name", ["Q", "C", "R", "init_cov"])
def test_mixed_dtypes_are_an_error_naming_the_argument(name):
    # Before: accepted; the Kalman filter then raised "expected m1 and m2 to have the same dtype".
    eye = torch.eye(2, dtype=torch.float64)
    kwargs = dict(A=0.5 * eye, Q=eye, C=eye, R=eye, init_mean=torch.zeros(2, dtype=torch.float64), init_cov=eye)
    kwargs[name] = kwargs[name].float()
    with pytest.raises(ValueError, match=rf"{name} has dtype torch.float32.*A.*torch.float64"):
        LinearGaussianSSM(**kwargs)


def test_the_oracle_names_ys_for_data_of_another_dtype():
    # Before: RuntimeError: expected m1 and m2 to have the same dtype, but got: float != double.
    eye = torch.eye(2, dtype=torch.float32)
    lin = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2, dtype=torch.float32), eye)
    for method in (lin.kalman_filter, lin.rts_smoother, lin.log_evidence):
        with pytest.raises(ValueError, match=r"ys has dtype torch.float64.*\.to\("):
            method(torch.zeros(3, 2, dtype=torch.float64))
        with pytest.raises(ValueError, match="ys must have at least one time step"):
            method(torch.zeros(0, 2, dtype=torch.float32))



def test_init_mean_of_another_dtype_is_an_error_like_the_other_arguments():
    # Found by tests/models/test_linear_gaussian_properties.py. Before: silently cast to A's dtype
    # (float64 -> float32 loses digits) where every other tensor of another dtype was refused.
    eye = torch.eye(2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"init_mean has dtype torch.float64.*A torch.float32"):
        LinearGaussianSSM(eye, eye, eye, eye, torch.zeros(2, dtype=torch.float64), eye)
    assert LinearGaussianSSM(eye, eye, eye, eye, [0.0, 0.0], eye).init_mean.dtype == torch.float32  # a list takes A's


def test_c_and_r_of_different_observation_sizes_name_both():
    # Found by the property suite. Before: "R must have shape (2, 2), got (1, 1)" for a C with one
    # row too many: R blamed for C's size.
    eye = torch.eye(1)
    with pytest.raises(ValueError, match=r"R has shape \(1, 1\) but C has 2 rows"):
        LinearGaussianSSM(eye, eye, torch.ones(2, 1), eye, torch.zeros(1), eye)


def test_the_step_factorises_the_covariances_it_reads():
    """A covariance replaced after ``init`` (a PyroSample prior on Q drawn per filter under SMC2,
    whose filters are resampled between steps) is the one the step uses: the factors made in
    ``init`` went stale, and SMC2's log-evidence was 1.2 nats (10 standard errors) low."""
    import pyro.distributions as dist
    import pyro.poutine as poutine
    from pyro.nn import PyroSample

    from pyro_smc.tracing import module_context

    one = torch.eye(1, dtype=torch.float64)
    ssm = LinearGaussianSSM(0.7 * one, one, one, 0.25 * one, torch.zeros(1, dtype=torch.float64), one)
    state = {}
    ssm.init(state)
    state["x"] = torch.zeros(1, dtype=torch.float64)
    ssm.Q = 4.0 * one  # replaced after init
    trace = poutine.trace(ssm.step).get_trace(state, torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(trace.nodes["x_0"]["fn"].scale_tril, 2.0 * one)
    ssm.R = 9.0 * one
    trace = poutine.trace(ssm.step).get_trace(state, torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(trace.nodes["y_1"]["fn"].base_dist.scale, torch.tensor([3.0], dtype=torch.float64))
    # A prior on Q, drawn under the model's PyroModule context as the engines run it: every
    # step factorises the value it draws.
    ssm.Q = PyroSample(dist.LogNormal(torch.zeros(1, 1, dtype=torch.float64), 1.0).to_event(2))
    with module_context(ssm):
        trace = poutine.trace(ssm.step).get_trace(state, torch.zeros(1, dtype=torch.float64))
    q = trace.nodes["Q"]["value"]
    assert torch.allclose(trace.nodes["x_2"]["fn"].scale_tril, q.sqrt())
