"""The Hilbert curve: a bijection of the grid whose consecutive cells share a face, and the order
of real points it induces."""

import pytest
import torch

from pyro_smc.ops.hilbert import MAX_INDEX_BITS, hilbert_index, hilbert_order


@pytest.mark.parametrize("d, bits", [(2, 1), (2, 4), (3, 3), (4, 2), (5, 2)])
def test_index_is_a_bijection_whose_steps_are_unit_moves(d, bits):
    grid = torch.cartesian_prod(*[torch.arange(2**bits)] * d)
    index = hilbert_index(grid, bits)
    assert torch.equal(torch.sort(index).values, torch.arange(2 ** (d * bits)))
    walk = grid[torch.argsort(index)]
    steps = (walk[1:] - walk[:-1]).abs().sum(-1)
    assert bool((steps == 1).all())  # each step moves one cell along one axis
    assert walk[0].abs().sum() == 0  # the curve starts at the origin


def test_index_batches_and_rejects_bad_orders():
    cells = torch.randint(0, 8, (5, 7, 3))
    flat = hilbert_index(cells.reshape(-1, 3), 3).reshape(5, 7)
    assert torch.equal(hilbert_index(cells, 3), flat)
    with pytest.raises(ValueError, match="bits"):
        hilbert_index(cells, 0)
    with pytest.raises(ValueError, match="bits"):
        hilbert_index(torch.zeros(1, 3, dtype=torch.long), MAX_INDEX_BITS // 3 + 1)


def test_order_in_one_dimension_is_the_sort():
    x = torch.randn(4, 50)
    assert torch.equal(hilbert_order(x.unsqueeze(-1)), torch.argsort(x, dim=-1))
    assert torch.equal(hilbert_order(x[0]), torch.argsort(x[0]))


def test_order_ignores_location_and_scale_and_constant_coordinates():
    x = torch.randn(3, 64, 2)
    order = hilbert_order(x)
    assert torch.equal(hilbert_order(3.0 * x + 7.0), order)
    assert sorted(order[0].tolist()) == list(range(64))
    with_constant = torch.cat([x, torch.ones(3, 64, 1)], -1)
    assert sorted(hilbert_order(with_constant)[1].tolist()) == list(range(64))


def test_order_keeps_neighbours_close():
    # Points on a fine grid of the square: consecutive points in the order are grid neighbours
    # far more often than in a random order (a random order's mean step is about half the side).
    g = torch.linspace(-1.0, 1.0, 16)
    points = torch.cartesian_prod(g, g) + 1e-4 * torch.randn(256, 2)
    walk = points[hilbert_order(points)]
    mean_step = (walk[1:] - walk[:-1]).norm(dim=-1).mean()
    assert float(mean_step) < 3 * float(g[1] - g[0])
