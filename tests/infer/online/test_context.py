"""What the streaming filter's step context accepts from a model's ``state``."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide

_A = torch.tensor([[0.9, 0.1], [0.0, 0.8]])


class _StoredPriorMean:
    """Keeps ``A x`` in ``state`` for the next step (valid under SMC, which resamples it with x)."""

    def init(self, state):
        pass

    def step(self, state, y=None):
        loc = state.get("Ax", torch.zeros(2))
        x = pyro.sample("x", dist.Normal(loc, 0.5 if "Ax" in state else 1.0).to_event(1))
        state["x"], state["Ax"] = x, x @ _A.to(x).T
        pyro.sample("y", dist.Normal(x, 0.3).to_event(1), obs=y)


class _LaggedAR2:
    def init(self, state):
        pass

    def step(self, state, y=None):
        if "x" in state:
            lag = state.get("lag", torch.zeros_like(state["x"]))
            x = pyro.sample("x", dist.Normal(0.5 * state["x"] + 0.4 * lag, 1.0).to_event(1))
            state["lag"] = state["x"]
        else:
            x = pyro.sample("x", dist.Normal(torch.zeros(1), 1.0).to_event(1))
        state["x"] = x
        pyro.sample("y", dist.Normal(x, 0.5).to_event(1), obs=y)


class _Counter:
    """A state entry that does not vary over the draws (a step count) is fine."""

    def init(self, state):
        pass

    def step(self, state, y=None):
        state["n"] = state.get("n", torch.tensor(0.0)) + 1
        x = pyro.sample("x", dist.Normal(0.8 * state.get("x", torch.zeros(1)), 1.0).to_event(1))
        state["x"] = x
        pyro.sample("y", dist.Normal(x, 0.5).to_event(1), obs=y)


@pytest.mark.parametrize("model, key, dim", [(_StoredPriorMean, "Ax", 2), (_LaggedAR2, "lag", 1)])
def test_a_state_entry_computed_from_the_draws_is_refused(model, key, dim):
    """Before: the filter redrew x_(t-1) under the latent's key alone and left such an entry paired
    with other draws: a running ELBO 16 nats below the exact evidence (-57.2 against -41.4) with a
    stored prior mean, 8 standard errors low with an AR(2) lag, and no warning. Now an error
    naming the entry and the step."""
    ys = torch.randn(6, dim, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"state\['{key}'\] varies with the draws of 'x' at step 1"):
        OnlineVariationalFilter(model(), StreamingFilterGuide(dim, covariance="full")).run(ys)


def test_a_state_entry_that_does_not_vary_over_the_draws_is_kept():
    ys = torch.randn(6, 1, generator=torch.Generator().manual_seed(0))
    vf = OnlineVariationalFilter(_Counter(), StreamingFilterGuide(1)).run(ys)
    assert torch.isfinite(vf.log_evidence)
