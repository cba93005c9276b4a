"""Seeds, fast settings and reference functions shared by the tests of ``pyro_smc.regression``."""

import torch

from pyro_smc.regression import make_regressor

SEED = 0
F64 = torch.float64

# Small, fast settings per regressor, used wherever the test is about the interface rather than accuracy.
FAST = {
    "quadratic": {},
    "kernel": {},
    "mlp": {"hidden_dims": (16, 16), "num_steps": 30},
}


def _gen(offset=0):
    return torch.Generator().manual_seed(SEED + offset)


def _random_quadratic(d, k, g, dtype=F64):
    """``y_j(x) = x^T A_j x + b_j^T x + c_j`` with its gradient ``(A_j + A_j^T) x + b_j``."""
    A = torch.randn(k, d, d, generator=g, dtype=dtype)
    b = torch.randn(k, d, generator=g, dtype=dtype)
    c = torch.randn(k, generator=g, dtype=dtype)

    def f(x):
        return torch.einsum("ni,kij,nj->nk", x, A, x) + x @ b.T + c

    def grad(x):  # (n, k, d)
        return torch.einsum("kij,nj->nki", A + A.transpose(-1, -2), x) + b

    return f, grad


def _regressor(name, **kwargs):
    if name == "mlp":
        kwargs.setdefault("generator", _gen(99))
    return make_regressor(name, **{**FAST[name], **kwargs})


def _state_tensors(state):
    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _rel_err(pred, truth):
    return float((pred - truth).norm() / truth.norm())
