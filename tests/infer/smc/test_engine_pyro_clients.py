"""Pyro's own code that drives ``SMCFilter``, run on :class:`~pyro_smc.SMC` in its place.

``pyro.contrib.epidemiology``'s ``CompartmentalModel.heuristic()`` builds an ``SMCFilter``, calls
``step()`` with no argument (its models hold their data and observe it themselves) and reads
``smc.state._log_weights`` to pick the most probable particle. Each of those was a failure mode
here once: the attribute did not exist, and a step with no argument was taken as a missing
observation, so every particle kept the same weight and the "most probable" one was arbitrary
(an infeasible start whose infections fall short of the observed cases).
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from tests.tolerances import MC_SIGMAS


def _lgssm(theta=0.5, d=2):
    eye = torch.eye(d)
    return LinearGaussianSSM(theta * eye, eye, eye, 0.1 * eye, torch.zeros(d), eye)


# --- state._log_weights ---------------------------------------------------------------------------
def test_state_log_weights_have_smcfilter_layout():
    ssm = _lgssm()
    _, ys = ssm.simulate(6)
    smc = SMC(ssm, num_particles=50)
    assert smc.state._log_weights is None  # nothing filtered yet
    smc.init()
    for y in ys:
        smc.step(y)
        log_w = smc.state._log_weights
        assert log_w.shape == (50,)  # SMCFilter's layout with one filter
        assert torch.equal(log_w, smc.log_weights[0])
        assert abs(float(torch.logsumexp(log_w, 0))) < 1e-12
    # The same weights as get_empirical(), which SMCFilter builds from them.
    empirical = dist.Empirical(smc.state["x"], smc.state._log_weights)
    assert torch.equal(empirical.mean, smc.get_empirical()["x"].mean)
    with pytest.raises(AttributeError):
        smc.state._log_weights = torch.zeros(50)  # the engine owns the weights
    many = SMC(ssm, num_particles=50, num_filters=3).run(ys)
    assert many.state._log_weights.shape == (3, 50)


def test_state_log_weights_follow_a_checkpoint_restore():
    ssm = _lgssm()
    _, ys = ssm.simulate(8)
    smc = SMC(ssm, num_particles=40)
    smc.init()
    for y in ys[:4]:
        smc.step(y)
    saved = smc.state_dict()
    expected = smc.state._log_weights.clone()
    for y in ys[4:]:
        smc.step(y)
    resumed = SMC(ssm, num_particles=40)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.state._log_weights, expected)


# --- step() with no argument ----------------------------------------------------------------------
class HeldData:
    """The linear-Gaussian model of ``_lgssm`` holding its observations (as epidemiology models do)."""

    def __init__(self, ssm, ys):
        self.ssm, self.ys = ssm, ys

    def init(self, state):
        self.t = 0
        self.ssm.init(state)

    def step(self, state):
        self.ssm.step(state, self.ys[self.t])
        self.t += 1


def test_step_without_arguments_scores_the_models_own_observations():
    ssm = _lgssm()
    pyro.set_rng_seed(0)
    _, ys = ssm.simulate(20)
    exact = float(ssm.kalman_filter(ys).log_evidence)
    smc = SMC(HeldData(ssm, ys), num_particles=500, num_filters=10)
    smc.init()
    for _ in ys:
        smc.step()
    lz = smc.log_evidence
    # Taken as missing observations, every step would leave the weights and log Z at 0.
    assert abs(float(lz.mean()) - exact) < MC_SIGMAS * float(lz.std()) / math.sqrt(lz.numel()) + 0.1


def test_step_with_an_explicit_none_is_predict_only():
    ssm = _lgssm()
    smc = SMC(ssm, num_particles=50).init().step(None)
    assert float(smc.log_evidence) == 0.0
    assert torch.equal(smc.log_weights, torch.full((1, 50), -math.log(50)))


# --- pyro.contrib.epidemiology ------------------------------------------------------------------
@pytest.fixture
def smc_as_smcfilter(monkeypatch):
    """Pyro's compartmental models with SMC where they build an SMCFilter; the filters they build."""
    compartmental = pytest.importorskip("pyro.contrib.epidemiology.compartmental")
    built = []

    class Recorded(SMC):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(compartmental, "SMCFilter", Recorded)
    return built


def _sir_data(model_class, seed, duration=10):
    pyro.set_rng_seed(seed)
    model = model_class(100, 7.0, [None] * duration)
    for _ in range(100):
        data = model.generate({"R0": 1.5, "rho": 0.5})["obs"]
        if data.sum():
            return data
    raise AssertionError("failed to generate positive data")


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_epidemiology_heuristic_finds_a_feasible_start(smc_as_smcfilter, seed):
    from pyro.contrib.epidemiology.models import SimpleSIRModel

    data = _sir_data(SimpleSIRModel, seed)
    init = SimpleSIRModel(100, 7.0, data).heuristic(num_particles=256)
    assert len(smc_as_smcfilter) >= 1
    smc = smc_as_smcfilter[-1]
    # The observations were scored (a step taken as a missing observation leaves log Z at 0).
    assert smc.state._log_weights.shape == (256,)
    assert float(smc.log_evidence) < -0.5
    # Each day's cases are at most the day's new infections (obs ~ Binomial(S2I, rho)): a start
    # that breaks this has zero density, which the SMCFilter this replaces never returns.
    assert (init["S2I"] >= data).all(), (init["S2I"].tolist(), data.tolist())
    assert torch.isfinite(init["R0"]) and 0 < float(init["rho"]) < 1


def test_epidemiology_fit_mcmc_and_svi_on_smc(smc_as_smcfilter):
    from pyro.contrib.epidemiology.models import SimpleSEIRModel, SimpleSIRModel

    data = _sir_data(SimpleSIRModel, seed=0, duration=7)
    model = SimpleSIRModel(100, 7.0, data)
    model.fit_mcmc(warmup_steps=1, num_samples=5, max_tree_depth=2)
    assert smc_as_smcfilter, "fit_mcmc's heuristic start did not run on SMC"
    samples = model.predict(forecast=3)
    assert samples["S"].shape == (5, 10) and torch.isfinite(samples["I"]).all()
    model = SimpleSIRModel(100, 7.0, data)
    model.fit_svi(num_steps=3, num_samples=5)
    assert model.predict(forecast=2)["I"].shape == (5, 9)
    pyro.set_rng_seed(1)
    seir = SimpleSEIRModel(100, 2.0, 7.0, [None] * 7)
    seir_data = seir.generate({"R0": 1.5, "rho": 0.5})["obs"]
    SimpleSEIRModel(100, 2.0, 7.0, seir_data).fit_mcmc(warmup_steps=1, num_samples=3, max_tree_depth=2)


def test_log_evidence_and_weights_before_init_say_what_to_call():
    smc = SMC(_lgssm(), num_particles=10)
    for name in ("log_evidence", "log_weights"):
        with pytest.raises(RuntimeError, match=rf"SMC\.{name}: nothing has been filtered yet; call run\(observations\)"):
            getattr(smc, name)
    smc.init().step(torch.zeros(2))
    assert smc.log_evidence.shape == (1,) and smc.log_weights.shape == (1, 10)
