"""The 2-d linear-Gaussian model of Corenflos et al. (2021), with learnable ``A = diag(theta)``."""

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from pyro_smc.ops.kalman import kalman_filter


class DiagLinearGaussian(PyroModule):
    """``x_1 ~ N(0, I)``, ``x_t = diag(theta) x_{t-1} + N(0, I)``, ``y_t = x_t + N(0, 0.1 I)``."""

    def __init__(self, theta, learnable=True):
        super().__init__()
        theta = torch.as_tensor(theta, dtype=torch.get_default_dtype())
        # learnable=False keeps a plain tensor, e.g. a leaf the caller differentiates against.
        self.theta = PyroParam(theta, constraint=constraints.interval(0.0, 1.0)) if learnable else theta

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        d = self.theta.shape[-1]
        if self.t == 0:
            x = pyro.sample(f"x_{self.t}", dist.Normal(torch.zeros(d), 1.0).to_event(1))
        else:
            x = pyro.sample(f"x_{self.t}", dist.Normal(self.theta * state["x"], 1.0).to_event(1))
        state["x"] = x
        pyro.sample(f"y_{self.t}", dist.Normal(x, 0.1**0.5).to_event(1), obs=y)
        self.t += 1


def kalman_log_evidence(theta, ys):
    eye = torch.eye(theta.shape[-1], dtype=ys.dtype)
    return kalman_filter(ys, torch.diag(theta), eye, eye, 0.1 * eye, torch.zeros_like(theta), eye).log_evidence


def simulate(theta, T, seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.as_tensor(theta, dtype=torch.get_default_dtype())
    xs, ys = [], []
    x = torch.randn(theta.shape, generator=g)
    for t in range(T):
        if t > 0:
            x = theta * x + torch.randn(theta.shape, generator=g)
        xs.append(x)
        ys.append(x + 0.1**0.5 * torch.randn(theta.shape, generator=g))
    return torch.stack(xs), torch.stack(ys)


def kalman_mle(ys, init=(0.5, 0.5), steps=200):
    raw = torch.logit(torch.tensor(init, dtype=ys.dtype)).requires_grad_()
    opt = torch.optim.LBFGS([raw], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-10)

    def closure():
        opt.zero_grad()
        loss = -kalman_log_evidence(torch.sigmoid(raw), ys)
        loss.backward()
        return loss

    opt.step(closure)
    return torch.sigmoid(raw).detach()
