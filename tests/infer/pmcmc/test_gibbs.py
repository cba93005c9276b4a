"""ParticleGibbs: the exact parameter posterior of a linear-Gaussian model (Kalman likelihood on a
grid), the MCMC interface (samples, transforms, diagnostics) and the argument checks."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.autoguide.initialization import init_to_value
from pyro.nn import PyroSample
from pyro.ops.stats import effective_sample_size

from pyro_smc.infer.pmcmc.gibbs import ParticleGibbs
from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk
from pyro_smc.models import LinearGaussianSSM
from tests.infer.pmcmc.exact_ar1 import AR1, rho_posterior, rho_sigma_posterior, simulate
from tests.tolerances import MC_SIGMAS


def run_chain(kernel, ys, num_samples, warmup_steps):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    mcmc.run(ys)
    return mcmc


def assert_matches(samples, mean, sd, fourth, min_ess=20):
    """The chain's mean and sd against the exact ones, within MC_SIGMAS Monte Carlo standard
    errors from the chain's effective sample size: ``sd / sqrt(ess)`` for the mean, and the delta
    method for the sd, ``sqrt((m4 - sd^4) / ess) / (2 sd)``, from the exact fourth moment."""
    ess = float(effective_sample_size(samples.reshape(1, -1)))
    assert ess > min_ess, f"too few effective samples ({ess:.0f}) for the check to mean anything"
    se_mean = sd / math.sqrt(ess)
    se_sd = math.sqrt((fourth - sd**4) / ess) / (2 * sd)
    assert abs(float(samples.mean()) - mean) < MC_SIGMAS * se_mean, (float(samples.mean()), mean, se_mean, ess)
    assert abs(float(samples.std()) - sd) < MC_SIGMAS * se_sd, (float(samples.std()), sd, se_sd, ess)


@pytest.mark.parametrize("seed", [0] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 3, 4)])
def test_posterior_of_rho_matches_the_exact_grid_posterior(seed):
    ys = simulate(12, seed=seed)
    pyro.set_rng_seed(seed)
    mcmc = run_chain(ParticleGibbs(AR1(), num_particles=5), ys, num_samples=250, warmup_steps=50)
    assert_matches(mcmc.get_samples()["rho"], *rho_posterior(ys))


@pytest.mark.parametrize("seed", [0] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 3)])
def test_the_parameter_update_targets_the_exact_conditional_posterior(seed):
    """The second block alone, the trajectory held fixed: the Metropolis-Hastings chain on rho
    targets p(rho | x) proportional to p(rho) p(x | rho) (the observations do not depend on rho),
    computed on a grid. A short path leaves it broad, so the log-Jacobian of the map to the
    unconstrained space weighs: leaving it out fails this test."""
    ys = simulate(3, seed=seed)
    pyro.set_rng_seed(seed)
    kernel = ParticleGibbs(AR1(), num_particles=4, proposal=AdaptiveRandomWalk(1, scale=1.5, adapt=False))
    kernel.setup(0, ys)
    path = kernel.trajectory
    kernel.trajectory = path._replace(log_density=None)  # scored at the start's rho, not at each z
    x = torch.stack([path.sites[0]["x0"]] + [path.sites[k]["x"] for k in range(1, 4)])
    z, draws = {"rho": kernel.initial_params["rho"]}, []
    for _ in range(600):
        z = kernel._centred_moves(z)
        draws.append(kernel.transforms["rho"].inv(z["rho"]))
    rho = (torch.arange(4000, dtype=torch.float64) + 0.5) / 2000 - 1
    log_density = dist.Normal(0.0, 1 / (1 - rho**2).sqrt()).log_prob(x[0])
    log_density = log_density + dist.Normal(rho[:, None] * x[:-1], 1.0).log_prob(x[1:]).sum(-1)
    w = torch.softmax(log_density, 0)
    mean = float((w * rho).sum())
    sd = float((w * (rho - mean) ** 2).sum().sqrt())
    fourth = float((w * (rho - mean) ** 4).sum())
    assert_matches(torch.stack(draws), mean, sd, fourth, min_ess=30)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_posterior_of_rho_and_sigma_matches_the_exact_grid_posterior(seed):
    ys = simulate(20, seed=seed)
    pyro.set_rng_seed(seed)
    mcmc = run_chain(ParticleGibbs(AR1(sigma=None), num_particles=10, num_mh_steps=2), ys, num_samples=1000, warmup_steps=200)
    exact = rho_sigma_posterior(ys)
    for name in ("rho", "sigma"):
        assert_matches(mcmc.get_samples()[name], *exact[name], min_ess=30)


def test_samples_hold_constrained_parameters_and_the_trajectory():
    torch.manual_seed(0)
    one = torch.eye(1)
    ssm = LinearGaussianSSM(0.8 * one, one, one, one, torch.zeros(1), one)
    _, ys = ssm.simulate(6)
    ssm.Q = PyroSample(dist.LogNormal(0.0, 1.0).expand([1, 1]).to_event(2))
    kernel = ParticleGibbs(ssm, num_particles=4, num_mh_steps=2)
    mcmc = run_chain(kernel, ys, num_samples=15, warmup_steps=5)
    samples = mcmc.get_samples()
    assert samples["Q"].shape == (15, 1, 1) and bool((samples["Q"] > 0).all())
    assert samples["x"].shape == (15, 6, 1)
    # the reported trajectory is the kernel's last one
    assert torch.equal(samples["x"][-1], kernel.trajectory.stacked()["x"])
    diagnostics = mcmc.diagnostics()
    assert 0 <= diagnostics["acceptance rate"]["chain 0"] <= 1
    assert 0 <= diagnostics["path update rate"]["chain 0"] <= 1
    assert kernel.path_update_rate.shape == (6,)
    assert set(kernel.logging()) == {"step size", "acc. prob", "path upd."}
    import arviz  # here, not at the top: its import is seconds of every worker's collection

    posterior = arviz.from_pyro(mcmc).posterior
    assert posterior["Q"].shape == (1, 15, 1, 1) and posterior["x"].shape == (1, 15, 6, 1)


def test_trajectory_keys_and_a_model_without_static_parameters():
    torch.manual_seed(0)
    one = torch.eye(1)
    ssm = LinearGaussianSSM(0.8 * one, one, one, one, torch.zeros(1), one)
    _, ys = ssm.simulate(5)
    kernel = ParticleGibbs(ssm, num_particles=4)  # no PyroSample: a particle MCMC smoother
    assert kernel.transforms == {} and kernel.proposal is None
    samples = run_chain(kernel, ys, num_samples=5, warmup_steps=2).get_samples()
    assert list(samples) == ["x"] and samples["x"].shape == (5, 5, 1)
    samples = run_chain(ParticleGibbs(AR1(), num_particles=4, trajectory_keys=()), ys[:, 0], 5, 2).get_samples()
    assert list(samples) == ["rho"]


def test_initial_parameters_are_used():
    ys = simulate(5, seed=0)
    kernel = ParticleGibbs(AR1(), num_particles=4)
    kernel.initial_params = {"rho": torch.tensor(0.3).atanh()}  # unconstrained, as MCMC takes them
    kernel.setup(0, ys)
    assert float(kernel.initial_params["rho"]) == pytest.approx(math.atanh(0.3))
    assert kernel.initial_params["x"].shape == (5,)


def test_the_start_follows_init_strategy_unless_initial_params_are_given():
    ys = simulate(5, seed=0)
    kernel = ParticleGibbs(AR1(sigma=None), num_particles=4, init_strategy=init_to_value(values={"rho": torch.tensor(-0.4)}))
    kernel.setup(0, ys)
    # rho from the strategy; sigma, which it does not name, from its fallback (the prior median)
    assert float(kernel.transforms["rho"].inv(kernel.initial_params["rho"])) == pytest.approx(-0.4)
    assert 0 < float(kernel.transforms["sigma"].inv(kernel.initial_params["sigma"])) < math.inf
    kernel = ParticleGibbs(AR1(sigma=None), num_particles=4, init_strategy=init_to_value(values={"rho": torch.tensor(-0.4)}))
    kernel.initial_params = {"rho": torch.tensor(0.2).atanh()}
    kernel.setup(0, ys)
    assert float(kernel.initial_params["rho"]) == pytest.approx(math.atanh(0.2))


def test_noncentred_steps_report_their_acceptance_and_the_path_update_rates():
    ys = simulate(8, seed=0)
    pyro.set_rng_seed(0)
    kernel = ParticleGibbs(AR1(sigma=None), num_particles=4, noncentred_steps=2)
    mcmc = run_chain(kernel, ys, num_samples=20, warmup_steps=5)
    diagnostics = mcmc.diagnostics()
    for key in ("acceptance rate", "non-centred acceptance rate", "path update rate", "min path update rate"):
        assert 0 <= diagnostics[key]["chain 0"] <= 1, key
    assert diagnostics["min path update rate"]["chain 0"] <= diagnostics["path update rate"]["chain 0"]
    assert kernel._counts["non-centred"][1] == 2 * 20  # two tries a sweep after warm-up
    assert set(kernel.logging()) == {"step size", "acc. prob", "nc acc. prob", "path upd."}
    assert kernel.noncentred_proposal is not kernel.proposal  # each move adapts its own walk


def test_noncentred_parameters_restrict_the_noncentred_move_to_them(monkeypatch):
    """noncentred_parameters=["sigma"]: the non-centred steps walk in sigma's coordinate alone
    (rho keeps its value through them, sigma moves), with a walk of that dimension."""
    ys = simulate(8, seed=0)
    pyro.set_rng_seed(0)
    kernel = ParticleGibbs(AR1(sigma=None), num_particles=4, noncentred_steps=2, noncentred_parameters=["sigma"])
    assert kernel.static.names == ["rho", "sigma"] and kernel.noncentred_proposal.dim == 1
    moves, original = [], kernel._noncentred_moves
    monkeypatch.setattr(kernel, "_noncentred_moves", lambda z: moves.append((z, original(z))) or moves[-1][1])
    run_chain(kernel, ys, num_samples=20, warmup_steps=5)
    assert len(moves) == 25
    assert all(torch.equal(before["rho"], after["rho"]) for before, after in moves)
    assert any(not torch.equal(before["sigma"], after["sigma"]) for before, after in moves)


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="num_particles"):
        ParticleGibbs(AR1(), num_particles=1)
    with pytest.raises(ValueError, match="num_mh_steps"):
        ParticleGibbs(AR1(), num_mh_steps=0)
    with pytest.raises(ValueError, match="proposal must be an AdaptiveRandomWalk of dim 1"):
        ParticleGibbs(AR1(), proposal=AdaptiveRandomWalk(2))
    with pytest.raises(ValueError, match="noncentred_steps"):
        ParticleGibbs(AR1(), noncentred_steps=-1)
    with pytest.raises(ValueError, match="noncentred_proposal must be an AdaptiveRandomWalk of dim 1"):
        ParticleGibbs(AR1(), noncentred_steps=1, noncentred_proposal=AdaptiveRandomWalk(2))
    with pytest.raises(ValueError, match="noncentred_parameters"):
        ParticleGibbs(AR1(sigma=None), noncentred_steps=1, noncentred_parameters=["nope"])
    with pytest.raises(ValueError, match="noncentred_parameters"):
        ParticleGibbs(AR1(sigma=None), noncentred_steps=1, noncentred_parameters="sigma")
    with pytest.raises(ValueError, match="init_strategy"):
        ParticleGibbs(AR1(), init_strategy=0.5)
    with pytest.raises(ValueError, match="trajectory_keys"):
        ParticleGibbs(AR1(), trajectory_keys="x")
    with pytest.raises(ValueError, match="names"):
        ParticleGibbs(AR1(), parameters=["nope"])
    kernel = ParticleGibbs(AR1(), num_particles=4)
    with pytest.raises(ValueError, match="observations"):
        kernel.setup(0)
    with pytest.raises(ValueError, match="time step 1 contains inf"):
        kernel.setup(0, torch.tensor([0.0, math.inf]))
    clash = AR1()
    clash.x = PyroSample(dist.Normal(0.0, 1.0))  # a parameter named like the state key
    with pytest.raises(ValueError, match="trajectory_keys: state keys \\['x'\\]"):
        ParticleGibbs(clash, num_particles=4).setup(0, simulate(3, seed=0))
