"""A missing observation leaves only its own site unscored: a second observation, data the model
holds and ``pyro.factor`` terms of the same step are scored (against a 1-d Kalman filter)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC
from tests.tolerances import MC_SIGMAS

A, Q, R1, R2, S = 0.9, 0.5, 0.3, 0.6, 0.7
T = 9


def _kalman(steps):
    """log p of a random walk x_0 ~ N(0, 1), x_t = A x_{t-1} + Q e_t (t >= 1), where step t
    observes ``[(value, sd, constant)]``: value ~ N(x_t, sd), plus a constant log term."""
    log_z, m, p = 0.0, 0.0, 1.0
    for t, observations in enumerate(steps):
        if t > 0:
            m, p = A * m, A * A * p + Q * Q
        for value, sd, constant in observations:
            if value is None:
                continue
            v = p + sd * sd
            log_z += -0.5 * (math.log(2 * math.pi * v) + (value - m) ** 2 / v) + constant
            gain = p / v
            m, p = m + gain * (value - m), (1 - gain) * p
    return log_z


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x, y1, y2 = float(torch.randn((), generator=g)), [], []
    for t in range(T):
        if t > 0:
            x = A * x + Q * float(torch.randn((), generator=g))
        y1.append(x + R1 * float(torch.randn((), generator=g)))
        y2.append(x + R2 * float(torch.randn((), generator=g)))
    return y1, y2


def _unbiased(log_z_hat, exact):
    ratio = (log_z_hat - exact).exp()
    return abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(ratio.numel())


class TwoSensors:
    """Sensor 1 is the first argument (``None`` when missing), sensor 2 the second."""

    def init(self, state):
        self.t = 0

    def step(self, state, y1=None, y2=None):
        loc = A * state["x"] if "x" in state else torch.zeros(())
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, Q if "x" in state else 1.0))
        pyro.sample(f"y1_{self.t}", dist.Normal(state["x"], R1), obs=y1)
        pyro.sample(f"y2_{self.t}", dist.Normal(state["x"], R2), obs=y2)
        self.t += 1


class Pulled:
    """A ``pyro.factor`` in every transition, the observation (NaN when missing) as an argument."""

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = A * state["x"] if "x" in state else torch.zeros(())
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, Q if "x" in state else 1.0))
        pyro.factor(f"pull_{self.t}", -0.5 * state["x"] ** 2 / S**2)
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], R1), obs=y)
        self.t += 1


_MISSING = (0, 3, 4, 7)
# The factor exp(-x^2 / (2 S^2)) is N(0; x, S) times sqrt(2 pi S^2).
_PULL = (0.0, S, 0.5 * math.log(2 * math.pi * S * S))


@pytest.mark.parametrize("missing_as", ["none", "nan"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_missing_first_observation_keeps_the_second(missing_as, seed):
    """Sensor 1 missing at some steps, passed as None or NaN: sensor 2 is still scored there.
    (Before, every observed site of such a step was dropped: log Z was 12 nats too high.)"""
    y1, y2 = _data(seed)
    exact = _kalman([[(None if t in _MISSING else y1[t], R1, 0.0), (y2[t], R2, 0.0)] for t in range(T)])
    pyro.set_rng_seed(seed)
    smc = SMC(TwoSensors(), num_particles=100, num_filters=400)
    smc.init()
    with torch.no_grad():
        for t in range(T):
            first = torch.tensor(math.nan if missing_as == "nan" else y1[t]) if t in _MISSING else torch.tensor(y1[t])
            smc.step(None if t in _MISSING and missing_as == "none" else first, torch.tensor(y2[t]))
    assert _unbiased(smc.log_evidence, exact)
    # The missing steps still gained evidence (sensor 2's), in every filter.
    increments = smc.log_evidence_increments
    assert bool((increments[list(_MISSING)] != 0).all())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_factor_is_scored_at_a_missing_step(seed):
    """NaN rows in ``run``: the factor of the transition is scored at every step."""
    y1, _ = _data(seed)
    ys = torch.tensor(y1)
    ys[list(_MISSING)] = math.nan
    exact = _kalman([[_PULL, (None if t in _MISSING else y1[t], R1, 0.0)] for t in range(T)])
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        smc = SMC(Pulled(), num_particles=100, num_filters=400).run(ys)
    assert _unbiased(smc.log_evidence, exact)


def test_a_factor_is_scored_on_a_missing_row_of_a_batch_but_not_past_the_end():
    """Batched sequences: a NaN row inside a sequence drops its observation only; past a
    sequence's end (``lengths``) nothing is scored, the factor included."""
    y1, _ = _data(3)
    ys = torch.tensor(y1).repeat(2, 1)
    ys[0, 4] = math.nan
    lengths = torch.tensor([T, 5])
    exact = [
        _kalman([[_PULL, (None if t == 4 else y1[t], R1, 0.0)] for t in range(T)]),
        _kalman([[_PULL, (y1[t], R1, 0.0)] for t in range(5)]),
    ]
    K = 400
    pyro.set_rng_seed(3)
    with torch.no_grad():
        smc = SMC(Pulled(), num_particles=100, num_filters=2 * K).run(
            ys.repeat_interleave(K, 0), lengths=lengths.repeat_interleave(K), batched=True
        )
    log_z = smc.log_evidence.reshape(2, K)
    assert _unbiased(log_z[0], exact[0]) and _unbiased(log_z[1], exact[1])
    increments = smc.log_evidence_increments.reshape(T, 2, K)
    assert bool((increments[4, 0] != 0).all()) and bool((increments[5:, 1] == 0).all())


class Ambiguous:
    """Two observed sites, neither taking the first argument as given."""

    def init(self, state, *args):
        self.t = 0

    def step(self, state, y=None, y2=None):
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(torch.zeros(()), 1.0))
        pyro.sample(f"a_{self.t}", dist.Normal(state["x"], 1.0), obs=2 * y)
        pyro.sample(f"b_{self.t}", dist.Normal(state["x"], 1.0), obs=y2)
        self.t += 1


def test_an_unrecognisable_missing_site_is_an_error_naming_the_step():
    """NaN doubled is still NaN, so the NaN test finds site a; zeros (a batch's missing row) are
    not recognisable when two sites observe: refused rather than guessed."""
    smc = SMC(Ambiguous(), num_particles=10)
    smc.init()
    smc.step(torch.tensor(math.nan), torch.tensor(0.5))  # site a holds the NaN: b is scored
    assert smc.log_evidence_increments[-1] != 0
    ys = torch.tensor([[0.5, math.nan], [0.5, 0.2]])
    with pytest.raises(ValueError, match="time step 1.*cannot tell"):
        SMC(Ambiguous(), num_particles=10, num_filters=2).run(ys, torch.tensor(0.5), batched=True)


class PulledFree:
    """``Pulled`` with one site name per role (the other engines condition step by step)."""

    def init(self, state):
        state["x"] = pyro.sample("x", dist.Normal(torch.zeros(()), 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(A * state["x"], Q))
        pyro.factor("pull", -0.5 * state["x"] ** 2 / S**2)
        pyro.sample("y", dist.Normal(state["x"], R1), obs=y)


def _pulled_log_density(x, ys):
    """log f + factors + log g of a path ``x`` ``(T + 1,)`` of ``PulledFree``, NaN steps unscored."""
    total = dist.Normal(0.0, 1.0).log_prob(x[0])
    for t, y in enumerate(ys.tolist()):
        total = total + dist.Normal(A * x[t], Q).log_prob(x[t + 1]) - 0.5 * x[t + 1] ** 2 / S**2
        if not math.isnan(y):
            total = total + dist.Normal(x[t + 1], R1).log_prob(torch.tensor(y))
    return total


def test_particle_gibbs_scores_the_factor_of_a_missing_step():
    """The conditional SMC's trajectory density keeps the factor at a NaN step (it dropped it)."""
    from pyro_smc.infer.pmcmc.csmc import ConditionalSMC

    ys = torch.tensor([0.3, math.nan, -0.2, 0.1])
    csmc = ConditionalSMC(PulledFree(), num_particles=5)
    pyro.set_rng_seed(0)
    path = csmc.sweep(ys)
    x = torch.stack([sites["x"].reshape(()) for sites in path.sites])
    expected = _pulled_log_density(x, ys)
    assert torch.allclose(csmc.log_density(path, ys), expected)
    assert torch.allclose(path.log_density, expected)


def test_the_online_filter_scores_the_factor_of_a_missing_step():
    """The streaming filter's log f + log g at a missing step keeps the factor (it dropped it)."""
    from pyro_smc.infer.online.context import StepContext

    model = PulledFree()
    state = {}
    model.init(state)
    previous = dist.Normal(torch.zeros(1), 1.0).to_event(1)
    ctx = StepContext(model, dict(vars(model)), {"x": torch.zeros(1)}, previous, None, True, 1, state_key="x")
    ctx, _ = ctx.discover(num_samples=4, state_dim=1)
    x_prev, x_t = torch.tensor([[0.5], [-1.0]]), torch.tensor([[0.2], [0.7]])
    log_joint, _ = ctx.log_joint(x_prev, x_t)
    expected = dist.Normal(A * x_prev, Q).log_prob(x_t).squeeze(-1) - 0.5 * x_t.squeeze(-1) ** 2 / S**2
    assert torch.allclose(log_joint, expected)


def test_padding_alone_needs_no_missing_site():
    """Past a sequence's end every observed term is masked, so a model whose observed sites do not
    show which takes the observation runs on padded batches (only a NaN row inside a sequence
    needs to know)."""
    ys = torch.tensor([[0.5, 0.1, -0.2], [0.5, 0.2, 0.0]])
    smc = SMC(Ambiguous(), num_particles=10, num_filters=2).run(ys, torch.tensor(0.5), lengths=torch.tensor([3, 1]), batched=True)
    increments = smc.log_evidence_increments.reshape(3, 2)
    assert bool((increments[1:, 1] == 0).all()) and bool((increments[:, 0] != 0).all())
