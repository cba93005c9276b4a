import math

import pytest
import torch

from pyro_smc.ops import resample
from pyro_smc.ops.weights import ess, log_mean_exp, normalize

SCHEMES = [resample.multinomial, resample.stratified, resample.systematic]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unbiased_offspring_counts(scheme):
    # E[#{i: A^i = j}] = N w_j; check with an explicit 5-sigma Monte Carlo error bar.
    torch.manual_seed(0)
    n, reps = 8, 20000
    w = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    lw = w.log().expand(reps, n)
    idx = scheme(lw)
    counts = torch.zeros(reps, n).scatter_add_(1, idx, torch.ones(reps, n))
    mean, sd = counts.mean(0), counts.std(0)
    assert ((mean - n * w).abs() <= 5 * sd / math.sqrt(reps) + 1e-12).all()


@pytest.mark.parametrize("scheme", [resample.stratified, resample.systematic])
def test_low_variance_schemes_keep_floor_counts(scheme):
    # Stratified and systematic give each particle floor(N w) or more... systematic exactly
    # floor or ceil.
    torch.manual_seed(1)
    n = 10
    lw = torch.randn(500, n).log_softmax(-1)
    idx = scheme(lw)
    counts = torch.zeros(500, n).scatter_add_(1, idx, torch.ones(500, n))
    expected = n * lw.exp()
    if scheme is resample.systematic:
        assert ((counts >= expected.floor()) & (counts <= expected.ceil())).all()
    assert (counts.sum(-1) == n).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_weight_particles_never_chosen(scheme):
    lw = torch.tensor([[0.0, -math.inf, -math.inf, 0.0]]).log_softmax(-1).expand(100, 4)
    idx = scheme(lw)
    assert set(idx.unique().tolist()) <= {0, 3}


def test_weights_helpers():
    lw = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    nlw, log_sum = normalize(lw)
    assert torch.allclose(nlw.exp().sum(-1), torch.ones(2))
    assert torch.allclose(log_sum, lw.logsumexp(-1))
    w = nlw.exp()
    assert torch.allclose(ess(nlw), 1 / (w * w).sum(-1))
    assert torch.allclose(ess(nlw[1]), torch.tensor(3.0))
    assert torch.allclose(log_mean_exp(lw), lw.exp().mean(-1).log())
