"""Where each step of OnlineVariationalFilter starts (``pyro_smc.infer.online.start``)."""

import pyro
import pytest
import torch

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from tests.infer.online.test_stopping import _ssm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_start_is_the_kalman_update_and_backward_kernel(seed):
    """With the transition's linear part as a control variate the start has no Monte Carlo error
    for a linear-Gaussian step (A and C not diagonal): the marginal is Kalman's and the kernel
    the exact backward kernel to rounding, so every increment is the same number (the joint
    q_t(x_{t-1}, x_t) is the exact posterior up to a constant)."""
    ssm = _ssm(seed=seed)
    _, ys = ssm.simulate(8)
    kf = ssm.kalman_filter(ys)
    pyro.set_rng_seed(seed)
    guide = StreamingFilterGuide(3, covariance="full").double()
    vf = OnlineVariationalFilter(ssm, guide, num_iterations=0, num_regression_samples=64)
    for t, y in enumerate(ys):
        vf.step(y)
        q = vf.filtering_distribution()
        torch.testing.assert_close(q.mean, kf.means[t], rtol=0, atol=1e-12)
        torch.testing.assert_close(q.covariance_matrix, kf.covariances[t], rtol=0, atol=1e-12)
        assert float(vf.last_increments.std()) < 1e-12, t
        if t > 0:
            gain = kf.covariances[t - 1] @ ssm.A.T @ torch.linalg.inv(kf.predicted_covariances[t])
            torch.testing.assert_close(guide.kernel(-1).weight, gain, rtol=0, atol=1e-12)
    # Each increment is then the Kalman one: the running ELBO is log p(y) exactly.
    torch.testing.assert_close(vf.log_evidence, ssm.log_evidence(ys), rtol=0, atol=1e-10)
