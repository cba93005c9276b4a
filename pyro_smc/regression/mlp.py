"""A small MLP regressor trained by Adam, warm-started from the previous fit.

See ``docs/math/streaming.md#value-function-regression``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from pyro_smc.regression.base import Regressor, safe_scale

__all__ = ["MLPRegressor"]


_ACTIVATIONS = {"tanh": torch.tanh, "silu": torch.nn.functional.silu}


class MLPRegressor(Regressor):
    """A small MLP on standardised inputs and targets, trained by Adam on the squared error.

    Built lazily at the first fit (when ``d`` and ``k`` are known) in the fit inputs' dtype and
    device; later fits warm-start from the current weights (rebuilt only if ``d`` or ``k``
    change), so each fit costs ``num_steps`` Adam steps. Inputs and targets are standardised with
    the statistics of each fit. The weights do not require grad between fits.

    Args:
        hidden_dims: widths of the hidden layers, a non-empty sequence of positive ints.
        activation: ``"tanh"`` or ``"silu"`` (smooth, so ``grad_x`` of predictions is continuous).
        num_steps: Adam steps per fit, ``>= 1``.
        lr: Adam learning rate, ``> 0``.
        batch_size: minibatch size, or ``None`` for full batch.
        generator: ``torch.Generator`` for the initial weights and minibatches (global RNG if ``None``).

    Attributes:
        losses: ``(num_steps,)`` training losses (standardised units) of the last fit, each before its step.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(128, 2, generator=g)
        >>> reg = MLPRegressor(hidden_dims=(16,), num_steps=100, generator=g).fit(x, x.sin())
        >>> reg(x[:3]).shape, bool(reg.losses[-1] < reg.losses[0])
        (torch.Size([3, 2]), True)
    """

    def __init__(
        self,
        hidden_dims: Sequence[int] = (64, 64),
        activation: str = "tanh",
        num_steps: int = 200,
        lr: float = 1e-2,
        batch_size: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        hidden = tuple(hidden_dims) if isinstance(hidden_dims, (list, tuple)) else None
        if not hidden or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
            raise ValueError(f"hidden_dims must be a non-empty sequence of positive ints, got {hidden_dims!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if not (math.isfinite(float(lr)) and float(lr) > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        self.hidden_dims, self.activation, self.num_steps = hidden, activation, num_steps
        self.lr, self.batch_size, self.generator = float(lr), batch_size, generator
        self._params: list[Tensor] = []  # [W_1, b_1, ..., W_L, b_L], W_l of shape (out, in)
        self.losses = torch.empty(0)

    def _build(self, d: int, k: int, like: Tensor) -> None:
        widths = (d, *self.hidden_dims, k)
        gen_device = self.generator.device if self.generator is not None else like.device
        self._params = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            # torch.nn.Linear's default scale, drawn from our generator for reproducibility.
            bound = 1.0 / math.sqrt(fan_in)
            for shape in ((fan_out, fan_in), (fan_out,)):
                u = torch.rand(shape, generator=self.generator, dtype=like.dtype, device=gen_device)
                self._params.append(((2 * u - 1) * bound).to(like.device))

    def _forward(self, z: Tensor) -> Tensor:
        act = _ACTIVATIONS[self.activation]
        n_layers = len(self._params) // 2
        for layer in range(n_layers):
            z = torch.nn.functional.linear(z, self._params[2 * layer], self._params[2 * layer + 1])
            if layer < n_layers - 1:
                z = act(z)
        return z

    def _fit(self, X: Tensor, Y: Tensor) -> None:
        N, d = X.shape
        k = Y.shape[1]
        if not self._params or self._params[0].shape[1] != d or self._params[-1].shape[0] != k:
            self._build(d, k, X)
        self._params = [p.to(dtype=X.dtype, device=X.device).requires_grad_(True) for p in self._params]
        self._x_mean, self._x_scale = X.mean(0), safe_scale(X.std(0))
        self._y_mean, self._y_scale = Y.mean(0), safe_scale(Y.std(0))
        Z, T = (X - self._x_mean) / self._x_scale, (Y - self._y_mean) / self._y_scale
        # A fresh optimiser per fit: the targets move between fits, stale moments would mislead.
        optimizer = torch.optim.Adam(self._params, lr=self.lr)
        batch = None if self.batch_size is None or self.batch_size >= N else self.batch_size
        gen_device = self.generator.device if self.generator is not None else X.device
        losses = []
        with torch.enable_grad():  # fit may be called under no_grad by the filter
            for _ in range(self.num_steps):
                if batch is None:
                    z, t = Z, T
                else:
                    idx = torch.randperm(N, generator=self.generator, device=gen_device)[:batch].to(X.device)
                    z, t = Z[idx], T[idx]
                loss = (self._forward(z) - t).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
        # Frozen between fits: a backward pass of the filter through predictions must not touch them.
        self._params = [p.detach().requires_grad_(False) for p in self._params]
        self.losses = torch.stack(losses)

    def _predict(self, x: Tensor) -> Tensor:
        return self._forward((x - self._x_mean) / self._x_scale) * self._y_scale + self._y_mean

    def _reference(self) -> Tensor:
        return self._params[0]

    def _get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "hidden_dims": self.hidden_dims,
            "activation": self.activation,
            "num_steps": self.num_steps,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "params": list(self._params),
        }
        if self._fitted:
            state.update(x_mean=self._x_mean, x_scale=self._x_scale, y_mean=self._y_mean, y_scale=self._y_scale)
        return state

    def _set_state(self, state: dict[str, Any]) -> None:
        self.hidden_dims, self.activation, self.num_steps = tuple(state["hidden_dims"]), state["activation"], state["num_steps"]
        self.lr, self.batch_size = state["lr"], state["batch_size"]
        self._params = [p.detach().clone() for p in state["params"]]
        if state["fitted"]:
            self._x_mean, self._x_scale = state["x_mean"], state["x_scale"]
            self._y_mean, self._y_scale = state["y_mean"], state["y_scale"]
