"""The sharp-likelihood AR(1) of ``bench_epsilon.py``, its data, and per-run gradients of log Z_hat.

A copy of the model of the OT-gradient tests (``tests/infer/sharp_ar1.py``), so that the benchmark
does not import test code; the two must draw the same numbers (same model, same random streams).
"""

import pyro
import pyro.distributions as dist
import torch

from pyro_smc import SMC


class SharpAR1:
    """x_1 ~ N(0, 1), x_t = theta x_{t-1} + N(0, 1), y_t ~ N(x_t, obs_sd^2); theta may be (B, 1)."""

    def __init__(self, theta, obs_sd=0.3):
        self.theta, self.obs_sd = theta, obs_sd

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        # The first mean in the parameter's dtype, so a float32 run is float32 throughout.
        loc = self.theta * state["x"] if self.t else torch.zeros((), dtype=torch.as_tensor(self.theta).dtype)
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], self.obs_sd), obs=y)
        self.t += 1


def simulate(num_steps: int, seed: int, theta: float = 0.8, obs_sd: float = 0.3) -> torch.Tensor:
    """``num_steps`` observations of the AR(1), float64, shape ``(T,)``."""
    gen = torch.Generator().manual_seed(seed)
    x, ys = 0.0, []
    for _ in range(num_steps):
        x = theta * x + torch.randn((), generator=gen, dtype=torch.float64)
        ys.append(x + obs_sd * torch.randn((), generator=gen, dtype=torch.float64))
    return torch.stack(ys)


def per_run_gradients(ys, resampler, num_filters, num_particles, seed, theta=0.2, ess_threshold=0.5):
    """``d log Z_hat_b / d theta_b`` for ``num_filters`` independent runs, shape ``(B,)``, and the ``SMC``."""
    pyro.set_rng_seed(seed)
    theta = torch.full((num_filters, 1), theta, dtype=ys.dtype, requires_grad=True)
    smc = SMC(SharpAR1(theta), num_particles=num_particles, num_filters=num_filters, resampler=resampler, ess_threshold=ess_threshold)
    smc.run(ys)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), theta)
    return grad.squeeze(-1), smc
