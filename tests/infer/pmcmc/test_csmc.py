"""Conditional SMC with ancestor sampling: the smoothing distribution is invariant (against the
RTS smoother), the sweep's path density is the model's, and the argument checks."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.stats import effective_sample_size

from pyro_smc.infer.pmcmc.csmc import ConditionalSMC, Trajectory, trajectory_log_density
from pyro_smc.models import LinearGaussianSSM
from tests.infer.pmcmc.exact_ar1 import AR1
from tests.tolerances import MC_SIGMAS


def linear_gaussian(dtype=torch.float64):
    A = torch.tensor([[0.9, 0.2], [-0.1, 0.7]], dtype=dtype)
    Q = torch.tensor([[0.5, 0.1], [0.1, 0.3]], dtype=dtype)
    C = torch.tensor([[1.0, 0.5]], dtype=dtype)
    return LinearGaussianSSM(A, Q, C, torch.eye(1, dtype=dtype), torch.zeros(2, dtype=dtype), torch.eye(2, dtype=dtype))


def chain(csmc, ys, num_sweeps):
    """The states ``(num_sweeps, T, d)`` of a conditional SMC chain started from a plain filter."""
    path = csmc.sweep(ys)
    out = []
    for _ in range(num_sweeps):
        path = csmc.sweep(ys, reference=path)
        out.append(path.stacked()["x"])
    return torch.stack(out)


def assert_smoothing_moments_match(xs, ssm, ys):
    """The chain's smoothing moments against the RTS smoother's, each within MC_SIGMAS standard
    errors from the chain's own effective sample size of the series it averages: ``x_t`` for the
    means, ``(x_t - m_t)^2`` for the variances and ``(x_t - m_t)(x_{t+1} - m_{t+1})^T`` for the
    lag-one covariances (centred at the exact means, so that their averages are unbiased). The
    lag-one covariance, the smoother gain times the next marginal covariance, is what a wrong
    ancestor-sampling weight gets wrong first: it glues the reference to an ill-fitting ancestor."""
    exact = ssm.rts_smoother(ys)
    filtered = ssm.kalman_filter(ys)
    gain = filtered.covariances[:-1] @ ssm.A.T @ torch.linalg.inv(filtered.predicted_covariances[1:])
    lag_one = gain @ exact.covariances[1:]  # Cov(x_t, x_{t+1} | y), (T - 1, d, d)
    centred = xs - exact.means
    checks = {
        "means": (xs, exact.means),
        "variances": (centred**2, exact.covariances.diagonal(dim1=-2, dim2=-1)),
        "lag-one covariances": (centred[:, :-1, :, None] * centred[:, 1:, None, :], lag_one),
    }
    for name, (series, value) in checks.items():
        ess = effective_sample_size(series.unsqueeze(0))
        assert float(ess.min()) > 10, f"{name}: too few effective samples ({float(ess.min()):.0f}) for the check to mean anything"
        error = (series.mean(0) - value).abs()
        bound = MC_SIGMAS * series.std(0) / ess.sqrt()
        assert (error < bound).all(), f"{name}: error {float((error / bound).max()):.2f} bounds"


@pytest.mark.parametrize("seed", [0] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 3, 4)])
def test_few_particles_leave_the_smoothing_distribution_invariant(seed):
    torch.manual_seed(seed)
    ssm = linear_gaussian()
    _, ys = ssm.simulate(8)
    ys[3] = math.nan  # a predict-only step
    pyro.set_rng_seed(seed)
    # a bootstrap sweep sticks at an outlying last observation for a while: its ESS is the
    # chain's lowest, and the error bars come from it
    xs = chain(ConditionalSMC(ssm, num_particles=10), ys, num_sweeps=220)[20:]
    assert_smoothing_moments_match(xs, ssm, ys)


def smoothing_posterior(ssm, ys):
    """The exact joint smoothing distribution of ``x_{0:T-1}``, dense: ``(mean (T d,), cov)``."""
    num_steps, d = ys.shape[0], ssm.state_dim
    shift = torch.zeros(num_steps * d, num_steps * d)
    for t in range(1, num_steps):
        shift[t * d : (t + 1) * d, (t - 1) * d : t * d] = ssm.A
    to_states = torch.linalg.inv(torch.eye(num_steps * d) - shift)  # x = to_states (x_0 noise, ...)
    prior_cov = to_states @ torch.block_diag(ssm.init_cov, *[ssm.Q] * (num_steps - 1)) @ to_states.T
    prior_mean = to_states @ torch.cat([ssm.init_mean, torch.zeros((num_steps - 1) * d)])
    observe = torch.block_diag(*[ssm.C] * num_steps)
    gain = prior_cov @ observe.T @ torch.linalg.inv(observe @ prior_cov @ observe.T + torch.block_diag(*[ssm.R] * num_steps))
    cov = prior_cov - gain @ observe @ prior_cov
    return prior_mean + gain @ (ys.reshape(-1) - observe @ prior_mean), (cov + cov.T) / 2


@pytest.mark.parametrize("seed", [0] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2)])
def test_one_sweep_from_an_exact_draw_gives_an_exact_draw(seed):
    """Invariance without a chain: references drawn independently from the exact smoothing
    distribution, one sweep each, give independent exact draws, so the outputs' means, variances
    and lag-one covariances match the exact ones within MC_SIGMAS standard errors of independent
    samples (no effective sample size to estimate)."""
    torch.manual_seed(seed)
    ssm = linear_gaussian()
    _, ys = ssm.simulate(6)
    mean, cov = smoothing_posterior(ssm, ys)
    factor = torch.linalg.cholesky(cov)
    csmc = ConditionalSMC(ssm, num_particles=5)
    outputs = []
    for _ in range(200):
        x = (mean + factor @ torch.randn(mean.shape[0])).reshape(6, 2)
        reference = Trajectory([{}] + [{f"x_{t}": x[t]} for t in range(6)], [{}] + [{"x": x[t]} for t in range(6)])
        outputs.append(csmc.sweep(ys, reference=reference).stacked()["x"].reshape(-1))
    centred = torch.stack(outputs) - mean
    lag = torch.stack([centred[:, 2 * t : 2 * t + 2, None] * centred[:, 2 * t + 2 : 2 * t + 4][:, None] for t in range(5)], 1)
    exact_lag = torch.stack([cov[2 * t : 2 * t + 2, 2 * t + 2 : 2 * t + 4] for t in range(5)])
    for series, value in ((centred, torch.zeros_like(mean)), (centred**2, cov.diagonal()), (lag, exact_lag)):
        error = (series.mean(0) - value).abs()
        assert (error < MC_SIGMAS * series.std(0) / math.sqrt(series.shape[0])).all()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_long_chain_on_a_long_series_matches_the_rts_smoother(seed):
    torch.manual_seed(seed)
    ssm = linear_gaussian()
    _, ys = ssm.simulate(40)
    pyro.set_rng_seed(seed)
    xs = chain(ConditionalSMC(ssm, num_particles=10), ys, num_sweeps=1500)[100:]
    assert_smoothing_moments_match(xs, ssm, ys)


def test_ancestor_sampling_moves_the_early_states_that_plain_conditional_smc_keeps():
    torch.manual_seed(0)
    ssm = linear_gaussian()
    _, ys = ssm.simulate(15)
    moved = {}
    for ancestor_sampling in (True, False):
        pyro.set_rng_seed(0)
        xs = chain(ConditionalSMC(ssm, num_particles=5, ancestor_sampling=ancestor_sampling), ys, num_sweeps=30)
        moved[ancestor_sampling] = float((xs[1:, 0] != xs[:-1, 0]).any(-1).double().mean())
    # plain conditional SMC: the 5 paths coalesce into the reference long before t = 0
    assert moved[True] > 0.3 and moved[False] < 0.15, moved


def test_the_reference_ancestor_is_drawn_by_weight_times_transition_density(monkeypatch):
    """Each step's ancestor-sampling weights are exactly :math:`w_{t-1}^i f(x^*_t | x_{t-1}^i)
    g(y_t | x^*_t)` (checked against the AR(1) densities by hand, for every particle), and the
    drawn ancestor becomes the reference particle's: its state is the reference's."""
    import pyro_smc.infer.pmcmc.csmc as csmc_module

    inputs, weights = [], []
    step, categorical = ConditionalSMC._step, csmc_module._categorical

    def spy_step(self, state, log_w, y, *rest):
        inputs.append((state.get("x"), log_w, y, rest[2]))
        return step(self, state, log_w, y, *rest)

    def spy_categorical(log_w, where):
        weights.append(log_w)
        return categorical(log_w, where)

    monkeypatch.setattr(ConditionalSMC, "_step", spy_step)
    monkeypatch.setattr(csmc_module, "_categorical", spy_categorical)
    ys = torch.tensor([0.3, -1.0, 2.0])
    csmc = ConditionalSMC(AR1(rho=0.8, sigma=0.7), num_particles=4)
    reference = csmc.sweep(ys)
    inputs.clear(), weights.clear()
    path = csmc.sweep(ys, reference=reference)
    assert len(weights) == 4  # one per step, and the final draw
    for (x, log_w, y, force), log_as in zip(inputs, weights):
        target = force["x"]
        by_hand = log_w + dist.Normal(0.8 * x, 0.7).log_prob(target) + dist.Normal(target, 0.5).log_prob(y)
        assert torch.allclose(log_as, by_hand, rtol=1e-12, atol=1e-12)
    assert len(path.sites) == 4


def test_the_paths_log_density_is_the_models_along_it():
    torch.manual_seed(0)
    model = AR1(rho=0.8, sigma=0.7)  # init samples a latent site too
    ys = list(torch.randn(6))
    ys[2] = torch.tensor(math.nan)  # predict-only
    ys[4] = None  # imputed: its observation site is latent
    csmc = ConditionalSMC(model, num_particles=4)
    path = csmc.sweep(ys)
    for _ in range(3):
        path = csmc.sweep(ys, reference=path)
        assert sorted(path.sites[0]) == ["x0"] and sorted(path.sites[5]) == ["x", "y"]
        log_density = float(trajectory_log_density(model, path, ys))
        assert float(path.log_density) == pytest.approx(log_density, rel=1e-10)
        # by hand: the transitions and the scored observations
        x = [float(path.sites[0]["x0"])] + [float(path.sites[k]["x"]) for k in range(1, 7)]
        by_hand = float(dist.Normal(0.0, 0.7 / math.sqrt(1 - 0.64)).log_prob(torch.tensor(x[0])))
        for t in range(6):
            by_hand += float(dist.Normal(0.8 * x[t], 0.7).log_prob(torch.tensor(x[t + 1])))
            y = path.sites[5]["y"] if t == 4 else ys[t]
            if t != 2:
                by_hand += float(dist.Normal(x[t + 1], 0.5).log_prob(torch.as_tensor(y)))
        assert log_density == pytest.approx(by_hand, rel=1e-10)


class PlatedWalk:
    """Two independent random walks inside a model plate (``max_plate_nesting=1``)."""

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        with pyro.plate("coords", 2, dim=-1):
            loc = state["x"] * 0.5 if "x" in state else y.new_zeros(())
            state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
            pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 1.0), obs=y)
        self.t += 1


def test_a_model_plate_right_of_the_particles_and_float32():
    ys = torch.randn(5, 2, dtype=torch.float32)
    csmc = ConditionalSMC(PlatedWalk(), num_particles=6, max_plate_nesting=1)
    path = csmc.sweep(ys)
    path = csmc.sweep(ys, reference=path)
    assert path.stacked()["x"].shape == (5, 2) and path.stacked()["x"].dtype == torch.float32
    expected = trajectory_log_density(PlatedWalk(), path, ys, max_plate_nesting=1)
    assert path.log_density.dtype == torch.float32
    assert float(path.log_density) == pytest.approx(float(expected), rel=1e-5)


class SecondOrder:
    """``x_t`` depends on ``x_{t-1}`` and ``x_{t-2}``: not first-order Markov in its state."""

    def init(self, state):
        pass

    def step(self, state, y=None):
        prev = state.get("x", torch.zeros(()))
        older = state.get("older", torch.zeros(()))
        x = pyro.sample("x", dist.Normal(0.5 * prev + 0.4 * older, 1.0))
        state["older"], state["x"] = prev + 0 * x, x
        pyro.sample("y", dist.Normal(x, 1.0), obs=y)


def test_ancestor_sampling_refuses_a_state_that_remembers_more_than_one_step():
    ys = torch.randn(6)
    csmc = ConditionalSMC(SecondOrder(), num_particles=5)
    path = csmc.sweep(ys)
    with pytest.raises(ValueError, match=r"state\['older'\].*first-order Markov.*ancestor_sampling=False"):
        csmc.sweep(ys, reference=path)
    plain = ConditionalSMC(SecondOrder(), num_particles=5, ancestor_sampling=False)
    assert len(plain.sweep(ys, reference=path).sites) == 7


def test_the_reference_particle_is_kept():
    # with plain conditional SMC and an observation that only the reference explains, the sweep
    # returns the reference itself
    ys = torch.tensor([50.0, 50.0, 50.0])
    model = AR1(rho=0.5, sigma=1.0)
    reference = Trajectory([{"x0": torch.tensor(50.0)}] + [{"x": torch.tensor(50.0)}] * 3, [{}] * 4)
    path = ConditionalSMC(model, num_particles=3, ancestor_sampling=False).sweep(ys, reference=reference)
    assert [float(s.get("x", s.get("x0"))) for s in path.sites] == [50.0] * 4


def test_bad_input_is_refused_naming_the_argument():
    ssm = linear_gaussian()
    ys = torch.zeros(4, 1)
    with pytest.raises(ValueError, match="num_particles"):
        ConditionalSMC(ssm, num_particles=1)
    with pytest.raises(ValueError, match="init"):
        ConditionalSMC(object(), num_particles=5)
    with pytest.raises(ValueError, match="ancestor_sampling"):
        ConditionalSMC(ssm, num_particles=5, ancestor_sampling="yes")
    csmc = ConditionalSMC(ssm, num_particles=5)
    with pytest.raises(ValueError, match="at least one time step"):
        csmc.sweep(torch.zeros(0, 1))
    with pytest.raises(ValueError, match="time step 2 contains inf"):
        csmc.sweep(torch.tensor([[0.0], [1.0], [math.inf], [0.0]]))
    with pytest.raises(ValueError, match="time step 1 is partly missing"):
        ConditionalSMC(PlatedWalk(), 5, max_plate_nesting=1).sweep(torch.tensor([[0.0, 0.0], [math.nan, 1.0]]))
    with pytest.raises(ValueError, match="observations must be a tensor"):
        csmc.sweep(3.0)
    path = csmc.sweep(ys)
    with pytest.raises(ValueError, match="reference: a trajectory of 4 time steps, but the observations have 3"):
        csmc.sweep(ys[:3], reference=path)
    with pytest.raises(ValueError, match="reference has"):
        csmc.sweep(ys, reference=path._replace(sites=[path.sites[0]] + [{"z": next(iter(s.values()))} for s in path.sites[1:]]))


class SharedState:
    def init(self, state):
        state["scale"] = torch.ones(())  # not per particle

    def step(self, state, y=None):
        x = pyro.sample("x", dist.Normal(0.0, state["scale"]))
        pyro.sample("y", dist.Normal(x, 1.0), obs=y)


def test_a_state_entry_without_the_particle_dim_is_refused():
    with pytest.raises(ValueError, match=r"state\['scale'\] after init.*leading with the particles"):
        ConditionalSMC(SharedState(), num_particles=3).sweep(torch.zeros(2))
