"""AdaptiveRandomWalk: the proposal's law, its adaptation during warm-up, and the frozen chain."""

import math

import pytest
import torch

from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk


def test_proposal_increments_have_covariance_scale_squared_sigma():
    sigma = torch.tensor([[2.0, 0.6], [0.6, 0.5]])
    walk = AdaptiveRandomWalk(2, scale=0.3, covariance=sigma, adapt=False)
    n = 20000
    z = torch.full((n, 2), 1.5)
    steps = walk.propose(z) - z
    expected = 0.09 * sigma
    assert steps.mean(0).abs().max() < 5 * math.sqrt(expected.diagonal().max() / n)
    empirical = steps.T @ steps / n
    # sd of a sample second moment of Gaussians: sqrt((S_ii S_jj + S_ij^2) / n)
    sd = ((expected.diagonal()[:, None] * expected.diagonal()[None, :] + expected**2) / n).sqrt()
    assert ((empirical - expected).abs() < 5 * sd).all()


def test_default_scale_and_identity_covariance():
    walk = AdaptiveRandomWalk(4)
    assert walk.scale == pytest.approx(2.38 / 2)
    assert torch.equal(walk.covariance, torch.eye(4))
    assert walk.adapting


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_propose_keeps_dtype_and_batch_shape(dtype):
    walk = AdaptiveRandomWalk(3, covariance=torch.ones(3))
    out = walk.propose(torch.zeros(5, 3, dtype=dtype))
    assert out.dtype == dtype and out.shape == (5, 3)


def test_scale_shrinks_on_rejections_and_grows_on_acceptances():
    shrink, grow = AdaptiveRandomWalk(1, adapt_covariance=False), AdaptiveRandomWalk(1, adapt_covariance=False)
    for _ in range(50):
        shrink.update(torch.zeros(1), 0.0)
        grow.update(torch.zeros(1), 1.0)
    assert shrink.scale < 2.38 < grow.scale


def _run_gaussian_chain(walk, cov, num_warmup, num_samples):
    """Random-walk Metropolis on N(0, cov) with the walk; returns the post-warm-up states and the
    mean acceptance probability after warm-up."""
    precision = torch.linalg.inv(cov)

    def log_density(z):
        return -0.5 * z @ precision @ z

    z = torch.zeros(cov.shape[0])
    states, accepts = [], []
    for i in range(num_warmup + num_samples):
        if i == num_warmup:
            walk.end_warmup()
        proposal = walk.propose(z)
        accept_prob = float((log_density(proposal) - log_density(z)).exp().clamp(max=1.0))
        if torch.rand(()) < accept_prob:
            z = proposal
        walk.update(z, accept_prob)
        if i >= num_warmup:
            states.append(z)
            accepts.append(accept_prob)
    return torch.stack(states), sum(accepts) / len(accepts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptation_learns_a_badly_scaled_target_and_then_freezes(seed):
    torch.manual_seed(seed)
    # variances 4 and 0.0004 with correlation 0.9: the identity start is 100x too wide in one axis
    sd = torch.tensor([2.0, 0.02])
    cov = sd[:, None] * sd[None, :] * torch.tensor([[1.0, 0.9], [0.9, 1.0]])
    walk = AdaptiveRandomWalk(2, target_accept=0.3)
    states, accept = _run_gaussian_chain(walk, cov, num_warmup=1500, num_samples=3000)
    learnt = walk.covariance
    # the learnt shape: the correlation and the ratio of sds, to within a window's sampling error
    corr = learnt[0, 1] / (learnt[0, 0] * learnt[1, 1]).sqrt()
    assert 0.75 < float(corr) < 0.97
    assert 50 < float((learnt[0, 0] / learnt[1, 1]).sqrt()) < 200
    # the scale was tuned to the target acceptance (dual averaging on a noisy signal)
    assert abs(accept - 0.3) < 0.1
    frozen = (walk.scale, walk.covariance.clone())
    walk.update(torch.ones(2), 0.0)
    assert (walk.scale, walk.covariance.tolist()) == (frozen[0], frozen[1].tolist())
    # the frozen chain targets N(0, cov): means within 5 MC standard errors (batch means)
    batches = states.reshape(30, 100, 2).mean(1)
    se = batches.std(0) / math.sqrt(30)
    assert (states.mean(0).abs() < 5 * se).all()


def test_no_adaptation_when_adapt_is_false():
    walk = AdaptiveRandomWalk(2, scale=0.5, adapt=False)
    for _ in range(200):
        walk.update(torch.randn(2), 0.0)
    assert walk.scale == 0.5 and torch.equal(walk.covariance, torch.eye(2))


def test_nan_acceptance_counts_as_rejection():
    walk = AdaptiveRandomWalk(1, adapt_covariance=False)
    walk.update(torch.zeros(1), float("nan"))
    assert math.isfinite(walk.scale) and walk.scale < 2.38


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"dim": 0}, "dim"),
        ({"dim": 2, "scale": -1.0}, "scale"),
        ({"dim": 2, "target_accept": 1.0}, "target_accept"),
        ({"dim": 2, "window": 1}, "window"),
        ({"dim": 2, "covariance": torch.ones(3)}, "covariance"),
        ({"dim": 2, "covariance": -torch.eye(2)}, "covariance"),
        ({"dim": 2, "adapt": 1}, "adapt"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveRandomWalk(**kwargs)


def test_propose_checks_the_dimension():
    with pytest.raises(ValueError, match="dim"):
        AdaptiveRandomWalk(2).propose(torch.zeros(3))
