"""NonlinearGaussianSSM rejects bad covariances with a ValueError naming the argument."""

import pytest
import torch

from pyro_smc.models import NonlinearGaussianSSM
from tests.models.test_linear_gaussian import BAD_COVARIANCES


# (transition_cov, negative) is already in tests/infer/test_ep_smoother.py::test_bad_input.
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
