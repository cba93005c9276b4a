"""Projection strategy objects: exact on linear maps, right moments on nonlinear ones, extensible."""

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.infer import Linearization, MomentMatching, Projection, Unscented, gaussian_smoother
from pyro_smc.infer.gaussian.projections import as_projection, project
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM, time_dependent
from pyro_smc.models.nonlinear_gaussian import _ignore_time, is_time_invariant

STRATEGIES = [Linearization(), Unscented(), Unscented(alpha=0.5, beta=2.0, kappa=1.0), MomentMatching()]


def _gaussian(d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(d, d, generator=g)
    return torch.randn(d, generator=g), L @ L.T + 0.5 * torch.eye(d), g


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_every_strategy_is_exact_on_a_linear_map(strategy):
    m, P, g = _gaussian()
    A, b, noise = torch.randn(2, 3, generator=g), torch.randn(2, generator=g), 0.3 * torch.eye(2)
    mu, S, C = strategy.moments(lambda x, t: x @ A.T + b * t, m, P, 2, noise)
    torch.testing.assert_close(mu, A @ m + 2 * b, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, A @ P @ A.T + noise, rtol=0, atol=1e-12)
    torch.testing.assert_close(C, P @ A.T, rtol=0, atol=1e-12)


def test_unscented_moments_agree_with_monte_carlo():
    m, P, g = _gaussian(2, seed=1)
    P = 0.1 * P  # mildly nonlinear over the input's spread, where the transform is accurate

    def f(x, t):
        return torch.stack([torch.sin(x[..., 0]) + x[..., 1], x[..., 0] * x[..., 1]], -1)

    mu, S, C = Unscented(alpha=1.0, beta=2.0, kappa=1.0).moments(f, m, P, 0)
    x = m + torch.randn(400_000, 2, generator=g) @ torch.linalg.cholesky(P).T
    fx = f(x, 0)
    mc_mu, mc_S = fx.mean(0), torch.cov(fx.T)
    mc_C = (x - x.mean(0)).T @ (fx - mc_mu) / (x.shape[0] - 1)
    torch.testing.assert_close(mu, mc_mu, rtol=0, atol=0.02)
    torch.testing.assert_close(S, mc_S, rtol=0, atol=0.02)
    torch.testing.assert_close(C, mc_C, rtol=0, atol=0.02)


def test_per_factor_unscented_settings():
    ut = Unscented(kappa=3.0, observation={"kappa": 2.0})
    assert ut.for_factor("transition").settings == {"kappa": 3.0}
    assert ut.for_factor("observation").settings == {"kappa": 2.0}
    assert Unscented(kappa=1.0).for_factor("observation").settings == {"kappa": 1.0}
    fallback = MomentMatching(ut).for_factor("observation").fallback
    assert fallback.settings == {"kappa": 2.0}


def test_names_map_to_the_default_objects():
    assert isinstance(as_projection("linearization"), Linearization)
    assert isinstance(as_projection("unscented"), Unscented) and as_projection("unscented").settings == {}
    assert isinstance(as_projection("moment_matching"), MomentMatching)
    mine = Unscented(kappa=2.0)
    assert as_projection(mine) is mine
    with pytest.raises(ValueError, match="projection"):
        as_projection("magic")


def test_project_wrapper_keeps_its_old_signature():
    m, P, _ = _gaussian(1)
    assert project(lambda x: 2 * x, m, P, 0, "linearization", noise_cov=P)[1].item() == pytest.approx(5 * P.item())
    mu, _, _ = project(lambda x, t: x + t, m, P, 4, Unscented(), None, True)
    torch.testing.assert_close(mu, m + 4)
    with pytest.raises(ValueError, match="projection"):
        project(lambda x: x, m, P, 0, "magic")


class Shifted(Projection):
    """A user's projection: the unscented moments of the map shifted by a constant."""

    def __init__(self, shift):
        self.shift, self.calls = shift, 0

    def map_moments(self, fn, mean, cov, t):
        self.calls += 1
        mu, S, C = Unscented().map_moments(fn, mean, cov, t)
        return mu + self.shift, S, C


def test_a_user_defined_projection_works_in_the_engines():
    one = torch.ones(1, 1)
    ssm = NonlinearGaussianSSM(lambda x: 0.5 * x + torch.sin(x), one, lambda x: x**2 / 20, one, torch.zeros(1), one)
    _, ys = ssm.simulate(15, generator=torch.Generator().manual_seed(0))
    plain = EPSmoother(ssm, projection=Unscented(), max_iter=3).smooth(ys)
    same = EPSmoother(ssm, projection=Shifted(0.0), max_iter=3).smooth(ys)
    torch.testing.assert_close(same.means, plain.means, rtol=0, atol=1e-12)
    shifted = Shifted(1.0)
    out = EPSmoother(ssm, projection=shifted, max_iter=3).smooth(ys)
    assert shifted.calls > 0 and not torch.allclose(out.means, plain.means)
    torch.testing.assert_close(gaussian_smoother(ssm, ys, Shifted(0.0)).means, gaussian_smoother(ssm, ys, "unscented").means, rtol=0, atol=0)


def test_a_user_defined_projection_is_exact_where_it_should_be():
    # Shifted(0) is the unscented projection: on a linear model EP with it is the Kalman smoother.
    eye = torch.eye(2)
    lin = LinearGaussianSSM(0.7 * eye, 0.5 * eye, torch.ones(1, 2), 0.2 * torch.eye(1), torch.zeros(2), eye)
    _, ys = lin.simulate(10, generator=torch.Generator().manual_seed(1))
    out = EPSmoother(lin, projection=Shifted(0.0), max_iter=2).smooth(ys)
    torch.testing.assert_close(out.means, lin.rts_smoother(ys).means, rtol=0, atol=1e-8)


def test_base_class_must_be_subclassed():
    m, P, _ = _gaussian(1)
    with pytest.raises(NotImplementedError):
        Projection().moments(lambda x, t: x, m, P, 0)


# --- batched projections (the parallel EP schedule projects every factor at once) -------------
def _gp():
    from pyro_smc.gp import MultiOutputGP

    g = torch.Generator().manual_seed(0)
    X = torch.randn(12, 2, generator=g, dtype=torch.float64)
    return MultiOutputGP(X, torch.stack([torch.sin(X[:, 0]), X[:, 1] * X[:, 0]], -1), lengthscale=1.0, variance=1.5, noise=0.05)


@pytest.mark.parametrize(
    "projection, fn",
    [
        (Unscented(), lambda x, t: torch.sin(x) + 0.1 * t),              # time-dependent: one call per member
        (Unscented(kappa=1.0), _ignore_time(lambda x: torch.cos(x) * x)),  # time-invariant: one call for all
        (Linearization(), lambda x, t: x**2 - t),                         # the base class's loop
        (MomentMatching(), _gp()),                                        # batched exact GP moments
        (Unscented(), _gp()),
        (Linearization(), _gp()),
    ],
)
def test_moments_batch_equals_one_member_at_a_time(projection, fn):
    g = torch.Generator().manual_seed(1)
    means = torch.randn(5, 2, generator=g, dtype=torch.float64)
    L = 0.3 * torch.randn(5, 2, 2, generator=g, dtype=torch.float64) + torch.eye(2, dtype=torch.float64)
    covs = L @ L.transpose(-1, -2)
    noise = 0.1 * torch.eye(2, dtype=torch.float64)
    ts = [0, 3, 1, 7, 2]
    batched = projection.moments_batch(fn, means, covs, ts, noise)
    for b, t in enumerate(ts):
        single = projection.moments(fn, means[b], covs[b], t, noise)
        for x, y in zip(batched, single):
            assert torch.allclose(x[b], y, atol=1e-12), (x[b], y)


def test_time_invariant_maps_are_marked():
    one = torch.eye(1)
    lin = LinearGaussianSSM(one, one, one, one, torch.zeros(1), one)
    assert is_time_invariant(lin.transition_fn) and is_time_invariant(lin.observation_fn)
    ssm = NonlinearGaussianSSM(lambda x: x, one, time_dependent(lambda x, t: x * t), one, torch.zeros(1), one)
    assert is_time_invariant(ssm.transition_fn) and not is_time_invariant(ssm.observation_fn)
