"""The fitted Gaussian proposals and the Metropolis-Hastings move of SMC2's rejuvenation."""

import math

import pyro
import pytest
import torch
from torch.distributions import MultivariateNormal

from pyro_smc.infer.smc2.rejuvenation import fit_proposal, metropolis_hastings, propose, weighted_moments


def test_weighted_moments_match_the_dense_formula():
    pyro.set_rng_seed(0)
    z, log_w = torch.randn(50, 3), torch.randn(50)
    w = torch.softmax(log_w, 0)
    mean, cov = weighted_moments(z, log_w + 7.0)  # unnormalised weights are fine
    assert torch.allclose(mean, (w[:, None] * z).sum(0))
    dense = sum(w[i] * torch.outer(z[i] - mean, z[i] - mean) for i in range(50))
    assert torch.allclose(cov, dense)


@pytest.mark.parametrize("kind, scale", [("random_walk", 2.38 / math.sqrt(2)), ("independent", 1.0)])
def test_fit_proposal_scales_the_covariance(kind, scale):
    pyro.set_rng_seed(1)
    z, log_w = torch.randn(200, 2) @ torch.tensor([[1.0, 0.0], [0.5, 2.0]]), torch.randn(200)
    proposal = fit_proposal(z, log_w, kind)
    _, cov = weighted_moments(z, log_w)
    assert torch.allclose(proposal.scale_tril @ proposal.scale_tril.T, scale**2 * cov, rtol=1e-5)
    assert torch.allclose(fit_proposal(z, log_w, kind, scale=0.3).scale_tril, 0.3 / scale * proposal.scale_tril)


def test_fit_proposal_moves_equal_particles():
    z = torch.ones(10, 2)
    proposal = fit_proposal(z, torch.zeros(10), "random_walk")
    assert torch.isfinite(proposal.scale_tril).all() and (proposal.scale_tril.diagonal() > 0).all()


def test_independent_proposal_log_ratio_is_exact():
    pyro.set_rng_seed(2)
    z = torch.randn(100, 2)
    proposal = fit_proposal(z, torch.zeros(100), "independent")
    z_new, log_q_ratio = propose(proposal, z)
    q = MultivariateNormal(proposal.mean, scale_tril=proposal.scale_tril)
    assert torch.allclose(log_q_ratio, q.log_prob(z) - q.log_prob(z_new))
    _, zero = propose(fit_proposal(z, torch.zeros(100), "random_walk"), z)
    assert (zero == 0).all()


@pytest.mark.parametrize("kind", ["random_walk", "independent"])
def test_moves_leave_the_target_invariant(kind):
    # Started at exact draws of N(1, 2^2), the chain stays distributed so: after 10 moves the mean
    # and variance of M = 4000 chains are within 5 standard errors of the target's.
    pyro.set_rng_seed(3)
    m, s, M = 1.0, 2.0, 4000
    target = torch.distributions.Normal(m, s)

    def target_of(z):
        return target.log_prob(z[:, 0]), None

    z = target.sample((M, 1))
    log_target = target.log_prob(z[:, 0])
    proposal = fit_proposal(z + 0.5, torch.zeros(M), kind)  # deliberately a little off
    rates = []
    for _ in range(10):
        z, log_target, rate = metropolis_hastings(z, log_target, proposal, target_of, lambda h, a: None)
        rates.append(rate)
    assert 0.05 < min(rates) and max(rates) < 1.0
    assert torch.allclose(log_target, target.log_prob(z[:, 0]))
    assert abs(float(z.mean()) - m) < 5 * s / math.sqrt(M)
    # var of the sample variance of a Normal: 2 s^4 / (M - 1)
    assert abs(float(z.var()) - s**2) < 5 * math.sqrt(2 * s**4 / (M - 1))


def test_nan_and_minus_inf_targets_are_rejected():
    z = torch.zeros(4, 1)
    log_target = torch.zeros(4)
    proposal = fit_proposal(torch.randn(4, 1), torch.zeros(4), "random_walk")
    accepted = {}

    def target_of(z_new):
        return torch.tensor([math.nan, -math.inf, math.nan, -math.inf]), "handle"

    def accept_into(handle, accept):
        accepted[handle] = accept

    z_out, log_out, rate = metropolis_hastings(z, log_target, proposal, target_of, accept_into)
    assert rate == 0.0 and not accepted["handle"].any()
    assert torch.equal(z_out, z) and torch.equal(log_out, log_target)
