"""The Gaussian filters and smoothers on linear models and the missing-data rule, against Kalman."""

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.infer import extended_kalman_filter, gaussian_filter, gaussian_smoother, gp_rtss, unscented_kalman_filter
from pyro_smc.models import LinearGaussianSSM
from tests.cases import assert_same_marginals


def _model(seed=0, d=2, e=3, T=12):
    g = torch.Generator().manual_seed(seed)
    A = 0.3 * torch.randn(d, d, generator=g) + 0.6 * torch.eye(d)
    C = torch.randn(e, d, generator=g)
    L = torch.randn(e, e, generator=g)
    lin = LinearGaussianSSM(A, 0.4 * torch.eye(d), C, L @ L.T / e + 0.2 * torch.eye(e), torch.randn(d, generator=g), torch.eye(d))
    _, ys = lin.simulate(T, generator=g)
    ys[3] = float("nan")
    ys[5, 1] = float("nan")
    ys[8, [0, 2]] = float("nan")
    return lin, ys


@pytest.mark.parametrize("projection", ["linearization", "unscented", "moment_matching"])
def test_partly_missing_observations_match_the_masked_kalman_filter(projection):
    lin, ys = _model()
    kf, rts = lin.kalman_filter(ys), lin.rts_smoother(ys)
    filt = gaussian_filter(lin, ys, projection)
    assert_same_marginals(filt, kf)
    assert filt.log_evidence_increments[3] == 0
    for out in (gaussian_smoother(lin, ys, projection), EPSmoother(lin, projection=projection, max_iter=2).smooth(ys)):
        assert_same_marginals(out, rts, evidence=False)


def test_none_steps_are_missing():
    lin, ys = _model()
    as_list = [None if bool(torch.isnan(y).all()) else y for y in ys]
    assert as_list[3] is None
    torch.testing.assert_close(gaussian_smoother(lin, as_list).means, gaussian_smoother(lin, ys).means, rtol=0, atol=0)
    torch.testing.assert_close(EPSmoother(lin, max_iter=2).smooth(as_list).means, EPSmoother(lin, max_iter=2).smooth(ys).means, rtol=0, atol=0)


@pytest.mark.parametrize("engine", [extended_kalman_filter, unscented_kalman_filter, gp_rtss, lambda ssm, ys: EPSmoother(ssm).smooth(ys)])
def test_inf_is_an_error_naming_the_step(engine):
    lin, ys = _model()
    ys[7, 2] = float("inf")
    with pytest.raises(ValueError, match="time step 7"):
        engine(lin, ys)


def test_results_carry_log_evidence():
    lin, ys = _model()
    ep = EPSmoother(lin, max_iter=2).smooth(ys)
    assert torch.allclose(ep.log_evidence, lin.log_evidence(ys)) and ep.log_evidence_increments.shape == (ys.shape[0],)
    assert ep.history[0].change == float("inf") and ep.history[0].skipped == 0


def test_float32_partly_missing():
    lin, ys = _model()
    lin = lin.float()
    out = gaussian_filter(lin, ys.float(), "unscented")
    assert out.means.dtype == torch.float32 and torch.isfinite(out.means).all()
    torch.testing.assert_close(out.means, lin.double().kalman_filter(ys).means.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("projection", ["linearization", "unscented"])
def test_batched_gains_and_evidence_match_kalman_over_a_long_run(projection):
    # The smoother gains are solved for all steps at once and the evidence terms are evaluated in
    # one batched call after the forward loop: float64, to rounding, against the Kalman oracle.
    lin, ys = _model(seed=3, T=200)
    lin, ys = lin.double(), ys.double()
    ys[50] = float("nan")
    ys[120, 0] = float("nan")
    out = gaussian_smoother(lin, ys, projection)
    assert out.means.dtype == torch.float64
    assert_same_marginals(out, lin.rts_smoother(ys), atol=1e-10, evidence=False)
    kf = lin.kalman_filter(ys)
    torch.testing.assert_close(out.log_evidence_increments, kf.log_evidence_increments, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.log_evidence, kf.log_evidence, rtol=0, atol=1e-9)


def test_a_singular_predicted_covariance_names_the_last_such_step():
    # The batched gain solve reports the step the backward recursion would meet first.
    from pyro_smc.infer import Linearization

    class Collapsing(Linearization):  # a (user) projection whose transition moments are degenerate
        def moments(self, fn, mean, cov, t, noise_cov=None):
            mu, S, C = super().moments(fn, mean, cov, t, noise_cov)
            return (mu, 0 * S, 0 * C) if S.shape[-1] == 2 else (mu, S, C)

    lin, ys = _model()
    lin, ys = lin.double(), ys.double()
    with pytest.raises(ValueError, match="time step 11 is singular, so the smoother gain at time step 10"):
        gaussian_smoother(lin, ys, Collapsing())
