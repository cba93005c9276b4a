"""The score recursion of online parameter learning when a parameter is first read after t = 0."""

import pyro
import pyro.distributions as dist
import torch

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide


class Observed:
    """``c`` scales the observation at every step; ``a`` is the transition's, first read at t = 1
    (or, with ``early``, read at t = 0 too, where it has no effect)."""

    def __init__(self, early: bool):
        self.early = early

    def init(self, state):
        pass

    def step(self, state, y=None):
        c = pyro.param("c", torch.tensor([0.8]))
        if "x" in state:
            a = pyro.param("a", torch.tensor([0.5]))
            x = pyro.sample("x", dist.Normal(a * state["x"], 0.7).to_event(1))
        else:
            zero = 0.0 * pyro.param("a", torch.tensor([0.5])) if self.early else 0.0
            x = pyro.sample("x", dist.Normal(torch.zeros(1) + zero, 1.0).to_event(1))
        state["x"] = x
        pyro.sample("y", dist.Normal(c * x, 0.4).to_event(1), obs=y)


def _gradient(early: bool, ys: torch.Tensor) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    vf = OnlineVariationalFilter(Observed(early), StreamingFilterGuide(1), learn_parameters=True, parameter_lr=lambda t: 0.0)
    for y in ys:
        vf.step(y)
    return vf.log_evidence_gradient


def test_a_parameter_first_read_later_keeps_the_others_score():
    """Reading ``a`` first at t = 1 gives the gradient of reading it (to no effect) from t = 0:
    its score so far is zero and ``c``'s recursion goes on. (The recursion restarted, and
    d log p / d c lost its t = 0 term: 10.98 against the exact 12.70 on a test model.)"""
    ys = torch.randn(12, 1, generator=torch.Generator().manual_seed(3))
    late, early = _gradient(False, ys), _gradient(True, ys)
    assert set(late) == set(early) == {"a", "c"}
    for name in ("a", "c"):
        assert torch.allclose(late[name], early[name], rtol=1e-8, atol=1e-10), (name, late[name], early[name])
