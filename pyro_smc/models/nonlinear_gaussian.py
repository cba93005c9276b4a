"""Nonlinear state-space model with additive Gaussian noise; dynamics and measurements are
known functions or Gaussian processes.

See ``docs/math/ep.md#model``.

``x_0 ~ N(init_mean, init_cov)``, ``x_{t+1} = f(x_t, t) + w_t``, ``w_t ~ N(0, Q)``,
``y_t = g(x_t, t) + v_t``, ``v_t ~ N(0, R)``, with ``t`` the 0-based time index (``f(x, t)`` maps
the state at ``t`` to the mean at ``t + 1``). ``f`` and ``g`` are callables ``f(x)`` or
``f(x, t)``, batched over the leading dims of ``x``, or :class:`pyro_smc.gp.MultiOutputGP`
posteriors, whose predictive variance is added to the noise covariance.

The same object is a Pyro model in the ``init``/``step`` protocol (so :class:`pyro_smc.SMC` can
filter it: the cross-check of every Gaussian smoother) and the input of
:class:`pyro_smc.EPSmoother` and the Gaussian filters and smoothers: it satisfies
:class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`. Whether a callable takes ``t`` is
decided once, here; ``transition_fn``/``observation_fn`` always take it.

Example:
    >>> import torch
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> one = torch.ones(1, 1)
    >>> ssm = NonlinearGaussianSSM(lambda x: torch.sin(x), 0.1 * one, lambda x: x**2 / 20, one,
    ...                            torch.zeros(1), one)
    >>> xs, ys = ssm.simulate(20, generator=torch.Generator().manual_seed(0))
    >>> xs.shape, ys.shape
    (torch.Size([20, 1]), torch.Size([20, 1]))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import Tensor

from pyro_smc.ops.gaussian import check_psd

__all__ = ["NonlinearGaussianSSM"]


def is_gp(fn: object) -> bool:
    """Whether ``fn`` is a GP posterior with exact moments (duck-typed on ``MultiOutputGP``)."""
    return all(hasattr(fn, name) for name in ("predict", "predict_moments", "linearize"))


def is_time_invariant(fn: object) -> bool:
    """Whether the callable ``fn(x, t)`` is known to ignore ``t`` (marked ``time_invariant``), so
    one call can evaluate it at every time step at once."""
    return bool(getattr(fn, "time_invariant", False))


def _ignore_time(fn: Callable) -> Callable[[Tensor, int], Tensor]:
    def without_time(x: Tensor, t: int) -> Tensor:
        return fn(x)

    without_time.time_invariant = True
    return without_time


def _takes_time(fn: Callable) -> bool:
    if isinstance(fn, torch.nn.Module):  # its __call__ is (*args, **kwargs); forward says what it takes
        fn = fn.forward
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature take x only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class NonlinearGaussianSSM(PyroModule):
    """Nonlinear Gaussian state-space model.

    Args:
        transition: ``f(x)`` or ``f(x, t)`` mapping ``(..., d)`` to ``(..., d)``, or a
            ``MultiOutputGP`` with ``d`` inputs and ``d`` outputs.
        transition_cov: ``Q``, ``(d, d)`` positive definite.
        observation: ``g(x)`` or ``g(x, t)`` mapping ``(..., d)`` to ``(..., e)``, or a
            ``MultiOutputGP`` with ``d`` inputs and ``e`` outputs.
        observation_cov: ``R``, ``(e, e)`` positive definite.
        init_mean: ``(d,)``.
        init_cov: ``(d, d)`` positive definite.

    Raises:
        ValueError: a covariance of the wrong shape or not positive definite, or a map whose
            output at ``init_mean`` does not have shape ``(d,)`` (transition) or ``(e,)``
            (observation).

    Example:
        A time-varying observation ``g(x, t)`` beside a time-free transition ``f(x)``:

        >>> import torch
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> from pyro_smc.models.protocol import GaussianStateSpaceModel
        >>> eye = torch.eye(2)
        >>> ssm = NonlinearGaussianSSM(torch.tanh, 0.1 * eye, lambda x, t: x[..., :1] * t, torch.eye(1),
        ...                            torch.zeros(2), eye)
        >>> ssm.state_dim, ssm.obs_dim, isinstance(ssm, GaussianStateSpaceModel)
        (2, 1, True)
        >>> ssm.observation_fn(torch.ones(4, 2), 3).shape               # (..., d) -> (..., e)
        torch.Size([4, 1])
        >>> xs, ys = ssm.simulate(5, generator=torch.Generator().manual_seed(0))
        >>> xs.shape, ys.shape                                         # (T, d), (T, e)
        (torch.Size([5, 2]), torch.Size([5, 1]))
    """

    def __init__(
        self,
        transition: Callable | object,
        transition_cov: Tensor,
        observation: Callable | object,
        observation_cov: Tensor,
        init_mean: Tensor,
        init_cov: Tensor,
    ):
        super().__init__()
        init_mean = torch.as_tensor(init_mean, dtype=torch.get_default_dtype()) if not isinstance(init_mean, Tensor) else init_mean
        if init_mean.dim() != 1:
            raise ValueError(f"init_mean must have shape (d,), got {tuple(init_mean.shape)}")
        d = init_mean.shape[0]
        for name, value, size in (("transition_cov", transition_cov, d), ("init_cov", init_cov, d)):
            if tuple(value.shape) != (size, size):
                raise ValueError(f"{name} must have shape ({size}, {size}), got {tuple(value.shape)}")
            check_psd(name, value)
        if observation_cov.dim() != 2:
            raise ValueError(f"observation_cov must have shape (e, e), got {tuple(observation_cov.shape)}")
        check_psd("observation_cov", observation_cov)
        self.transition = transition
        self.observation = observation
        self.register_buffer("transition_cov", transition_cov)
        self.register_buffer("observation_cov", observation_cov)
        self.register_buffer("init_mean", init_mean)
        self.register_buffer("init_cov", init_cov)
        self.transition_takes_time = not is_gp(transition) and _takes_time(transition)
        self.observation_takes_time = not is_gp(observation) and _takes_time(observation)
        with torch.no_grad():
            for name, (mean, _), size in (
                ("transition", self.transition_mean_var(init_mean, 0), d),
                ("observation", self.observation_mean_var(init_mean, 0), observation_cov.shape[0]),
            ):
                if tuple(mean.shape) != (size,):
                    raise ValueError(f"{name} must map a state of shape ({d},) to shape ({size},), got {tuple(mean.shape)}")
        self._t = 0

    @property
    def state_dim(self) -> int:
        return self.init_mean.shape[0]

    @property
    def obs_dim(self) -> int:
        return self.observation_cov.shape[0]

    @property
    def transition_fn(self):
        """``f(x, t)`` (time always passed) or the transition GP; what the projections take."""
        return self.transition if is_gp(self.transition) or self.transition_takes_time else _ignore_time(self.transition)

    @property
    def observation_fn(self):
        """``g(x, t)`` (time always passed) or the observation GP; what the projections take."""
        return self.observation if is_gp(self.observation) or self.observation_takes_time else _ignore_time(self.observation)

    @staticmethod
    def _evaluate(fn, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        if is_gp(fn):
            return fn.predict(x)
        return fn(x, t), None

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """Mean of ``x_{t+1}`` given ``x_t = x`` ``(..., d)`` and the GP predictive variance (or ``None``)."""
        return self._evaluate(self.transition_fn, x, t)

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """Mean of ``y_t`` given ``x_t = x`` ``(..., e)`` and the GP predictive variance (or ``None``)."""
        return self._evaluate(self.observation_fn, x, t)

    # --- the SMC protocol -------------------------------------------------------------------
    def init(self, state: dict) -> None:
        """Starts a new sequence; the first :meth:`step` samples ``x_0`` from the prior."""
        self._t = 0

    @staticmethod
    def _normal(mean: Tensor, cov: Tensor, var: Tensor | None) -> dist.MultivariateNormal:
        if var is None:
            return dist.MultivariateNormal(mean, covariance_matrix=cov)
        return dist.MultivariateNormal(mean, covariance_matrix=cov + torch.diag_embed(var))

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples ``x_t`` (from the prior at ``t = 0``) and observes ``y_t``."""
        t = self._t
        if "x" in state:
            mean, var = self.transition_mean_var(state["x"], t - 1)
            prior = self._normal(mean, self.transition_cov, var)
        else:
            prior = dist.MultivariateNormal(self.init_mean, covariance_matrix=self.init_cov)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        mean, var = self.observation_mean_var(x, t)
        return pyro.sample(f"y_{t}", self._normal(mean, self.observation_cov, var), obs=y)

    @torch.no_grad()
    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws ``(xs, ys)`` of shapes ``(T, d)`` and ``(T, e)`` from the model."""
        dtype, device = self.init_mean.dtype, self.init_mean.device

        def draw(mean: Tensor, cov: Tensor, var: Tensor | None) -> Tensor:
            cov = cov if var is None else cov + torch.diag_embed(var)
            noise = torch.randn(mean.shape, dtype=dtype, device=device, generator=generator)
            return mean + torch.linalg.cholesky(cov) @ noise

        xs, ys = [], []
        x = draw(self.init_mean, self.init_cov, None)
        for t in range(num_steps):
            if t > 0:
                mean, var = self.transition_mean_var(x, t - 1)
                x = draw(mean, self.transition_cov, var)
            xs.append(x)
            mean, var = self.observation_mean_var(x, t)
            ys.append(draw(mean, self.observation_cov, var))
        return torch.stack(xs), torch.stack(ys)
