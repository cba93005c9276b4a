"""Tests of the iterated extended RTS smoother: the Kalman smoother on a linear model, the
extended smoother as its first pass, and Gauss-Newton's fixed point (a stationary point of the
joint density) on nonlinear models."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_smc.infer import Linearization, extended_rts_smoother
from pyro_smc.infer.gaussian.iterated import NominalLinearization, iterated_extended_rts_smoother
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM
from pyro_smc.models.lorenz96 import Lorenz96SSM


def _linear(seed: int = 0) -> LinearGaussianSSM:
    g = torch.Generator().manual_seed(seed)
    A = 0.5 * torch.randn(3, 3, dtype=torch.float64, generator=g)
    H = torch.randn(2, 3, dtype=torch.float64, generator=g)
    eye3, eye2 = torch.eye(3, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    return LinearGaussianSSM(A, 0.3 * eye3, H, 0.5 * eye2, torch.ones(3, dtype=torch.float64), eye3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_pass_is_the_kalman_smoother_on_a_linear_model(seed):
    ssm = _linear(seed)
    _, ys = ssm.simulate(15, generator=torch.Generator().manual_seed(seed))
    ys[4] = float("nan")  # a missing step is predicted only, as in every Gaussian smoother
    exact = ssm.rts_smoother(ys)
    for num_iter in (1, 3):
        out = iterated_extended_rts_smoother(ssm, ys, num_iter=num_iter)
        torch.testing.assert_close(out.means, exact.means, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out.covariances, exact.covariances, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out.log_evidence, ssm.log_evidence(ys), rtol=1e-9, atol=1e-9)
        assert out.converged


def test_nominal_linearization_is_the_taylor_expansion_at_the_nominal_point():
    fn = lambda x, t: torch.stack([x[..., 0] * x[..., 1], torch.sin(x[..., 1]), x[..., 0] ** 3], -1)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    nominal = torch.randn(5, 2, dtype=torch.float64, generator=g)
    m = torch.randn(2, dtype=torch.float64, generator=g)
    L = torch.randn(2, 2, dtype=torch.float64, generator=g)
    P = L @ L.T + 0.1 * torch.eye(2, dtype=torch.float64)
    mu, S, C = NominalLinearization(nominal).map_moments(fn, m, P, 3)
    at = nominal[3]
    J = torch.autograd.functional.jacobian(lambda x: fn(x, 3), at)
    torch.testing.assert_close(mu, fn(at, 3) + J @ (m - at))
    torch.testing.assert_close(S, J @ P @ J.T)
    torch.testing.assert_close(C, P @ J.T)
    # At the mean it is the extended projection.
    here = NominalLinearization(m.expand(5, 2)).map_moments(fn, m, P, 1)
    for a, b in zip(here, Linearization().map_moments(fn, m, P, 1)):
        torch.testing.assert_close(a, b)


def _log_joint(ssm, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    # log p(x_{0:T-1}, y_{0:T-1}) of an additive-Gaussian model, written out.
    normal = torch.distributions.MultivariateNormal
    total = normal(ssm.init_mean, ssm.init_cov).log_prob(xs[0])
    total = total + normal(torch.zeros_like(ssm.init_mean), ssm.transition_cov).log_prob(xs[1:] - ssm.transition_fn(xs[:-1], 0)).sum()
    observed = ~torch.isnan(ys).any(-1)
    residual = ys[observed] - ssm.observation_fn(xs[observed], 0)
    return total + normal(torch.zeros(ssm.obs_dim, dtype=xs.dtype), ssm.observation_cov).log_prob(residual).sum()


def _gradient_norm(ssm, xs, ys) -> float:
    xs = xs.detach().requires_grad_()
    (grad,) = torch.autograd.grad(_log_joint(ssm, xs, ys), xs)
    return float(grad.norm())


def _nonlinear() -> NonlinearGaussianSSM:
    one = torch.ones(1, 1, dtype=torch.float64)
    return NonlinearGaussianSSM(
        lambda x: 0.9 * x + 0.3 * torch.sin(x), 0.1 * one, lambda x: x**2 / 5, 0.1 * one, torch.full((1,), 2.0, dtype=torch.float64), one
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("make", [_nonlinear, lambda: Lorenz96SSM(6, observation="identity", observation_var=0.5, dtype=torch.float64)])
def test_converged_means_are_a_stationary_point_of_the_joint_density(seed, make):
    # Gauss-Newton's fixed point: the gradient of log p(x, y) vanishes at the converged means,
    # while at the extended smoother's means (the first pass) it does not.
    ssm = make()
    _, ys = ssm.simulate(30, generator=torch.Generator().manual_seed(seed))
    ys[7] = float("nan")
    out = iterated_extended_rts_smoother(ssm, ys, num_iter=50, tol=1e-11)
    assert out.converged and out.history[0].change == math.inf
    at_eks = _gradient_norm(ssm, extended_rts_smoother(ssm, ys).means, ys)
    assert _gradient_norm(ssm, out.means, ys) < 1e-6 * max(at_eks, 1.0)
    assert at_eks > 1e-3


def test_bad_arguments_are_named():
    ssm = _linear()
    ys = torch.zeros(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_iter"):
        iterated_extended_rts_smoother(ssm, ys, num_iter=0)
    with pytest.raises(ValueError, match="tol"):
        iterated_extended_rts_smoother(ssm, ys, tol=0.0)
    with pytest.raises(ValueError, match="nominal"):
        NominalLinearization(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        NominalLinearization(torch.full((3, 2), float("nan")))
    with pytest.raises(ValueError, match="time step 5"):
        NominalLinearization(torch.zeros(5, 2)).map_moments(lambda x, t: x, torch.zeros(2), torch.eye(2), 5)


def test_float32_follows_the_model():
    ssm = Lorenz96SSM(5, observation="identity", dtype=torch.float32)
    xs, ys = ssm.simulate(12, generator=torch.Generator().manual_seed(0))
    out = iterated_extended_rts_smoother(ssm, ys, num_iter=5, tol=1e-4)
    assert out.means.dtype == torch.float32 and bool(torch.isfinite(out.covariances).all())
    # The same model in float64 (the spun-up initial mean is chaotic in the dtype: pass it).
    ssm64 = Lorenz96SSM(5, observation="identity", init_mean=ssm.init_mean.double())
    reference = iterated_extended_rts_smoother(ssm64, ys.double(), num_iter=5, tol=1e-8)
    torch.testing.assert_close(out.means.double(), reference.means, rtol=0, atol=1e-3)
