"""Regressors for the value and score functions of online variational filtering (Campbell et al., 2021).

See ``docs/math/streaming.md#value-function-regression``.

At each time step the filter draws ``N`` samples ``x_i`` ``(N, d)`` with targets ``y_i`` (``(N,)`` for
the value function ``V_t``, ``(N, P)`` for a parameter score ``S_t``), fits a regressor and then
backpropagates through ``regressor(x)`` into reparameterised samples. Hence every regressor here

* predicts differentiably in ``x`` (never in the training data: ``fit`` detaches inputs and targets,
  and nothing stored afterwards requires grad);
* costs constant memory and time per fit (``N`` fixed; nothing accumulates across fits);
* keeps dtype and device of the fit inputs, and round-trips through :meth:`Regressor.state_dict`.

Three regressors share one interface:

* :class:`QuadraticRegressor`: ridge least squares on quadratic features; exact for quadratic
  targets (the linear-Gaussian case, where ``V_t`` is quadratic).
* :class:`KernelRidgeRegressor`: RBF kernel ridge regression with a median-heuristic bandwidth.
* :class:`MLPRegressor`: a small MLP trained by Adam, warm-started from the previous fit.

:func:`make_regressor` builds one from a name. This module is pure torch.

Example:
    >>> import torch
    >>> from pyro_smc.regression import make_regressor
    >>> x = torch.randn(200, 2, dtype=torch.float64)
    >>> reg = make_regressor("quadratic").fit(x, (x ** 2).sum(-1))
    >>> x_new = torch.ones(5, 2, dtype=torch.float64, requires_grad=True)
    >>> v = reg(x_new)                                                 # (5,), differentiable in x_new
    >>> v.sum().backward()
    >>> v.shape, torch.allclose(x_new.grad, 2 * x_new.detach(), atol=1e-6)
    (torch.Size([5]), True)
"""

from __future__ import annotations

import abc
import math
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["Regressor", "QuadraticRegressor", "KernelRidgeRegressor", "MLPRegressor", "make_regressor"]


def _psd_solve(A: Tensor, B: Tensor) -> Tensor:
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


def _safe_scale(sd: Tensor) -> Tensor:
    # A constant column would divide by zero; leaving it unscaled is harmless.
    return torch.where(sd > 0, sd, torch.ones_like(sd))


def _check_nonnegative(name: str, value: float) -> float:
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
        """Everything needed to predict identically after :meth:`load_state_dict`: tensors and hyperparameters."""
        state = {"type": type(self).__name__, "fitted": self._fitted, "d": self._d, "k": self._k, "vector_targets": self._vector_targets}
        state.update(self._get_state())
        return state

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
        self.ridge = _check_nonnegative("ridge", ridge)

    def _fit(self, X: Tensor, Y: Tensor) -> None:
        self._mean = X.mean(0)
        self._scale = _safe_scale(X.std(0))
        Phi = _quadratic_features((X - self._mean) / self._scale)
        gram = Phi.T @ Phi
        penalty = torch.ones(gram.shape[0], dtype=X.dtype, device=X.device)
        penalty[0] = 0.0  # the intercept is not shrunk: a constant target stays exact
        lam = self.ridge * gram.diagonal().mean()
        self._weights = _psd_solve(gram + torch.diag(lam * penalty), Phi.T @ Y)

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
        self.ridge = _check_nonnegative("ridge", ridge)

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
        self._alpha = _psd_solve(K + N * self.ridge * eye, Y - self._y_mean)

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
        self._x_mean, self._x_scale = X.mean(0), _safe_scale(X.std(0))
        self._y_mean, self._y_scale = Y.mean(0), _safe_scale(Y.std(0))
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


_REGRESSORS = {"quadratic": QuadraticRegressor, "kernel": KernelRidgeRegressor, "mlp": MLPRegressor}


def make_regressor(spec: Union[str, Regressor], **kwargs: Any) -> Regressor:
    """Build a regressor from a name, passing ``kwargs`` to its constructor, or return an instance as is.

    Args:
        spec: ``"quadratic"``, ``"kernel"``, ``"mlp"`` or a :class:`Regressor` instance.
        **kwargs: constructor arguments; not allowed with an instance.

    Example:
        >>> type(make_regressor("kernel", ridge=1e-3)).__name__
        'KernelRidgeRegressor'
    """
    if isinstance(spec, Regressor):
        if kwargs:
            raise ValueError(f"spec is already a Regressor instance; kwargs {sorted(kwargs)} cannot be applied")
        return spec
    if not isinstance(spec, str) or spec not in _REGRESSORS:
        raise ValueError(f"spec must be one of {sorted(_REGRESSORS)} or a Regressor instance, got {spec!r}")
    return _REGRESSORS[spec](**kwargs)
