"""A 1-d AR(1)-plus-noise model with an unknown static parameter, its data, and the exact
sequential posterior of that parameter on a grid (Kalman likelihoods), for the SMC^2 tests.

x_0 ~ N(0, 1); x_t = rho x_{t-1} + N(0, 1); y_t = x_t + N(0, sigma^2), t = 1..T. Either rho
(prior Uniform(-1, 1)) or sigma (prior LogNormal(-0.5, 0.5)) is the unknown; the other is fixed.
A copy of tests/infer/smc2/exact_ar1.py: keep the two alike.
"""

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

RHO, SIGMA = 0.7, 0.5


class AR1(PyroModule):
    """The model, with ``unknown`` ("rho" or "sigma") a ``PyroSample`` attribute; parameters
    arrive as ``(B, 1)`` and broadcast against the particles ``(B, N)``."""

    def __init__(self, unknown="rho"):
        super().__init__()
        self.unknown = unknown
        if unknown == "rho":
            self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
            self.sigma = torch.tensor(SIGMA)
        else:
            self.rho = torch.tensor(RHO)
            self.sigma = PyroSample(dist.LogNormal(-0.5, 0.5))

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], self.sigma), obs=y)


def simulate(num_steps, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x, ys = torch.randn((), generator=gen, dtype=dtype), []
    for _ in range(num_steps):
        x = RHO * x + torch.randn((), generator=gen, dtype=dtype)
        ys.append(x + SIGMA * torch.randn((), generator=gen, dtype=dtype))
    return torch.stack(ys)


def grid_log_likelihoods(ys, rho, sigma):
    """``(T, G)``: the exact ``log p(y_{1:t} | theta)`` for every t, at each grid point (Kalman)."""
    m, p = torch.zeros_like(rho * sigma), torch.ones_like(rho * sigma)
    total, out = torch.zeros_like(m), []
    for y in ys:
        m, p = rho * m, rho**2 * p + 1.0
        s = p + sigma**2
        total = total - 0.5 * (math.log(2 * math.pi) + s.log() + (y - m) ** 2 / s)
        gain = p / s
        m, p = m + gain * (y - m), (1 - gain) * p
        out.append(total)
    return torch.stack(out)


def exact_posterior(ys, unknown="rho", size=4001):
    """Per step t: the posterior mean and sd of the unknown and ``log p(y_{1:t})``, each ``(T,)``.

    The grid covers the prior's support (rho) or its bulk (sigma, on the log scale); the integrals
    are trapezoidal sums on the grid, accurate far beyond the Monte Carlo errors tested."""
    dtype = ys.dtype
    if unknown == "rho":
        grid = torch.linspace(-1.0, 1.0, size, dtype=dtype)
        log_prior = torch.full_like(grid, -math.log(2.0))
        rho, sigma = grid, torch.tensor(SIGMA, dtype=dtype)
    else:
        grid = torch.linspace(-6.0, 3.0, size, dtype=dtype).exp()
        log_prior = dist.LogNormal(torch.tensor(-0.5, dtype=dtype), 0.5).log_prob(grid)
        rho, sigma = torch.tensor(RHO, dtype=dtype), grid
    log_joint = grid_log_likelihoods(ys, rho, sigma) + log_prior  # (T, G)
    log_dx = torch.log(torch.diff(grid))
    # trapezoid: sum over intervals of the mean of the two ends
    pairs = torch.logaddexp(log_joint[:, 1:], log_joint[:, :-1]) - math.log(2.0) + log_dx
    log_evidence = torch.logsumexp(pairs, -1)
    w = torch.exp(log_joint - log_evidence.unsqueeze(-1))
    dx = torch.diff(grid)

    def integral(f):
        g = w * f
        return (0.5 * (g[:, 1:] + g[:, :-1]) * dx).sum(-1)

    mean = integral(grid)
    sd = (integral(grid**2) - mean**2).sqrt()
    return mean, sd, log_evidence
