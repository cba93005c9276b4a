"""At a missing observation the streaming filter still scores the step's other observed sites (a
second sensor, a ``pyro.factor``), exactly as the Kalman filter conditions on them."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.ops import kalman

T, MISSING = 16, (3, 4, 9)


class TwoSensors:
    """x_t = 0.9 x_{t-1} + N(0, 1); y_t ~ N(x_t, 0.5^2) (the filter's observation), z_t ~ N(2 x_t, 0.3^2)."""

    def init(self, state):
        pass

    def step(self, state, y=None, z=None):
        loc = 0.9 * state["x"] if "x" in state else torch.zeros(1)
        state["x"] = pyro.sample("x", dist.Normal(loc, 1.0).to_event(1))
        pyro.sample("y", dist.Normal(state["x"], 0.5).to_event(1), obs=y)
        pyro.sample("z", dist.Normal(2 * state["x"], 0.3).to_event(1), obs=z)


@pytest.mark.parametrize("missing_as", ["none", "nan"])
def test_a_second_sensor_is_used_when_the_first_is_missing(missing_as):
    """Linear-Gaussian: the filter starts each step at the Kalman update (its Laplace start), so
    means and covariances track Kalman's, conditioned on z alone at the missing steps, and the
    running ELBO stays below the exact evidence.
    (Before: z was dropped there, means up to 5.8 Kalman sd off and the ELBO 6.4 nats above
    log p(y, z).)"""
    g = torch.Generator().manual_seed(1)
    x, rows = torch.zeros(()), []
    for t in range(T):
        x = 0.9 * x + torch.randn((), generator=g) if t else torch.randn((), generator=g)
        rows.append(torch.stack([x + 0.5 * torch.randn((), generator=g), 2 * x + 0.3 * torch.randn((), generator=g)]))
    data = torch.stack(rows).double()
    data[list(MISSING), 0] = math.nan
    one = torch.eye(1, dtype=torch.float64)
    exact = kalman.kalman_filter(
        data, 0.9 * one, one, torch.tensor([[1.0], [2.0]], dtype=torch.float64), torch.diag(torch.tensor([0.25, 0.09], dtype=torch.float64)),
        torch.zeros(1, dtype=torch.float64), one,
    )
    pyro.set_rng_seed(0)
    vf = OnlineVariationalFilter(TwoSensors(), StreamingFilterGuide(1))
    vf.init()
    for t in range(T):
        y = None if t in MISSING and missing_as == "none" else data[t, :1]
        vf.step(y, z=data[t, 1:])
    result = vf.result
    sd = exact.covariances[:, 0, 0].sqrt()
    # The documented tracking accuracy: mean |error| / Kalman sd <= 0.05. The start is the exact
    # update; an optimisation the stopping rule runs from it adds Monte Carlo noise (up to 0.13
    # sd and 21% in variance at one step on some seeds), far from the 1.2-5.8 sd and 46-83 times
    # the variance of the fault.
    assert float(((result.filtering_means - exact.means)[:, 0] / sd).abs().mean()) < 0.05
    ratio = result.filtering_covariances[:, 0, 0] / exact.covariances[:, 0, 0]
    assert float((ratio - 1).abs().max()) < 0.5
    assert float(result.log_evidence) < float(exact.log_evidence_increments.sum()) + 3 * float(result.log_evidence_standard_error) + 1e-6
