"""MLPRegressor: accuracy on a smooth 2-D function, warm starts and determinism."""

import torch

from pyro_smc.regression import MLPRegressor
from tests.regression.cases import F64, _gen


def _smooth_2d(x):
    return x[:, 0].sin() * x[:, 1].cos() + 0.3 * x[:, 0]


def test_mlp_fits_smooth_2d_function():
    g = _gen()
    x = 2 * torch.rand(256, 2, generator=g, dtype=torch.float32) - 1
    x_test = 1.8 * torch.rand(200, 2, generator=g, dtype=torch.float32) - 0.9
    reg = MLPRegressor(hidden_dims=(32, 32), num_steps=300, generator=_gen(1)).fit(x, _smooth_2d(x))
    pred = reg(x_test)
    assert pred.shape == (200,) and pred.dtype == torch.float32
    assert float((pred - _smooth_2d(x_test)).pow(2).mean().sqrt() / _smooth_2d(x_test).std()) < 0.1


def test_mlp_warm_start_and_determinism():
    g = _gen()
    x = 2 * torch.rand(128, 2, generator=g, dtype=F64) - 1
    y = _smooth_2d(x)
    reg = MLPRegressor(hidden_dims=(16, 16), num_steps=100, generator=_gen(1)).fit(x, y)
    first = reg.losses.clone()
    reg.fit(x, y)
    fresh = MLPRegressor(hidden_dims=(16, 16), num_steps=100, generator=_gen(2)).fit(x, y)
    assert reg.losses.shape == (100,)
    assert reg.losses[0] < 0.5 * fresh.losses[0]
    assert reg.losses[0] < 2 * first[-1]
    # Same generator seed, same weights; minibatches come from the generator too.
    a = MLPRegressor(hidden_dims=(8,), num_steps=20, batch_size=32, generator=_gen(3)).fit(x, y)
    b = MLPRegressor(hidden_dims=(8,), num_steps=20, batch_size=32, generator=_gen(3)).fit(x, y)
    assert torch.equal(a(x), b(x))
