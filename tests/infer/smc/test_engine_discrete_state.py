"""Discrete latent state under ``SMC``: labels are copied from ancestors, never averaged.

A regime label may be an integer tensor (``dist.Categorical``) or a float one (``dist.Bernoulli``
draws 0./1.). ``SMC`` reads each state key's site off the trace and passes the keys of
discrete-support sites to the resampler as integers, so optimal transport moves the continuous
state within each label and sets the labels' offspring by systematic resampling; a kernel
resampler jitters the continuous state only. Oracles: the exact forward(-backward) algorithm of
the hidden Markov model, and exact enumeration of the regime paths with a Kalman filter per path
for the switching AR. Tolerances are ``MC_SIGMAS`` standard errors over independent filters.
"""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC
from pyro_smc.resamplers import KernelResampler, OTResampler, SystematicResampler
from tests.tolerances import MC_SIGMAS

TRANS = [[0.9, 0.1], [0.2, 0.8]]
MU = [-1.0, 1.5]


class HMM:
    """Two-state Markov chain ``z_t`` observed as ``y_t ~ N(mu[z_t], 1)``; the label is the only
    state, drawn as a float (``"bernoulli"``) or an integer (``"categorical"``)."""

    def __init__(self, label):
        self.label = label
        self.trans, self.mu = torch.tensor(TRANS), torch.tensor(MU)

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        p1 = torch.tensor(0.5) if self.t == 0 else self.trans[state["z"].long(), 1]
        fn = dist.Bernoulli(p1) if self.label == "bernoulli" else dist.Categorical(torch.stack([1 - p1, p1], -1))
        state["z"] = pyro.sample(f"z_{self.t}", fn)
        pyro.sample(f"y_{self.t}", dist.Normal(self.mu[state["z"].long()], 1.0), obs=y)
        self.t += 1

    def simulate(self, steps, seed):
        g = torch.Generator().manual_seed(seed)
        z, ys = int(torch.rand((), generator=g) < 0.5), []
        for t in range(steps):
            if t:
                z = int(torch.rand((), generator=g) < self.trans[z, 1])
            ys.append(self.mu[z] + torch.randn((), generator=g))
        return torch.stack(ys)

    def exact(self, ys):
        """``(log p(y_{1:T}), filtering P(z_t = 1 | y_{1:t}), smoothing P(z_t = 1 | y_{1:T}))``."""
        lik = dist.Normal(self.mu, 1.0).log_prob(ys.unsqueeze(-1)).exp()  # (T, 2)
        alpha, log_z = [], 0.0
        a = torch.tensor([0.5, 0.5])
        for t in range(len(ys)):
            a = (a @ self.trans if t else a) * lik[t]
            log_z = log_z + a.sum().log()
            a = a / a.sum()
            alpha.append(a)
        beta, smoothed = torch.ones(2), [None] * len(ys)
        for t in range(len(ys) - 1, -1, -1):
            s = alpha[t] * beta
            smoothed[t] = (s / s.sum())[1]
            beta = self.trans @ (lik[t] * beta)
            beta = beta / beta.sum()
        return log_z, torch.stack([a[1] for a in alpha]), torch.stack(smoothed)


RESAMPLERS = {
    "systematic": SystematicResampler,
    "ot": lambda: OTResampler(0.5),
    "kernel": lambda: KernelResampler(0.3),
}


@pytest.mark.parametrize("label", ["bernoulli", "categorical"])
@pytest.mark.parametrize("resampler", sorted(RESAMPLERS))
def test_hmm_label_evidence_filter_and_smoother_match_forward_backward(label, resampler):
    """The evidence (``E[Z_hat] = Z``, checked on ``Z_hat / Z``), the filtering probabilities
    (the means of the label, which ``filtering_means`` now reports for integer labels too) and
    FFBS's smoothing marginals agree with the forward-backward algorithm; every label stays 0
    or 1. Before the fix, OT transported a float label (log Z off by 16 nats on a 60-step
    series, fractional labels, and ``smooth`` raised a Bernoulli support error), and an integer
    label had no filtering mean and no smoothed trajectory (both returned ``{}``)."""
    model = HMM(label)
    ys = model.simulate(30, seed=3)
    log_z, filtering, smoothing = model.exact(ys)
    B, N, S = 100, 200, 10
    pyro.set_rng_seed(1)
    smc = SMC(model, num_particles=N, num_filters=B, resampler=RESAMPLERS[resampler](), store_history=True).run(ys)
    assert bool(((smc.state["z"] == 0) | (smc.state["z"] == 1)).all())
    ratio = (smc.log_evidence - log_z).exp()
    assert abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(B)
    p = smc.filtering_means["z"]  # (T, B): each filter's weighted P(z_t = 1)
    assert p.shape == (30, B) and p.dtype == ys.dtype
    # Pooled with the evidence weights, the self-normalised O(1/N) bias drops to O(1/(N B)).
    v = (smc.log_evidence - smc.log_evidence.logsumexp(0)).exp() * B
    pooled = (v * p).mean(-1)
    se = (v * (p - pooled.unsqueeze(-1))).std(-1) / math.sqrt(B)
    assert ((pooled - filtering).abs() < MC_SIGMAS * se + 1e-3).all()
    draws = smc.smooth(S)["z"]  # (S, T, B)
    assert draws.dtype == smc.state["z"].dtype and bool(((draws == 0) | (draws == 1)).all())
    per_filter = draws.double().mean(0)  # (T, B); filters independent, draws within one are not
    # FFBS given N particles has an O(1/N) bias; 3/N bounds it for these well-mixing chains.
    assert ((per_filter.mean(-1) - smoothing).abs() < MC_SIGMAS * per_filter.std(-1) / math.sqrt(B) + 3 / N).all()


class SwitchingAR:
    """``z_t`` a two-state chain (a float ``dist.Bernoulli`` label), ``x_t = a[z_t] x_{t-1} + q[z_t] e_t``,
    ``y_t = x_t + 0.5 v_t``: continuous and discrete state side by side."""

    def __init__(self):
        self.a, self.q, self.r = torch.tensor([0.9, -0.5]), torch.tensor([0.3, 1.0]), 0.5

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        t, trans = self.t, torch.tensor(TRANS)
        z = pyro.sample(f"z_{t}", dist.Bernoulli(torch.tensor(0.5) if t == 0 else trans[state["z"].long(), 1]))
        loc = 0.0 if t == 0 else self.a[z.long()] * state["x"]
        state["z"], state["x"] = z, pyro.sample(f"x_{t}", dist.Normal(loc, self.q[z.long()]))
        pyro.sample(f"y_{t}", dist.Normal(state["x"], self.r), obs=y)
        self.t += 1

    def log_evidence(self, ys):
        """Exact ``log p(y_{1:T})``: every regime path, a scalar Kalman filter along each."""
        T, trans = len(ys), torch.tensor(TRANS)
        paths = torch.tensor(list(itertools.product([0, 1], repeat=T)))  # (2^T, T)
        log_prior = math.log(0.5) + trans.log()[paths[:, :-1], paths[:, 1:]].sum(-1)
        m, v, ll = torch.zeros(len(paths)), torch.zeros(len(paths)), torch.zeros(len(paths))
        for t in range(T):
            z = paths[:, t]
            m, v = (torch.zeros_like(m), self.q[z] ** 2) if t == 0 else (self.a[z] * m, self.a[z] ** 2 * v + self.q[z] ** 2)
            s = v + self.r**2
            ll = ll + dist.Normal(m, s.sqrt()).log_prob(ys[t])
            m, v = m + v / s * (ys[t] - m), v - v**2 / s
        return torch.logsumexp(log_prior + ll, 0)


@pytest.mark.parametrize("resampler", ["ot", "kernel"])
def test_switching_ar_float_label_is_copied_not_moved(resampler):
    """Beside a continuous ``x``, OT transports ``x`` and a kernel jitters it, but the float label
    keeps its values 0/1 at every step and the evidence agrees with exact enumeration. Before
    the fix the label took fractional values at most steps and ``smooth`` raised a support error;
    ``smooth`` now refuses the model for the right reason (``x_t`` depends on ``z_t``)."""
    ys = torch.tensor([0.3, 1.1, 0.2, -1.4, 2.0, -0.6, 0.1, 0.4, -0.2, 0.9])
    log_z = SwitchingAR().log_evidence(ys)
    B = 40
    pyro.set_rng_seed(0)
    smc = SMC(SwitchingAR(), num_particles=300, num_filters=B, resampler=RESAMPLERS[resampler](), ess_threshold=1.0, store_history=True).init()
    for y in ys:
        smc.step(y)
        z = smc.state["z"]
        assert z.dtype == ys.dtype and bool(((z == 0) | (z == 1)).all())
    assert smc.resampled.all()
    # x_t depends on z_t of its own step, so FFBS has no backward kernel here: smoothing this
    # model through a transport used to run and return wrong paths; it now says why it cannot.
    with pytest.raises(ValueError, match="site 'x_1' depends on another latent site of the same step"):
        smc.smooth(5)
    # OT's barycentric map and the kernel's jitter bias the evidence by O(epsilon) / O(h^2) on
    # the continuous part; 0.1 nats bounds it here (measured 0.01-0.03 on seeds 0-4).
    err = (smc.log_evidence.mean() - log_z).abs()
    assert float(err) < MC_SIGMAS * float(smc.log_evidence.std()) / math.sqrt(B) + 0.1
