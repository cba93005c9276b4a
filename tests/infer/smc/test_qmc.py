"""Sequential quasi-Monte Carlo (``SMC(qmc=True)``): the inverse-CDF draws handler, and the filter
against Kalman (filtering means, an unbiased and consistent evidence), with and without a
look-ahead, a guide, missing observations and float32."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.infer.smc.importance import ParticleLayout
from pyro_smc.infer.smc.qmc import InverseCDFDraws, inverse_cdf_value
from pyro_smc.resamplers import OTResampler, SystematicResampler
from tests.infer.smc.test_auxiliary import FullyAdapted, LookAheadLGSSM
from tests.tolerances import MC_SIGMAS


def _ssm(d=2, dtype=torch.float64):
    eye = torch.eye(d, dtype=dtype)
    return LookAheadLGSSM(0.8 * eye, 0.5 * eye, eye, 0.5 * eye, torch.zeros(d, dtype=dtype), eye)


def _data(ssm, T, seed=0):
    torch.manual_seed(seed)
    return ssm.simulate(T)[1]


def _mean_within(values, truth, extra=0.0):
    n = values.shape[0]
    return bool(((values.mean(0) - truth).abs() < MC_SIGMAS * values.std(0) / math.sqrt(n) + extra).all())


# --- the draws handler --------------------------------------------------------------------------


def _draw(fn, u, num_particles=4):
    layout = ParticleLayout(num_filters=1, num_particles=num_particles, max_plate_nesting=0)
    handler = InverseCDFDraws(u, layout, "time step 0")
    with pyro.plate("particles", num_particles), handler:
        value = pyro.sample("x", fn)
    return value, handler.used


def test_normal_and_independent_normal_are_their_quantiles():
    u = torch.tensor([[[0.1, 0.2], [0.5, 0.5], [0.9, 0.6], [0.3, 0.99]]])
    loc, scale = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])
    value, used = _draw(dist.Normal(loc, scale).to_event(1), u)
    assert used == 2
    assert torch.allclose(value, torch.distributions.Normal(loc, scale).icdf(u[0]))


def test_multivariate_normal_is_loc_plus_cholesky_times_normal_quantiles():
    u = torch.tensor([[[0.1, 0.2], [0.5, 0.5], [0.9, 0.6], [0.3, 0.99]]])
    cov = torch.tensor([[2.0, 0.6], [0.6, 1.0]])
    value, _ = _draw(dist.MultivariateNormal(torch.ones(2), cov), u)
    z = torch.distributions.Normal(0.0, 1.0).icdf(u[0])
    assert torch.allclose(value, torch.ones(2) + z @ torch.linalg.cholesky(cov).T)


def test_a_distribution_with_icdf_and_its_batch():
    u = torch.tensor([[[0.25], [0.5], [0.75], [0.1]]])
    value, _ = _draw(dist.Exponential(2.0), u)
    assert torch.allclose(value, -torch.log1p(-u[0, :, 0]) / 2.0)


@pytest.mark.parametrize("fn", [dist.Bernoulli(0.3), dist.Gamma(2.0, 1.0)], ids=["bernoulli", "gamma"])
def test_a_distribution_without_icdf_is_an_error_naming_the_site(fn):
    with pytest.raises(ValueError, match="site 'x'"):
        _draw(fn, torch.full((1, 4, 1), 0.5))


def test_missing_coordinates_are_drawn_on_demand():
    value, used = _draw(dist.Normal(torch.zeros(3), 1.0).to_event(1), torch.full((1, 4, 1), 0.5))
    assert used == 3 and value.shape == (4, 3)
    assert torch.allclose(value[:, 0], torch.zeros(4))


def test_inverse_cdf_value_keeps_the_parameters_graph():
    loc = torch.tensor(1.0, requires_grad=True)
    value = inverse_cdf_value(dist.Normal(loc, 2.0), torch.tensor([0.3, 0.7]), "x")
    assert torch.allclose(torch.autograd.grad(value.sum(), loc)[0], torch.tensor(2.0))


# --- the filter ---------------------------------------------------------------------------------

CASES = {"qmc": {}, "qmc_auxiliary": {"auxiliary": True}, "qmc_fully_adapted": {"auxiliary": True, "guide": True}}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [1, 2])
def test_filtering_means_match_kalman(case, d):
    ssm = _ssm(d)
    ys = _data(ssm, 12)
    options = dict(CASES[case])
    guide = FullyAdapted(ssm) if options.pop("guide", False) else None
    smc = SMC(ssm, guide, num_particles=256, num_filters=20, qmc=True, **options).run(ys)
    means = smc.filtering_means["x"].transpose(0, 1)
    assert _mean_within(means, ssm.kalman_filter(ys).means, extra=0.02)


@pytest.mark.filterwarnings("ignore::pyro_smc.infer.smc.checks.ParticleDegeneracyWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_evidence_is_unbiased_on_the_natural_scale(case):
    ssm = _ssm()
    ys = _data(ssm, 8, seed=1)
    ys[3] = float("nan")
    ys[5, 0] = float("nan")
    options = dict(CASES[case])
    guide = FullyAdapted(ssm) if options.pop("guide", False) else None
    torch.manual_seed(2)
    smc = SMC(ssm, guide, num_particles=16, num_filters=2000, qmc=True, **options).run(ys)
    ratio = (smc.log_evidence - ssm.log_evidence(ys)).exp()
    assert _mean_within(ratio.unsqueeze(-1), torch.ones(1))


def test_evidence_is_consistent_and_beats_monte_carlo():
    ssm = _ssm()
    ys = _data(ssm, 15, seed=3)
    exact = ssm.log_evidence(ys)
    torch.manual_seed(4)
    variances = {}
    for qmc in (False, True):
        log_z = SMC(ssm, num_particles=256, num_filters=100, qmc=qmc, ess_threshold=1.0).run(ys).log_evidence
        # Consistency: the mean error is within Monte Carlo error plus the -var/2 bias of log Z.
        assert _mean_within(log_z.unsqueeze(-1), exact.reshape(1), extra=float(log_z.var()))
        variances[qmc] = float(log_z.var())
    # Randomised QMC at N = 256 in dimension 3: the variance ratio measured is about 0.3.
    assert variances[True] < 0.6 * variances[False]


def test_every_filter_resamples_at_every_step_and_records_ancestors():
    ssm = _ssm()
    ys = _data(ssm, 6)
    smc = SMC(ssm, num_particles=32, num_filters=2, qmc=True, store_history=True).run(ys)
    assert bool(smc.resampled[:-1].all()) and not bool(smc.resampled[-1].any())
    assert smc.records[0].ancestors.shape == (2, 32)
    assert smc.smooth(5, method="genealogy")["x"].shape == (5, 6, 2, 2)
    assert smc.compile_status is not None and "qmc" in smc.compile_status


def test_stop_gradient_and_pathwise_gradients_are_finite():
    eye = torch.eye(2)
    a = torch.tensor(0.8, requires_grad=True)
    ssm = LookAheadLGSSM(0.8 * eye, 0.5 * eye, eye, 0.5 * eye, torch.zeros(2), eye)
    ys = _data(ssm, 6)
    for resampler in (SystematicResampler(), SystematicResampler(gradient="stop_gradient")):
        ssm.A = a * eye
        smc = SMC(ssm, num_particles=64, qmc=True, auxiliary=True, resampler=resampler).run(ys)
        assert bool(torch.isfinite(torch.autograd.grad(smc.log_evidence.sum(), a)[0]))


def test_float32_runs_in_float32():
    ssm = _ssm(dtype=torch.float32)
    smc = SMC(ssm, num_particles=64, qmc=True, auxiliary=True).run(_data(ssm, 5))
    assert smc.log_evidence.dtype == torch.float32 and smc.state["x"].dtype == torch.float32


def test_qmc_needs_an_index_resampler():
    with pytest.raises(ValueError, match="index resampler"):
        SMC(_ssm(), num_particles=8, qmc=True, resampler=OTResampler())
    with pytest.raises(ValueError, match="qmc"):
        SMC(_ssm(), num_particles=8, qmc=1)


def test_checkpoint_continues_bit_identically():
    ssm = _ssm()
    ys = _data(ssm, 8)
    torch.manual_seed(7)
    a = SMC(ssm, num_particles=32, qmc=True).run(ys[:4])
    saved = a.state_dict()
    for y in ys[4:]:
        a.step(y)
    b = SMC(ssm, num_particles=32, qmc=True)
    b.load_state_dict(saved)
    for y in ys[4:]:
        b.step(y)
    assert torch.equal(a.log_evidence, b.log_evidence)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_runs_without_the_default_device_or_dtype(dtype):
    from tests.test_device import strict

    opts = {"device": torch.device("cpu"), "dtype": dtype}
    ssm = _ssm(dtype=dtype)
    ys = _data(ssm, 6)
    with strict(opts):
        smc = SMC(ssm, FullyAdapted(ssm), num_particles=64, num_filters=4, auxiliary=True, qmc=True).run(ys)
        boot = SMC(ssm, num_particles=64, num_filters=4, qmc=True).run(ys)
    for out in (smc, boot):
        assert out.log_evidence.dtype == dtype and out.log_evidence.device.type == "cpu"
        assert bool(torch.isfinite(out.log_evidence).all())
