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
