"""PMMH: the exact parameter posterior of a linear-Gaussian model, the kept estimate, the MCMC
interface (samples, diagnostics, ArviZ) and the argument checks."""

import math
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.ops.stats import effective_sample_size
from pyro.nn import PyroModule

from pyro_smc.infer.pmcmc.pmmh import PMMH
from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk
from pyro_smc.models import LinearGaussianSSM
from tests.infer.pmcmc.exact_ar1 import AR1, kalman_log_likelihood, rho_posterior, rho_sigma_posterior, simulate
from tests.tolerances import MC_SIGMAS


def run_chain(kernel, ys, num_samples, warmup_steps, *args, **kwargs):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    mcmc.run(ys, *args, **kwargs)
    return mcmc


def assert_matches(samples, mean, sd, fourth):
    """The chain's mean and sd against the exact ones, within MC_SIGMAS Monte Carlo standard
    errors from the chain's effective sample size: ``sd / sqrt(ess)`` for the mean, and the delta
    method for the sd, ``sqrt((m4 - sd^4) / ess) / (2 sd)``, from the exact fourth moment."""
    ess = float(effective_sample_size(samples.reshape(1, -1)))
    assert ess > 30, f"too few effective samples ({ess:.0f}) for the check to mean anything"
    se_mean = sd / math.sqrt(ess)
    se_sd = math.sqrt((fourth - sd**4) / ess) / (2 * sd)
    assert abs(float(samples.mean()) - mean) < MC_SIGMAS * se_mean, (float(samples.mean()), mean, se_mean, ess)
    assert abs(float(samples.std()) - sd) < MC_SIGMAS * se_sd, (float(samples.std()), sd, se_sd, ess)


def test_the_grid_oracle_is_the_kalman_likelihood():
    ys = simulate(20, 0)
    one = torch.ones(1, 1)
    for rho, sigma in [(0.3, 1.0), (-0.5, 0.4)]:
        ssm = LinearGaussianSSM(rho * one, sigma**2 * one, one, 0.25 * one, torch.zeros(1), sigma**2 / (1 - rho**2) * one)
        exact = float(ssm.log_evidence(ys.reshape(-1, 1)))
        assert float(kalman_log_likelihood(ys, torch.tensor(rho), torch.tensor(sigma))) == pytest.approx(exact, rel=1e-6)


def test_posterior_of_rho_matches_the_exact_grid_posterior():
    # few particles on purpose: a noisy log Z_hat (sd about 0.5 here) leaves the chain exact
    ys = simulate(20, seed=0)
    pyro.set_rng_seed(0)
    mcmc = run_chain(PMMH(AR1(), num_particles=30), ys, num_samples=700, warmup_steps=200)
    assert_matches(mcmc.get_samples()["rho"], *rho_posterior(ys))
    assert 0.05 < mcmc.diagnostics()["acceptance rate"]["chain 0"] < 0.6


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_posterior_of_rho_and_sigma_matches_the_exact_grid_posterior(seed):
    ys = simulate(50, seed=seed)
    pyro.set_rng_seed(seed)
    mcmc = run_chain(PMMH(AR1(sigma=None), num_particles=100), ys, num_samples=3000, warmup_steps=750)
    exact = rho_sigma_posterior(ys)
    samples = mcmc.get_samples()
    for name in ("rho", "sigma"):
        assert_matches(samples[name], *exact[name])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_posterior_of_rho_matches_on_other_seeds(seed):
    ys = simulate(20, seed=seed)
    pyro.set_rng_seed(seed)
    mcmc = run_chain(PMMH(AR1(), num_particles=30), ys, num_samples=2000, warmup_steps=500)
    assert_matches(mcmc.get_samples()["rho"], *rho_posterior(ys))


def test_with_nothing_observed_the_chain_samples_the_prior():
    # log Z_hat = 0 exactly: the chain is random-walk Metropolis on the prior, in the unconstrained
    # space, so this checks the change of variables (its log-Jacobian) for two kinds of support
    ys = torch.full((2,), float("nan"))
    pyro.set_rng_seed(0)
    mcmc = run_chain(PMMH(AR1(sigma=None), num_particles=4), ys, num_samples=1000, warmup_steps=250)
    samples = mcmc.get_samples()
    assert_matches(samples["rho"], 0.0, math.sqrt(1 / 3), 1 / 5)  # Uniform(-1, 1): E rho^4 = 1/5
    # LogNormal(0, 1) has a heavy tail: its log, Normal(0, 1), is the well-behaved summary
    assert_matches(samples["sigma"].log(), 0.0, 1.0, 3.0)


class _Counting:
    """Counts the filter runs of a PMMH kernel."""

    def __init__(self, kernel):
        self.runs = 0
        run = kernel.smc.run

        def counted(*args, **kwargs):
            self.runs += 1
            return run(*args, **kwargs)

        kernel.smc.run = counted


def test_the_current_estimate_is_kept_one_filter_run_per_block_and_iteration():
    ys = simulate(10, seed=1)
    kernel = PMMH(AR1(sigma=None), num_particles=10, blocks=[["rho"], ["sigma"]])
    counter = _Counting(kernel)
    run_chain(kernel, ys, num_samples=12, warmup_steps=8)
    # one run for the initial state, then one per proposal (unconstrained proposals are always
    # inside the support): the current state's estimate is never recomputed
    assert counter.runs == 1 + 2 * 20
    assert math.isfinite(kernel.log_evidence)


def test_samples_are_constrained_and_mcmc_diagnostics_and_arviz_work():
    import arviz as az  # slow to import: only here

    ys = simulate(10, seed=2)
    pyro.set_rng_seed(1)
    kernel = PMMH(AR1(sigma=None), num_particles=20, blocks=[["rho"], ["sigma"]])
    mcmc = run_chain(kernel, ys, num_samples=30, warmup_steps=20)
    samples = mcmc.get_samples()
    assert samples["rho"].shape == (30,) and samples["sigma"].shape == (30,)
    assert bool((samples["rho"].abs() < 1).all()) and bool((samples["sigma"] > 0).all())
    diagnostics = mcmc.diagnostics()
    assert set(diagnostics["rho"]) >= {"n_eff", "r_hat"}
    assert 0 <= diagnostics["acceptance rate"]["chain 0"] <= 1
    assert set(diagnostics["block acceptance rates"]["chain 0"]) == {"rho", "sigma"}
    logged = kernel.logging()
    assert set(logged) == {"acc. rate", "acc. rho", "acc. sigma"}
    mcmc.summary()
    idata = az.from_pyro(mcmc)
    assert idata.posterior["rho"].shape == (1, 30)
    assert az.summary(idata).loc["sigma", "mean"] > 0


def test_a_second_chain_restarts_and_the_kernel_pickles_after_a_run():
    ys = simulate(10, seed=7)
    kernel = PMMH(AR1(sigma=None), num_particles=10)
    for start in (-0.5, 0.5):  # as MCMC runs chains one after the other: setup, then samples
        initial = {"rho": torch.tensor(start), "sigma": torch.tensor(0.0)}  # unconstrained
        mcmc = MCMC(kernel, num_samples=5, warmup_steps=5, initial_params=initial, disable_progbar=True)
        mcmc.run(ys)
        assert mcmc.get_samples()["rho"].shape == (5,)
    pickle.loads(pickle.dumps(kernel))  # what MCMC with worker processes sends


def test_initial_params_and_a_bad_start():
    ys = simulate(10, seed=3)
    kernel = PMMH(AR1(), num_particles=10)
    assert float(kernel.initial_params["rho"]) == pytest.approx(0.0, abs=0.5)
    start = {"rho": torch.tensor(0.4)}  # unconstrained, one chain
    mcmc = MCMC(kernel, num_samples=3, warmup_steps=0, initial_params=start, disable_progbar=True)
    mcmc.run(ys)
    assert mcmc.get_samples()["rho"].shape == (3,)
    inf_start = {"rho": torch.tensor(float("inf"))}
    kernel = PMMH(AR1(), num_particles=10)
    kernel.initial_params = inf_start
    kernel.setup(0, ys)
    with pytest.raises(ValueError, match="initial parameters"):
        kernel.sample(inf_start)


def test_several_filters_average_and_batched_sequences_sum():
    ys = torch.stack([simulate(8, seed=s) for s in range(3)])
    kernel = PMMH(AR1(), num_particles=10, num_filters=3)
    z = kernel.static.flatten(kernel.initial_params)
    values = kernel.static.constrain(kernel.static.unflatten(z))

    def filters(*args, **kwargs):
        pyro.set_rng_seed(0)
        with kernel.static.fixed(values):
            return kernel.smc.run(*args, **kwargs).log_evidence

    kernel.setup(0, ys, batched=True)
    pyro.set_rng_seed(0)
    assert kernel._log_evidence(z) == pytest.approx(float(filters(ys, batched=True).sum()))
    kernel.setup(0, ys[0])
    pyro.set_rng_seed(0)
    averaged = kernel._log_evidence(z)
    assert averaged == pytest.approx(float(torch.logsumexp(filters(ys[0]), 0) - math.log(3)))


def test_missing_observations_follow_the_filter_and_inf_is_an_error():
    ys = simulate(10, seed=4)
    ys[3] = float("nan")
    mcmc = run_chain(PMMH(AR1(), num_particles=10), ys, num_samples=5, warmup_steps=5)
    assert torch.isfinite(mcmc.get_samples()["rho"]).all()
    ys[3] = float("inf")
    with pytest.raises(ValueError, match="time step 3"):
        run_chain(PMMH(AR1(), num_particles=10), ys, num_samples=5, warmup_steps=5)


def test_float32():
    torch.set_default_dtype(torch.float32)  # the fixture restores float64
    ys = simulate(10, seed=5, dtype=torch.float32)
    model = AR1(sigma=None)
    mcmc = run_chain(PMMH(model, num_particles=10), ys, num_samples=5, warmup_steps=5)
    assert mcmc.get_samples()["rho"].dtype == torch.float32 == mcmc.get_samples()["sigma"].dtype


def test_a_given_proposal_is_used():
    ys = simulate(10, seed=6)
    walk = AdaptiveRandomWalk(1, scale=0.05, adapt=False)
    run_chain(PMMH(AR1(), num_particles=10, proposal=walk), ys, num_samples=5, warmup_steps=5)
    assert walk.scale == 0.05


class _NoParameters(PyroModule):
    def init(self, state):
        state["x"] = pyro.sample("x0", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_particles": 0}, "num_particles"),
        ({"num_particles": 10, "num_filters": 0}, "num_filters"),
        ({"num_particles": 10, "blocks": [["rho"], ["rho"]]}, "blocks"),
        ({"num_particles": 10, "blocks": [["nope"]]}, "blocks"),
        ({"num_particles": 10, "blocks": "rho"}, "blocks"),
        ({"num_particles": 10, "parameters": ["nope"]}, "names"),
        ({"num_particles": 10, "proposal": [AdaptiveRandomWalk(1), AdaptiveRandomWalk(1)]}, "proposal"),
        ({"num_particles": 10, "proposal": object()}, "proposal"),
        ({"num_particles": 10, "target_accept": 0.0}, "target_accept"),
        ({"num_particles": 10, "adapt": "yes"}, "adapt"),
        ({"num_particles": 10, "init_strategy": 3}, "init_strategy"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PMMH(AR1(), **kwargs)


def test_a_model_without_static_parameters_and_a_run_without_observations():
    with pytest.raises(ValueError, match="PyroSample"):
        PMMH(_NoParameters(), num_particles=10)
    with pytest.raises(TypeError, match="num_particles"):
        PMMH(AR1())
    with pytest.raises(ValueError, match="observations"):
        MCMC(PMMH(AR1(), num_particles=10), num_samples=2, disable_progbar=True).run()
