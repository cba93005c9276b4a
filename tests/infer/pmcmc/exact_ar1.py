"""The AR(1)-plus-noise model with static parameters, and its exact parameter posterior on a grid.

``x_1 ~ N(0, sigma^2 / (1 - rho^2))`` (the stationary law), ``x_t = rho x_{t-1} + sigma e_t``,
``y_t = x_t + tau u_t``. ``rho`` (prior ``Uniform(-1, 1)``) and ``sigma`` (prior
``LogNormal(0, 1)``) are ``PyroSample`` attributes, or plain numbers when fixed. The exact
log-likelihood is the scalar Kalman filter, vectorised over a grid of parameters.
"""

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample


class AR1(PyroModule):
    def __init__(self, rho=None, sigma=1.0, tau=0.5):
        super().__init__()
        self.rho = PyroSample(dist.Uniform(-1.0, 1.0)) if rho is None else rho
        self.sigma = PyroSample(dist.LogNormal(0.0, 1.0)) if sigma is None else sigma
        self.tau = tau

    def init(self, state):
        rho, sigma = torch.as_tensor(self.rho), torch.as_tensor(self.sigma)
        state["x"] = pyro.sample("x0", dist.Normal(torch.zeros_like(rho), sigma / (1 - rho**2).sqrt()))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], self.sigma))
        return pyro.sample("y", dist.Normal(state["x"], self.tau), obs=y)


def simulate(num_steps, seed, rho=0.7, sigma=1.0, tau=0.5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((), generator=gen, dtype=dtype) * sigma / math.sqrt(1 - rho**2)
    ys = []
    for _ in range(num_steps):
        x = rho * x + sigma * torch.randn((), generator=gen, dtype=dtype)
        ys.append(x + tau * torch.randn((), generator=gen, dtype=dtype))
    return torch.stack(ys)


def kalman_log_likelihood(ys, rho, sigma, tau=0.5):
    """Exact ``log p(y_{1:T} | rho, sigma)`` for tensors ``rho``, ``sigma`` of one shape."""
    rho, sigma = torch.broadcast_tensors(torch.as_tensor(rho, dtype=torch.float64), torch.as_tensor(sigma, dtype=torch.float64))
    mean = torch.zeros_like(rho)
    var = sigma**2 / (1 - rho**2)
    total = torch.zeros_like(rho)
    for y in ys.double():
        s = var + tau**2
        total = total - 0.5 * (math.log(2 * math.pi) + s.log() + (y - mean) ** 2 / s)
        gain = var / s
        mean, var = mean + gain * (y - mean), (1 - gain) * var
        mean, var = rho * mean, rho**2 * var + sigma**2
    return total


def grid_moments(log_density, values):
    """Mean, sd and fourth central moment of each coordinate under a density on a regular grid.

    ``log_density``: ``(*grid)`` unnormalised; ``values``: ``{name: (*grid)}`` the coordinates."""
    w = (log_density - log_density.max()).exp()
    w = w / w.sum()
    out = {}
    for name, v in values.items():
        mean = (w * v).sum()
        var = (w * (v - mean) ** 2).sum()
        out[name] = (float(mean), float(var.sqrt()), float((w * (v - mean) ** 4).sum()))
    return out


def rho_posterior(ys, sigma=1.0, tau=0.5, size=4000):
    """Exact posterior moments of ``rho`` (prior Uniform(-1, 1)), sigma and tau known."""
    rho = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1  # midpoints of (-1, 1)
    return grid_moments(kalman_log_likelihood(ys, rho, torch.tensor(sigma), tau), {"rho": rho})["rho"]


def rho_sigma_posterior(ys, tau=0.5, size=600):
    """Exact posterior moments of ``rho`` (Uniform(-1, 1)) and ``sigma`` (LogNormal(0, 1)).

    A grid over ``(rho, log sigma)``: the LogNormal prior is Normal(0, 1) in ``log sigma``."""
    rho = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1
    log_sigma = torch.linspace(-2.5, 1.5, size, dtype=torch.float64)
    r, ls = torch.meshgrid(rho, log_sigma, indexing="ij")
    log_density = kalman_log_likelihood(ys, r, ls.exp(), tau) - 0.5 * ls**2
    return grid_moments(log_density, {"rho": r, "sigma": ls.exp()})
