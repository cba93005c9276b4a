"""RBF kernel ridge regression with a median-heuristic bandwidth.

See ``docs/math/streaming.md#value-function-regression``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from pyro_smc.regression.base import Regressor, check_nonnegative, psd_solve

__all__ = ["KernelRidgeRegressor"]


def _squared_distances(a: Tensor, b: Tensor) -> Tensor:
    """``(M, d), (N, d)`` -> ``(M, N)`` without the ``(M, N, d)`` intermediate that broadcasting would store for backward."""
    sq = a.pow(2).sum(-1, keepdim=True) - 2.0 * a @ b.T + b.pow(2).sum(-1)
    return sq.clamp_min(0.0)  # rounding can push exact zeros slightly negative


class KernelRidgeRegressor(Regressor):
    """RBF kernel ridge regression on centred targets.

    Predicts ``y_mean + k(x, X) alpha`` with ``k(x, x') = exp(-||x - x'||^2 / (2 h^2))`` and
    ``alpha = (K + N lambda I)^{-1} (Y - y_mean)``, solved by Cholesky. Stores ``X`` ``(N, d)`` and
    ``alpha`` ``(N, k)``; prediction costs ``O(M N (d + k))``.

    Args:
        bandwidth: ``h > 0``; ``None`` uses the median heuristic, the median pairwise distance of the
            fit inputs, recomputed at every fit (``1`` if all inputs coincide).
        ridge: ``lambda >= 0``.

    Example:
        >>> import torch
        >>> x = torch.linspace(-3, 3, 100, dtype=torch.float64).unsqueeze(-1)
        >>> reg = KernelRidgeRegressor(ridge=1e-6).fit(x, x.squeeze(-1).sin())
        >>> x_new = torch.tensor([[0.5]], dtype=torch.float64)
        >>> torch.allclose(reg(x_new), x_new.squeeze(-1).sin(), atol=1e-3)
        True
    """

    def __init__(self, bandwidth: Optional[float] = None, ridge: float = 1e-2) -> None:
        super().__init__()
        if bandwidth is not None and not (math.isfinite(float(bandwidth)) and float(bandwidth) > 0):
            raise ValueError(f"bandwidth must be None or a finite number > 0, got {bandwidth}")
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.ridge = check_nonnegative("ridge", ridge)

    @property
    def fitted_bandwidth(self) -> Tensor:
        """The bandwidth ``h`` used by the last fit (0-d tensor)."""
        if not self._fitted:
            raise RuntimeError("KernelRidgeRegressor is not fitted: call fit first")
        return self._h

    def _fit(self, X: Tensor, Y: Tensor) -> None:
        N = X.shape[0]
        # Centring X first reduces cancellation in the expanded squared distances (float32).
        self._centre = X.mean(0)
        self._X = X - self._centre
        sq = _squared_distances(self._X, self._X)
        if self.bandwidth is None:
            i, j = torch.triu_indices(N, N, offset=1, device=X.device)
            dist = sq[i, j].sqrt().sort().values
            m = dist.shape[0]
            h = 0.5 * (dist[(m - 1) // 2] + dist[m // 2])
            self._h = torch.where(h > 0, h, torch.ones_like(h))
        else:
            self._h = torch.tensor(self.bandwidth, dtype=X.dtype, device=X.device)
        K = torch.exp(-sq / (2 * self._h**2))
        self._y_mean = Y.mean(0)
        eye = torch.eye(N, dtype=X.dtype, device=X.device)
        self._alpha = psd_solve(K + N * self.ridge * eye, Y - self._y_mean)

    def _predict(self, x: Tensor) -> Tensor:
        K = torch.exp(-_squared_distances(x - self._centre, self._X) / (2 * self._h**2))
        return self._y_mean + K @ self._alpha

    def _reference(self) -> Tensor:
        return self._alpha

    def _get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"bandwidth": self.bandwidth, "ridge": self.ridge}
        if self._fitted:
            state.update(centre=self._centre, X=self._X, h=self._h, y_mean=self._y_mean, alpha=self._alpha)
        return state

    def _set_state(self, state: dict[str, Any]) -> None:
        self.bandwidth, self.ridge = state["bandwidth"], state["ridge"]
        if state["fitted"]:
            self._centre, self._X, self._h = state["centre"], state["X"], state["h"]
            self._y_mean, self._alpha = state["y_mean"], state["alpha"]
