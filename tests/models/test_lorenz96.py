"""Tests of the Lorenz-96 state-space model: the vector field against its per-site formula and
its energy identity, the integrator's order against a fine reference solution, the model's
moments and simulator, and the Gaussian engines on it."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_smc import EPSmoother
from pyro_smc.infer import Unscented, extended_rts_smoother, unscented_rts_smoother
from pyro_smc.models.lorenz96 import Lorenz96SSM, lorenz96_drift, lorenz96_rk4, lorenz96_spin_up
from pyro_smc.models.protocol import GaussianStateSpaceModel, StateSpaceModel


def _drift_by_sites(x: torch.Tensor, forcing: float) -> torch.Tensor:
    # The textbook formula, one site at a time, indices modulo d.
    d = x.shape[-1]
    return torch.stack([(x[..., (i + 1) % d] - x[..., (i - 2) % d]) * x[..., (i - 1) % d] - x[..., i] + forcing for i in range(d)], -1)


@pytest.mark.parametrize("d", [4, 5, 9])
def test_drift_is_the_per_site_formula(d):
    x = 4 * torch.randn(3, 2, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(lorenz96_drift(x, 8.0), _drift_by_sites(x, 8.0), rtol=1e-14, atol=1e-12)
    torch.testing.assert_close(lorenz96_drift(x, 2.5), _drift_by_sites(x, 2.5), rtol=1e-14, atol=1e-12)


def test_advection_conserves_energy():
    # d/dt |x|^2 / 2 = x . drift(x) = -|x|^2 + F sum(x): the quadratic term drops out exactly.
    x = 5 * torch.randn(100, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    power = (x * lorenz96_drift(x, 8.0)).sum(-1)
    torch.testing.assert_close(power, -(x * x).sum(-1) + 8.0 * x.sum(-1), rtol=1e-12, atol=1e-9)


def _reference(x: torch.Tensor, dt: float, substeps: int = 4000) -> torch.Tensor:
    # The flow over dt to ~1e-17: the global error of RK4 with step dt / 4000 is O((dt / 4000)^4).
    for _ in range(substeps):
        x = lorenz96_rk4(x, dt / substeps)
    return x


def test_rk4_step_has_fifth_order_local_error():
    x0 = lorenz96_spin_up(10, dtype=torch.float64)
    errors = [float((lorenz96_rk4(x0, dt) - _reference(x0, dt)).abs().max()) for dt in (0.025, 0.0125)]
    order = math.log2(errors[0] / errors[1])
    assert 4.7 < order < 5.3, errors  # a first- or second-order scheme gives 2 or 3
    # At the model's step the integrator error is far below the transition noise (sd 0.32).
    assert float((lorenz96_rk4(x0, 0.05) - _reference(x0, 0.05)).abs().max()) < 0.01


def test_equilibrium_and_spin_up():
    eq = torch.full((7,), 3.0, dtype=torch.float64)
    torch.testing.assert_close(lorenz96_rk4(eq, 0.05, forcing=3.0), eq, rtol=0, atol=1e-14)
    x0 = lorenz96_spin_up(40, dtype=torch.float64)
    assert x0.dtype == torch.float64 and x0.shape == (40,)
    assert float((x0 - 8.0).abs().max()) > 1.0  # the nudge has grown: the point left the equilibrium
    torch.testing.assert_close(Lorenz96SSM(40, dtype=torch.float64).init_mean, x0, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("observation", ["square", "identity"])
def test_model_moments(dtype, observation):
    ssm = Lorenz96SSM(6, observation=observation, transition_var=0.2, observation_var=0.5, init_var=2.0, dtype=dtype)
    assert isinstance(ssm, StateSpaceModel) and isinstance(ssm, GaussianStateSpaceModel)
    assert ssm.state_dim == ssm.obs_dim == 6 and ssm.init_mean.dtype == dtype
    eye = torch.eye(6, dtype=dtype)
    for cov, scale in ((ssm.transition_cov, 0.2), (ssm.observation_cov, 0.5), (ssm.init_cov, 2.0)):
        torch.testing.assert_close(cov, scale * eye)
    x = torch.randn(4, 3, 6, dtype=dtype)
    torch.testing.assert_close(ssm.transition_fn(x, 5), lorenz96_rk4(x))
    torch.testing.assert_close(ssm.observation_fn(x, 5), x**2 if observation == "square" else x)


@pytest.mark.parametrize("seed", [0, 1])
def test_simulate_draws_the_model_noise(seed):
    # The residuals of a simulated path are N(0, q) and N(0, r) draws: their means and
    # variances within 5 standard errors (n = T d draws each).
    q, r, T, d = 0.1, 1.0, 200, 40
    ssm = Lorenz96SSM(d, transition_var=q, observation_var=r, dtype=torch.float64)
    xs, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(seed))
    assert xs.shape == ys.shape == (T, d)
    for residual, var in ((xs[1:] - lorenz96_rk4(xs[:-1]), q), (ys - xs**2, r)):
        n = residual.numel()
        assert abs(float(residual.mean())) < 5 * math.sqrt(var / n)
        assert abs(float(residual.var()) - var) < 5 * var * math.sqrt(2 / n)


def test_gaussian_engines_run_on_it():
    ssm = Lorenz96SSM(8, observation="identity", dtype=torch.float64)
    xs, ys = ssm.simulate(25, generator=torch.Generator().manual_seed(3))
    ut = Unscented(alpha=1.0, beta=2.0, kappa=3.0, observation=dict(kappa=2.0))
    urts = unscented_rts_smoother(ssm, ys, ut)
    out = EPSmoother(ssm, projection=ut, max_iter=4, tol=1e-9, gradient="unroll").smooth(ys)
    torch.testing.assert_close(out.first_sweep.means, urts.means, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(out.first_sweep.covariances, urts.covariances, rtol=1e-8, atol=1e-8)
    # With r = 1 and q = 0.1 smoothing beats the raw observations (per-site RMSE 1) clearly.
    for result in (urts, out, extended_rts_smoother(ssm, ys)):
        assert float((result.means - xs).pow(2).mean().sqrt()) < 0.8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(state_dim=3), "state_dim"),
        (dict(observation="cube"), "observation"),
        (dict(dt=0.0), "dt"),
        (dict(transition_var=-1.0), "transition_var"),
        (dict(observation_var=float("nan")), "observation_var"),
        (dict(init_mean=torch.zeros(5)), "init_mean"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lorenz96SSM(**{"state_dim": 6, **kwargs})


def test_forcing_and_step_are_read_only():
    """Before: ``ssm.forcing = 12`` was accepted and changed nothing (the transition is built from
    the forcing and the step): a silent no-op. Now it is an error naming the remedy."""
    ssm = Lorenz96SSM(8, dtype=torch.float64)
    for name in ("forcing", "dt"):
        with pytest.raises(AttributeError, match=f"{name} is fixed when the model is built"):
            setattr(ssm, name, 12.0)
    assert ssm.forcing == 8.0 and ssm.dt == 0.05
