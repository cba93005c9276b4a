"""The batched inner filters of SMC2: the parameters' layout, reindexing and merging filters."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from pyro_smc.infer.smc2.filters import InnerFilters, log_evidence
from pyro_smc.infer.static_parameters import StaticParameters
from tests.infer.smc2.exact_ar1 import AR1, grid_log_likelihoods, simulate


def make(num_filters=4, num_particles=300, unknown="rho"):
    model = AR1(unknown)
    return InnerFilters(StaticParameters(model), model, None, num_filters, num_particles), model


def test_each_filter_runs_at_its_own_parameter():
    # Filter b estimates log p(y_{1:T} | rho_b): within 5 sd of the Kalman value, where the sd of
    # log Z_hat is measured over 8 independent filters at the same rho.
    pyro.set_rng_seed(0)
    ys = simulate(15, 0)
    rhos = torch.tensor([-0.5, 0.0, 0.5, 0.9])
    inner, _ = make(num_filters=32)
    smc = inner.replay({"rho": rhos.repeat_interleave(8)}, ((), {}), [(y, (), {}) for y in ys])
    estimates = log_evidence(smc).reshape(4, 8)
    exact = grid_log_likelihoods(ys, rhos, torch.tensor(0.5))[-1]
    sd = estimates.std(1).clamp_min(1e-3)
    assert ((estimates.mean(1) - exact).abs() < 5 * sd / 8**0.5 + 0.02).all()


def test_model_values_are_shaped_to_broadcast_and_kept_between_steps():
    inner, _ = make()
    values = {"rho": torch.rand(4)}
    shaped = inner.model_values(values)
    assert shaped["rho"].shape == (4, 1)
    assert inner.model_values(values)["rho"] is shaped["rho"]


def test_select_and_merge_move_whole_filters():
    pyro.set_rng_seed(1)
    ys = simulate(5, 1)
    inner, _ = make(num_filters=4, num_particles=20)
    steps = [(y, (), {}) for y in ys]
    a = inner.replay({"rho": torch.tensor([-0.9, -0.3, 0.3, 0.9])}, ((), {}), steps)
    b = inner.replay({"rho": torch.tensor([0.1, 0.2, 0.4, 0.8])}, ((), {}), steps)
    la, lb, xa, xb = log_evidence(a), log_evidence(b), a.state["x"].clone(), b.state["x"].clone()
    index = torch.tensor([3, 3, 0, 1])
    InnerFilters.select(a, index)
    assert torch.equal(log_evidence(a), la[index]) and torch.equal(a.state["x"], xa[index])
    assert torch.allclose(a.log_weights.logsumexp(-1), torch.zeros(4))
    accept = torch.tensor([True, False, False, True])
    InnerFilters.merge(a, b, accept)
    assert torch.equal(log_evidence(a), torch.where(accept, lb, la[index]))
    assert torch.equal(a.state["x"], torch.where(accept[:, None], xb, xa[index]))
    assert a.records == ()  # the replaced filters' records are dropped; SMC2 keeps its own
    # the merged filters keep stepping
    inner.advance(a, {"rho": torch.zeros(4)}, ys[0], (), {})
    assert torch.isfinite(log_evidence(a)).all()


class NotBatched(PyroModule):
    def __init__(self):
        super().__init__()
        self.rho = PyroSample(dist.Uniform(-1.0, 1.0))

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        rho = float(self.rho)  # a parameter turned into a number: one filter per call only
        state["x"] = pyro.sample("x", dist.Normal(rho * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


def test_a_model_that_does_not_broadcast_gets_the_convention_in_the_error():
    model = NotBatched()
    inner = InnerFilters(StaticParameters(model), model, None, 3, 10)
    smc = inner.start({"rho": torch.zeros(3)}, (), {})
    with pytest.raises(ValueError, match=r"\(num_parameter_particles, 1, \*shape\)"):
        inner.advance(smc, {"rho": torch.zeros(3)}, torch.tensor(0.0), (), {})
