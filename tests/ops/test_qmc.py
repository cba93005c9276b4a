"""Scrambled Sobol points and SQMC's resampling: uniform, stratified, unbiased."""

import math

import pytest
import torch

from pyro_smc.ops.qmc import qmc_resample, sobol_points
from tests.tolerances import MC_SIGMAS


@pytest.mark.parametrize("num_points, dim, batch", [(16, 3, 400), (256, 3, 3), (100, 1, 5)])
def test_points_are_uniform_and_stratified(num_points, dim, batch):
    u = sobol_points(num_points, dim, batch, torch.zeros((), dtype=torch.float64))
    assert u.shape == (batch, num_points, dim) and u.dtype == torch.float64
    assert bool(((u > 0) & (u < 1)).all())
    if num_points & (num_points - 1) == 0:
        # A net of 2^m points: one point in each interval [k / N, (k + 1) / N) of every coordinate.
        cells = torch.sort((u * num_points).floor().long(), dim=1).values
        assert torch.equal(cells, torch.arange(num_points).reshape(1, -1, 1).expand_as(cells))


def test_each_point_is_uniform_and_sets_are_independent():
    u = sobol_points(4, 2, 20000, torch.zeros((), dtype=torch.float64))  # (B, 4, 2)
    n = u.shape[0]
    # A point's coordinate: mean 1/2, variance 1/12; across sets, the first points uncorrelated.
    se = math.sqrt(1 / 12 / n)
    assert bool(((u.mean(0) - 0.5).abs() < MC_SIGMAS * se).all())
    corr = ((u[:-1, 0, 0] - 0.5) * (u[1:, 0, 0] - 0.5)).mean() * 12
    assert abs(float(corr)) < MC_SIGMAS / math.sqrt(n)


def test_points_take_the_dtype_and_device_of_like():
    u = sobol_points(8, 2, 1, torch.zeros((), dtype=torch.float32))
    assert u.dtype == torch.float32 and bool((u < 1).all())


def test_resampling_counts_are_stratified():
    torch.manual_seed(0)
    n = 64
    log_w = torch.randn(n).mul(1.5).log_softmax(-1)
    x = torch.randn(n, 2)
    from pyro_smc.ops.hilbert import hilbert_order

    for _ in range(20):
        points = sobol_points(n, 2, 1, log_w)[0]
        ancestors, moves = qmc_resample(log_w, hilbert_order(x), points)
        counts = torch.bincount(ancestors, minlength=n)
        # One point per stratum of width 1/N: |count - N w| < 2 for every particle.
        assert bool(((counts - n * log_w.exp()).abs() < 2).all())
        assert moves.shape == (n, 1)


def test_resampling_is_unbiased_and_pairs_points_with_their_ancestors():
    torch.manual_seed(1)
    n, reps = 8, 4000
    log_w = torch.tensor([0.3, 0.05, 0.05, 0.1, 0.2, 0.1, 0.1, 0.1]).log()
    order = torch.randperm(n)
    points = sobol_points(n, 2, reps, log_w)  # (R, N, 2)
    ancestors, moves = qmc_resample(log_w.expand(reps, n), order.expand(reps, n), points)
    counts = torch.nn.functional.one_hot(ancestors, n).sum(1).double()  # (R, N)
    se = counts.std(0) / math.sqrt(reps)
    assert bool(((counts.mean(0) - n * log_w.exp()).abs() < MC_SIGMAS * se + 1e-9).all())
    # Ancestors come in curve order, and each move keeps its point's second coordinate.
    rank = torch.argsort(order)
    assert bool((rank[ancestors][:, 1:] >= rank[ancestors][:, :-1]).all())
    first = torch.sort(points[..., 0], -1).indices
    assert torch.equal(moves[..., 0], points[..., 1].gather(-1, first))
