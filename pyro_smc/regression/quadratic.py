"""Ridge least squares on quadratic features: exact for quadratic targets.

In the linear-Gaussian case the value function ``V_t`` is quadratic in the state, so
:class:`QuadraticRegressor` recovers it exactly (up to the relative ridge); see
``docs/math/streaming.md#value-function-regression``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pyro_smc.regression.base import Regressor, check_nonnegative, psd_solve, safe_scale

__all__ = ["QuadraticRegressor"]


def _quadratic_features(z: Tensor) -> Tensor:
    """``(M, d)`` -> ``(M, 1 + d + d (d + 1) / 2)``: ``[1, z, z_i z_j for i <= j]``."""
    i, j = torch.triu_indices(z.shape[-1], z.shape[-1], device=z.device)
    return torch.cat([torch.ones_like(z[:, :1]), z, z[:, i] * z[:, j]], dim=-1)


class QuadraticRegressor(Regressor):
    """Ridge least squares on the features ``[1, z, z_i z_j (i <= j)]`` of standardised inputs ``z``.

    Inputs are standardised with the fit inputs' mean and standard deviation, which keeps the feature
    Gram matrix well conditioned. The ridge penalty is ``ridge * trace(G) / F`` (``G`` the ``F x F``
    feature Gram matrix) on all weights but the intercept, so the fit is exact for quadratic targets
    up to a relative error of order ``ridge`` times the Gram condition number.

    Args:
        ridge: relative ridge penalty, ``>= 0``.

    Example:
        >>> import torch
        >>> x = torch.randn(100, 3, dtype=torch.float64)
        >>> y = torch.stack([1 + x[:, 0] * x[:, 1], x[:, 2] ** 2], -1)             # (100, 2)
        >>> reg = QuadraticRegressor().fit(x, y)
        >>> torch.allclose(reg(x), y, atol=1e-6)
        True
    """

    def __init__(self, ridge: float = 1e-8) -> None:
        super().__init__()
        self.ridge = check_nonnegative("ridge", ridge)

    def _fit(self, X: Tensor, Y: Tensor) -> None:
        self._mean = X.mean(0)
        self._scale = safe_scale(X.std(0))
        Phi = _quadratic_features((X - self._mean) / self._scale)
        gram = Phi.T @ Phi
        penalty = torch.ones(gram.shape[0], dtype=X.dtype, device=X.device)
        penalty[0] = 0.0  # the intercept is not shrunk: a constant target stays exact
        lam = self.ridge * gram.diagonal().mean()
        self._weights = psd_solve(gram + torch.diag(lam * penalty), Phi.T @ Y)

    def _predict(self, x: Tensor) -> Tensor:
        return _quadratic_features((x - self._mean) / self._scale) @ self._weights

    def _reference(self) -> Tensor:
        return self._weights

    def _get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ridge": self.ridge}
        if self._fitted:
            state.update(mean=self._mean, scale=self._scale, weights=self._weights)
        return state

    def _set_state(self, state: dict[str, Any]) -> None:
        self.ridge = state["ridge"]
        if state["fitted"]:
            self._mean, self._scale, self._weights = state["mean"], state["scale"], state["weights"]
