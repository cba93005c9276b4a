"""The interface every value/score regressor shares, and the numerics its subclasses reuse.

:class:`Regressor` validates and detaches the fit data, reshapes predictions to the targets' shape,
casts ``x`` to the fit dtype and device, and wraps the subclass state in :meth:`Regressor.state_dict`.
A subclass implements ``_fit``, ``_predict``, ``_reference``, ``_get_state`` and ``_set_state`` on
validated ``(N, d)`` / ``(N, k)`` tensors. The helpers below (a PSD solve that jitters only when
Cholesky fails, a zero-safe standardising scale, a hyperparameter check) are shared by
``pyro_smc.regression.quadratic``, ``pyro_smc.regression.kernel_ridge`` and ``pyro_smc.regression.mlp``.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["Regressor"]


def psd_solve(A: Tensor, B: Tensor) -> Tensor:
    """Solve ``A X = B`` for symmetric PSD ``A`` by Cholesky, adding diagonal jitter only if it fails."""
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:
        # Only reached with ridge = 0 and rank-deficient data: the smallest jitter that works gives a
        # near minimum-norm solution instead of an error.
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        scale = A.diagonal().mean().clamp_min(torch.finfo(A.dtype).tiny)
        for exponent in range(-12, -3):
            L, info = torch.linalg.cholesky_ex(A + (10.0**exponent) * scale * eye)
            if int(info) == 0:
                break
        else:
            raise RuntimeError("Cholesky factorisation failed even with jitter; increase ridge")
    return torch.cholesky_solve(B, L)


def safe_scale(sd: Tensor) -> Tensor:
    """``sd`` with its zeros replaced by ones: the divisor that standardises a column."""
    # A constant column would divide by zero; leaving it unscaled is harmless.
    return torch.where(sd > 0, sd, torch.ones_like(sd))


def check_nonnegative(name: str, value: float) -> float:
    """``value`` as a float; a ``ValueError`` naming ``name`` unless it is finite and ``>= 0``."""
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


class Regressor(abc.ABC):
    """Base class: ``fit(inputs (N, d), targets (N,) or (N, k))`` then ``regressor(x (..., d))``.

    Predictions have shape ``(...,)`` or ``(..., k)`` following the targets of the last fit, and are
    computed in the dtype and on the device of the fit inputs (``x`` is cast to them).
    Subclasses implement ``_fit``, ``_predict``, ``_reference``, ``_get_state`` and ``_set_state``.

    Returns:
        ``fit`` returns the regressor itself; a call returns predictions ``(...,)`` (vector
        targets) or ``(..., k)``.

    Raises:
        ValueError: ``fit`` inputs that are not ``(N >= 2, d >= 1)`` floating and finite, or
            targets not ``(N,)`` / ``(N, k)``; a call with trailing dimension other than ``d``.
        RuntimeError: a call before ``fit``.

    Example:
        A minimal subclass that predicts the mean target:

        >>> import torch
        >>> from pyro_smc.regression import Regressor
        >>> class MeanRegressor(Regressor):
        ...     def _fit(self, X, Y):
        ...         self.mean = Y.mean(0)                                  # (k,)
        ...     def _predict(self, x):
        ...         return self.mean.expand(x.shape[0], -1)                # (M, k)
        ...     def _reference(self):
        ...         return self.mean
        ...     def _get_state(self):
        ...         return {"mean": self.mean}
        ...     def _set_state(self, state):
        ...         self.mean = state["mean"]
        >>> reg = MeanRegressor().fit(torch.zeros(4, 2), torch.arange(4.0))   # (N, d), (N,)
        >>> reg(torch.zeros(3, 5, 2))                                     # (..., d) -> (...,)
        tensor([[1.5000, 1.5000, 1.5000, 1.5000, 1.5000],
                [1.5000, 1.5000, 1.5000, 1.5000, 1.5000],
                [1.5000, 1.5000, 1.5000, 1.5000, 1.5000]])
        >>> reg.fit(torch.zeros(4, 2), torch.ones(4, 3))(torch.zeros(2)).shape   # (k,) targets
        torch.Size([3])
    """

    def __init__(self) -> None:
        self._fitted = False
        self._d: Optional[int] = None
        self._k: Optional[int] = None
        self._vector_targets = False  # targets were (N,): predictions drop the trailing k = 1

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` (or :meth:`load_state_dict` of a fitted state) has been called."""
        return self._fitted

    def fit(self, inputs: Tensor, targets: Tensor) -> Regressor:
        """Fit to ``inputs`` ``(N, d)`` and ``targets`` ``(N,)`` or ``(N, k)``; both are detached. Returns ``self``."""
        if not isinstance(inputs, Tensor) or inputs.dim() != 2:
            raise ValueError(f"inputs must be a 2-D tensor (N, d), got shape {tuple(getattr(inputs, 'shape', ()))}")
        if not inputs.is_floating_point():
            raise ValueError(f"inputs must have a floating dtype, got {inputs.dtype}")
        N = inputs.shape[0]
        if inputs.shape[1] < 1:
            raise ValueError(f"inputs must have at least one column (d >= 1), got shape {tuple(inputs.shape)}")
        if N < 2:
            raise ValueError(f"inputs must have at least 2 rows (N >= 2), got N={N}")
        if not isinstance(targets, Tensor) or targets.dim() not in (1, 2) or targets.shape[0] != N:
            raise ValueError(f"targets must have shape (N,) or (N, k) with N={N}, got {tuple(getattr(targets, 'shape', ()))}")
        X = inputs.detach()
        Y = targets.detach().to(dtype=X.dtype, device=X.device)
        if not torch.isfinite(X).all():
            raise ValueError("inputs contain non-finite values (NaN or inf)")
        if not torch.isfinite(Y).all():
            raise ValueError("targets contain non-finite values (NaN or inf)")
        self._vector_targets = Y.dim() == 1
        Y = Y.reshape(N, -1)
        self._fit(X, Y)
        self._d, self._k = X.shape[1], Y.shape[1]
        self._fitted = True
        return self

    def __call__(self, x: Tensor) -> Tensor:
        """Predict at ``x`` ``(..., d)``: returns ``(...,)`` or ``(..., k)``, differentiable in ``x``."""
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit first")
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != self._d:
            raise ValueError(f"x must have trailing dimension d={self._d}, got shape {tuple(getattr(x, 'shape', ()))}")
        ref = self._reference()
        batch = x.shape[:-1]
        out = self._predict(x.to(dtype=ref.dtype, device=ref.device).reshape(-1, self._d))
        return out.reshape(batch) if self._vector_targets else out.reshape(*batch, self._k)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to predict identically after :meth:`load_state_dict`: tensors and
        hyperparameters, as a snapshot (copies: a later :meth:`fit`, which may update the weights
        in place, does not change it)."""
        state = {"type": type(self).__name__, "fitted": self._fitted, "d": self._d, "k": self._k, "vector_targets": self._vector_targets}
        state.update(self._get_state())
        return _snapshot(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same class (hyperparameters included); tensors are copied."""
        if state.get("type") != type(self).__name__:
            raise ValueError(f"state is for {state.get('type')!r}, not {type(self).__name__}")
        state = {key: value.detach().clone() if isinstance(value, Tensor) else value for key, value in state.items()}
        self._set_state(state)
        self._fitted, self._d, self._k, self._vector_targets = state["fitted"], state["d"], state["k"], state["vector_targets"]

    @abc.abstractmethod
    def _fit(self, X: Tensor, Y: Tensor) -> None:
        """Fit to detached, validated ``X`` ``(N, d)`` and ``Y`` ``(N, k)``."""

    @abc.abstractmethod
    def _predict(self, x: Tensor) -> Tensor:
        """``(M, d)`` -> ``(M, k)``."""

    @abc.abstractmethod
    def _reference(self) -> Tensor:
        """A stored tensor whose dtype and device predictions use."""

    @abc.abstractmethod
    def _get_state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _set_state(self, state: dict[str, Any]) -> None: ...


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor inside (lists, tuples and dicts included) detached and copied."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(item) for item in value)
    return value
