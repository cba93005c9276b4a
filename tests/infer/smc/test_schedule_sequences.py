"""SMC and SMCELBO on batches of sequences (``batched=True``, ``lengths``), against Kalman.

See ``docs/math/smc.md#batches-of-sequences``.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC, SMCELBO
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import OTResampler, SystematicResampler
from tests.tolerances import MC_SIGMAS

torch.set_num_threads(1)


def _lgssm(theta=0.8, r=1.0, d=2, full_r=False):
    eye = torch.eye(d)
    R = r * eye
    if full_r:
        R = R + 0.3 * (torch.ones(d, d) - eye)
    return LinearGaussianSSM(theta * eye, eye, eye, R, torch.zeros(d), eye)


def _sequences(ssm, num_sequences, num_steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([ssm.simulate(num_steps, generator=generator)[1] for _ in range(num_sequences)])


class ShiftedProposal:
    """q(x_t | x_{t-1}, y_t): the prior mean moved towards y_t; it needs the observation."""

    def __init__(self, model):
        self.model = model

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        phi = pyro.param("phi", torch.tensor(0.3))
        prior_mean = state["x"] @ self.model.A.T if self.t else torch.zeros(2)
        pyro.sample(f"x_{self.t}", dist.Normal(prior_mean + phi * (y - prior_mean), 0.9).to_event(1))
        self.t += 1


# --- the same random numbers ----------------------------------------------------------------------
@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.5)], ids=["systematic", "ot"])
@pytest.mark.parametrize("with_guide", [False, True], ids=["bootstrap", "guide"])
def test_copies_of_one_sequence_equal_the_unbatched_run(resampler, with_guide):
    """B copies of one sequence with batched=True draw the same random numbers as B filters on that
    sequence: bit for bit the same run, though the model sees (B, 1, dy) instead of (dy,)."""
    ssm = _lgssm(r=0.3)
    ys = _sequences(ssm, 1, 12)[0]
    guide = ShiftedProposal(ssm) if with_guide else None
    runs = []
    for observations, batched in ((ys, False), (ys.expand(4, *ys.shape).clone(), True)):
        pyro.set_rng_seed(0)
        runs.append(SMC(ssm, guide, num_particles=30, num_filters=4, resampler=resampler).run(observations, batched=batched))
    a, b = runs
    assert torch.equal(a.log_evidence, b.log_evidence)
    assert torch.equal(a.log_evidence_increments, b.log_evidence_increments)
    assert torch.equal(a.filtering_means["x"], b.filtering_means["x"])
    assert torch.equal(a.resampled, b.resampled)


def test_one_filter_batched_is_the_unbatched_run():
    ssm = _lgssm(r=0.3)
    ys = _sequences(ssm, 1, 10)
    pyro.set_rng_seed(0)
    a = SMC(ssm, num_particles=50).run(ys[0])
    pyro.set_rng_seed(0)
    b = SMC(ssm, num_particles=50).run(ys, batched=True)
    assert a.log_evidence.shape == b.log_evidence.shape == (1,)
    assert torch.equal(a.log_evidence, b.log_evidence)
    assert torch.equal(a.filtering_means["x"], b.filtering_means["x"])


# --- against Kalman, per sequence ------------------------------------------------------------------
def _unbiased(log_z_hat, exact):
    """Z_hat / Z has mean 1 (exact in the exp domain), within MC_SIGMAS standard errors."""
    ratio = (log_z_hat - exact).exp()
    return abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(ratio.numel())


def _evidence_per_sequence(ssm, ys, K, seed):
    """``log Z_hat (S, K)``: each of the ``S`` sequences ``ys`` run by ``K`` filters of one batched pass."""
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=100, num_filters=ys.shape[0] * K).run(ys.repeat_interleave(K, 0), batched=True)
    return smc, smc.log_evidence.reshape(ys.shape[0], K)


def test_each_filter_estimates_its_own_sequence_evidence():
    """Three different sequences, each run by K filters in one batch; Z_hat_b is unbiased for
    p(y^b) and the three evidences are far apart, so a mix-up of sequences would show."""
    ssm = _lgssm()
    S, K, T = 3, 300, 8
    ys = _sequences(ssm, S, T, seed=1)
    exact = torch.stack([ssm.log_evidence(y) for y in ys])
    _, log_z = _evidence_per_sequence(ssm, ys, K, seed=2)
    for s in range(S):
        assert _unbiased(log_z[s], exact[s]), s


def test_lengths_give_the_evidence_of_the_first_steps():
    """A filter of length L estimates p(y_{1:L}) (Kalman on the truncated sequence), whatever the
    padding holds; past its end its increments are exactly zero and its weights do not move."""
    ssm = _lgssm()
    lengths = torch.tensor([8, 5, 1])
    S, K, T = 3, 300, 8
    ys = _sequences(ssm, S, T, seed=3)
    exact = torch.stack([ssm.log_evidence(y[:L]) for y, L in zip(ys, lengths.tolist())])
    padded = ys.clone()
    padded[1, 5:] = math.nan
    padded[2, 1:] = math.inf
    runs = []
    for observations in (ys, padded):
        pyro.set_rng_seed(4)
        with torch.no_grad():
            runs.append(SMC(ssm, num_particles=100, num_filters=S * K).run(
                observations.repeat_interleave(K, 0), lengths=lengths.repeat_interleave(K), batched=True))
    smc, other = runs
    assert torch.equal(smc.log_evidence, other.log_evidence)  # the padding is never read
    log_z = smc.log_evidence.reshape(S, K)
    for s in range(S):
        assert _unbiased(log_z[s], exact[s]), s
    increments = smc.log_evidence_increments.reshape(T, S, K)
    past = torch.arange(T).unsqueeze(-1) >= lengths  # (T, S)
    assert bool((increments[past] == 0).all()) and bool((increments[~past] != 0).all())
    ess = smc.ess_history.reshape(T, S, K)
    # The filter of length 1 (resampled, or not, after its one observation) never reweights again.
    assert torch.equal(ess[2:, 2], ess[1:-1, 2]) and not bool(smc.resampled.reshape(T, S, K)[1:, 2].any())


def test_nan_rows_are_per_filter_missing_observations():
    """An all-NaN row is predict-only for its filter alone (also for a correlated R, whose partly
    missing rows are refused); a partly-NaN row is scored on its observed entries."""
    ssm = _lgssm(d=3)
    S, K, T = 2, 300, 6
    ys = _sequences(ssm, S, T, seed=5)
    ys[0, 2] = math.nan
    ys[1, 3, 1] = math.nan
    exact = torch.stack([ssm.log_evidence(y) for y in ys])  # Kalman skips NaN entries
    smc, log_z = _evidence_per_sequence(ssm, ys, K, seed=6)
    for s in range(S):
        assert _unbiased(log_z[s], exact[s]), s
    increments = smc.log_evidence_increments.reshape(T, S, K)
    assert bool((increments[2, 0] == 0).all()) and bool((increments[2, 1] != 0).all())

    full = _lgssm(d=3, full_r=True)
    whole_rows = ys.clone()
    whole_rows[1, 3] = math.nan
    SMC(full, num_particles=10, num_filters=2).run(whole_rows, batched=True)
    with pytest.raises(ValueError, match="factorise"):
        SMC(full, num_particles=10, num_filters=2).run(ys, batched=True)


class FarProposal:
    """A proposal nowhere near the model: particles it moves sit at 1000."""

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        pyro.sample(f"x_{self.t}", dist.Normal(torch.full((2,), 1000.0), 1e-3).to_event(1))
        self.t += 1


def test_a_masked_filter_moves_by_the_model_the_others_by_the_guide():
    """At a step where filter 1 has no observation, filter 0's particles come from the guide and
    filter 1's from the model's transition, with no weight change for filter 1."""
    ssm = _lgssm()
    ys = _sequences(ssm, 2, 3, seed=7)
    pyro.set_rng_seed(0)
    smc = SMC(ssm, FarProposal(), num_particles=20, num_filters=2).run(ys, lengths=torch.tensor([3, 2]), batched=True)
    means = smc.filtering_means["x"]
    assert bool((means[:, 0] > 999).all())
    # Filter 1 reached 1000 by the guide, then moved by x_t = 0.8 x_{t-1} + N(0, 1).
    assert bool(((means[2, 1] - 0.8 * means[1, 1]).abs() < 5 / math.sqrt(20)).all())
    assert bool((smc.log_evidence_increments[2, 1] == 0).all())
    assert torch.equal(smc.ess_history[2, 1], smc.ess_history[1, 1]) or bool(smc.resampled[1, 1])


def test_a_guide_runs_at_every_step_of_a_padded_batch():
    """The guide is called at every step (padding reaches it as zeros); each sequence's Z_hat is
    unbiased for the Kalman evidence of its first L_b steps, the predicted filtering means of the
    ended sequence match Kalman's prediction, and the guide's parameter gets a gradient."""
    ssm = _lgssm(theta=0.95)
    S, K, T = 2, 200, 6
    lengths = torch.tensor([6, 3])
    ys = _sequences(ssm, S, T, seed=8)
    calls = []

    class Counting(ShiftedProposal):
        def step(self, state, y):
            calls.append(self.t)
            super().step(state, y)

    pyro.clear_param_store()
    pyro.set_rng_seed(9)
    smc = SMC(ssm, Counting(ssm), num_particles=200, num_filters=S * K).run(
        ys.repeat_interleave(K, 0), lengths=lengths.repeat_interleave(K), batched=True)
    assert calls == list(range(T))
    smc.log_evidence.sum().backward()
    assert pyro.param("phi").unconstrained().grad is not None
    log_z = smc.log_evidence.detach().reshape(S, K)
    for s, L in enumerate(lengths.tolist()):
        assert _unbiased(log_z[s], ssm.log_evidence(ys[s, :L])), s
    ended = ys[1].clone()
    ended[3:] = math.nan
    kalman = ssm.kalman_filter(ended)
    means = smc.filtering_means["x"].detach().reshape(T, S, K, 2)[:, 1]  # (T, K, 2)
    error = means.mean(1) - kalman.means
    sem = means.std(1) / math.sqrt(K)
    assert bool((error.abs() < MC_SIGMAS * sem).all()), (error, sem)


@pytest.mark.parametrize("gradient", ["stop_gradient", "marginal_stop_gradient"])
def test_stop_gradient_modes_keep_the_forward_pass_with_lengths(gradient):
    """Masked filters keep their draws' scores (zero in value): the forward numbers are those of
    the reparameterised run, and the gradient reaches the model's parameter."""
    ssm = _lgssm()
    ys = _sequences(ssm, 3, 6, seed=13)
    lengths = torch.tensor([6, 4, 2])
    A = ssm.A.clone().requires_grad_()
    ssm.A = A
    runs = []
    for resampler in (SystematicResampler(), SystematicResampler(gradient=gradient)):
        pyro.set_rng_seed(14)
        runs.append(SMC(ssm, num_particles=20, num_filters=3, resampler=resampler).run(ys, lengths=lengths, batched=True))
    assert torch.equal(runs[0].log_evidence.detach(), runs[1].log_evidence.detach())
    (grad,) = torch.autograd.grad(runs[1].log_evidence.sum(), A)
    assert bool(torch.isfinite(grad).all()) and bool((grad != 0).any())


# --- SMCELBO ----------------------------------------------------------------------------------------
def test_smcelbo_scales_a_minibatch_to_the_data_set():
    """loss = -(D/B) sum_b mean_k log Z_hat_{b,k}: D times the minibatch mean (the default)."""
    ssm = _lgssm()
    B, K, D = 3, 2, 50
    ys = _sequences(ssm, B, 7, seed=8)
    lengths = torch.tensor([7, 3, 5])
    losses = {}
    for num_sequences in (None, D):
        elbo = SMCELBO(num_particles=20, num_filters=K, num_sequences=num_sequences)
        pyro.set_rng_seed(9)
        losses[num_sequences] = elbo.differentiable_loss(ssm, None, ys, lengths=lengths, batched=True)
        log_z = elbo.smc.log_evidence.reshape(B, K)
        scale = (D if num_sequences else 1) / B
        assert torch.allclose(losses[num_sequences], -scale * log_z.mean(-1).sum(), rtol=1e-12, atol=0)
    assert torch.allclose(losses[D], D * losses[None], rtol=1e-12, atol=0)
    assert elbo.smc.log_evidence.shape == (B * K,)
    # The sequences' filters are rows b * K .. b * K + K - 1: sequence 1 stops after 3 steps.
    increments = elbo.smc.log_evidence_increments.reshape(7, B, K)
    assert bool((increments[3:, 1] == 0).all()) and bool((increments[:3, 1] != 0).all())


def test_smcelbo_unbatched_loss_is_unchanged():
    ssm = _lgssm()
    ys = _sequences(ssm, 1, 6, seed=10)[0]
    elbo = SMCELBO(num_particles=20, num_filters=3)
    pyro.set_rng_seed(11)
    loss = elbo.differentiable_loss(ssm, None, ys)
    assert torch.equal(loss, -elbo.smc.log_evidence.mean())
    pyro.set_rng_seed(11)
    assert torch.equal(SMCELBO(num_particles=20, num_filters=3, num_sequences=4).differentiable_loss(ssm, None, ys), 4 * loss)


def test_svi_steps_on_minibatches():
    ssm = _lgssm()
    ys = _sequences(ssm, 4, 6, seed=12)
    pyro.clear_param_store()
    svi = pyro.infer.SVI(ssm, ShiftedProposal(ssm), pyro.optim.Adam({"lr": 0.01}), loss=SMCELBO(num_particles=20, num_sequences=4))
    for batch in (ys[:2], ys[2:]):
        assert math.isfinite(svi.step(batch, lengths=torch.tensor([6, 5]), batched=True))


# --- bad input --------------------------------------------------------------------------------------
def test_bad_input_names_the_argument():
    ssm = _lgssm()
    ys = _sequences(ssm, 3, 5)
    smc = SMC(ssm, num_particles=10, num_filters=3)
    with pytest.raises(ValueError, match="observations.*num_filters == 3"):
        smc.run(ys[:2], batched=True)
    with pytest.raises(ValueError, match="observations"):
        smc.run(ys[0, 0], batched=True)
    for bad in (torch.tensor([5, 0, 3]), torch.tensor([5, 6, 3])):
        with pytest.raises(ValueError, match=r"lengths must lie in \[1, T\]"):
            smc.run(ys, lengths=bad, batched=True)
    with pytest.raises(ValueError, match="lengths must be an integer tensor.*float"):
        smc.run(ys, lengths=torch.tensor([5.0, 4.0, 3.0]), batched=True)
    with pytest.raises(ValueError, match=r"lengths must be an integer tensor of shape \(3,\)"):
        smc.run(ys, lengths=torch.tensor([5, 4]), batched=True)
    with pytest.raises(ValueError, match="lengths needs batched=True"):
        smc.run(ys[0], lengths=torch.tensor([5]))
    with pytest.raises(ValueError, match="batched must be True or False"):
        smc.run(ys, batched=1)
    inf = ys.clone()
    inf[1, 2, 0] = math.inf
    with pytest.raises(ValueError, match="time step 2.*sequence 1"):
        smc.run(inf, batched=True)
    with pytest.raises(ValueError, match="num_sequences"):
        SMCELBO(num_particles=10, num_sequences=0)
    with pytest.raises(ValueError, match="lengths must lie"):
        SMCELBO(num_particles=10).loss(ssm, None, ys, lengths=torch.tensor([5, 9, 1]), batched=True)
