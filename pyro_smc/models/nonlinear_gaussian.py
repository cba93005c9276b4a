r"""Nonlinear state-space model with additive Gaussian noise; dynamics and measurements are
known functions or Gaussian processes.

See ``docs/math/ep.md#model``.

:math:`x_0 \sim \mathcal N(\mathrm{init\_mean}, \mathrm{init\_cov})`, :math:`x_{t+1} = f(x_t) + w_t`, :math:`w_t \sim \mathcal N(0, Q)`,
:math:`y_t = g(x_t) + v_t`, :math:`v_t \sim \mathcal N(0, R)`. ``f`` and ``g`` are callables batched over the leading
dims of ``x``, or :class:`pyro_smc.gp.MultiOutputGP` posteriors, whose predictive variance is added
to the noise covariance.

Time dependence is explicit. A callable is called ``f(x)``, whatever its signature (so
``def f(x, forcing=8.0)`` and ``lambda x, F=F: ...`` keep their defaults); a map that takes the
0-based time index is marked with :func:`time_dependent` and is then called ``f(x, t)``, with
``f(x, t)`` mapping the state at ``t`` to the mean at ``t + 1``. An unmarked callable whose
second positional parameter has no default is refused when the model is built: it would fail when
called ``f(x)``, and the likely fix is the mark.

The same object is a Pyro model in the ``init``/``step`` protocol (so :class:`pyro_smc.SMC` can
filter it: the cross-check of every Gaussian smoother) and the input of
:class:`pyro_smc.EPSmoother` and the Gaussian filters and smoothers: it satisfies
:class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`, whose ``transition_fn``/``observation_fn``
always take ``t`` (an unmarked map is adapted once, here).

Example:
    >>> import torch
    >>> from pyro_smc.models import NonlinearGaussianSSM, time_dependent
    >>> one = torch.ones(1, 1)
    >>> ssm = NonlinearGaussianSSM(
    ...     lambda x: torch.sin(x), 0.1 * one, lambda x: x**2 / 20, one, torch.zeros(1), one
    ... )
    >>> xs, ys = ssm.simulate(20, generator=torch.Generator().manual_seed(0))
    >>> xs.shape, ys.shape
    (torch.Size([20, 1]), torch.Size([20, 1]))
    >>> forced = NonlinearGaussianSSM(time_dependent(lambda x, t: 0.5 * x + t), 0.1 * one,
    ...                               lambda x: x, one, torch.zeros(1), one)
    >>> forced.transition_fn(torch.ones(1), 3)                       # 0.5 * 1 + 3
    tensor([3.5000])
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

__all__ = ["NonlinearGaussianSSM", "time_dependent"]

_MARK = "time_dependent"


def time_dependent(fn: Callable) -> Callable:
    """Marks ``fn`` as a map ``fn(x, t)`` of the state and the 0-based time index, for
    :class:`NonlinearGaussianSSM` (which calls an unmarked map ``fn(x)``).

    Sets the attribute ``time_dependent = True`` on ``fn`` and returns ``fn`` itself, so it works
    on functions, lambdas and ``nn.Module`` instances, and as a decorator (of a function, of a
    module's ``forward`` or of a module class).

    Args:
        fn: the callable ``fn(x, t)``, ``x`` of shape ``(..., d)``.

    Returns:
        ``fn``, marked.

    Raises:
        TypeError: ``fn`` is not callable, or cannot carry an attribute (a builtin such as
            ``torch.sin``, a bound method): wrap it, ``time_dependent(lambda x, t: fn(x, t))``.

    Example:
        >>> import torch
        >>> from pyro_smc.models import time_dependent
        >>> @time_dependent
        ... def forcing(x, t):
        ...     return 0.9 * x + torch.cos(torch.tensor(1.2 * t))
        >>> forcing.time_dependent
        True
    """
    if not callable(fn):
        raise TypeError(f"time_dependent takes a callable fn(x, t), got {type(fn).__name__}")
    try:
        setattr(fn, _MARK, True)
    except (AttributeError, TypeError):
        raise TypeError(
            f"time_dependent cannot mark {fn!r}: it cannot carry an attribute (a builtin or a bound method); "
            "wrap it instead, time_dependent(lambda x, t: fn(x, t))"
        ) from None
    return fn


def is_time_dependent(fn: object) -> bool:
    """Whether ``fn`` is marked by :func:`time_dependent` (a module also through its ``forward``)."""
    if getattr(fn, _MARK, False) is True:
        return True
    return isinstance(fn, torch.nn.Module) and getattr(type(fn).forward, _MARK, False) is True


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


def _positional(fn: Callable) -> list[inspect.Parameter] | None:
    """The positional parameters of ``fn`` (a module's ``forward``), or ``None`` when it has
    ``*args`` or no signature (a builtin), so nothing can be said."""
    if isinstance(fn, torch.nn.Module):  # its __call__ is (*args, **kwargs); forward says what it takes
        fn = fn.forward
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _check_batched(name: str, evaluate: Callable, init_mean: Tensor, size: int) -> None:
    """The map, evaluated on a batch of ``d + 2`` states near ``init_mean``, returns one row per
    state, equal to its value on that state alone. The smoothers evaluate it on batches (sigma
    points; copies of the state for the Jacobian), and a map written for one state (``A @ x``,
    ``x[0]``) can return the right shape there and the wrong numbers: with ``A @ x`` and ``d``
    copies of a ``d``-state, linearisation ran and reported convergence 2.4 off the Kalman
    means."""
    d = init_mean.shape[0]
    k = d + 2  # neither d nor e, so that a map that mixes batch and state dims cannot fit
    offsets = torch.linspace(-1.0, 1.0, k * d, dtype=init_mean.dtype, device=init_mean.device).reshape(k, d)
    states = init_mean + 0.01 * (1 + init_mean.abs()) * offsets
    hint = f"{name} must map a batch of states (..., {d}) row by row (write x[..., i] and x @ A.T, not x[i] and A @ x)"
    try:
        batch, _ = evaluate(states, 0)
    except (RuntimeError, IndexError, ValueError) as error:
        raise ValueError(f"{hint}; on a batch of shape ({k}, {d}) it raised: {error}") from error
    if not isinstance(batch, Tensor) or tuple(batch.shape) != (k, size):
        shape = tuple(batch.shape) if isinstance(batch, Tensor) else type(batch).__name__
        raise ValueError(f"{hint}; on a batch of shape ({k}, {d}) it returned {shape}, not ({k}, {size})")
    for i in range(k):
        single, _ = evaluate(states[i], 0)
        if not torch.allclose(batch[i], single, rtol=1e-4, atol=1e-6, equal_nan=True):
            raise ValueError(f"{hint}; on a batch of shape ({k}, {d}), row {i} differs from the map of that state alone")


def _check_time_argument(name: str, fn: Callable) -> bool:
    """Whether the map ``name`` is called ``fn(x, t)``; raises on a signature that contradicts it."""
    if is_gp(fn):
        if is_time_dependent(fn):
            raise ValueError(f"{name} is a GP posterior marked time_dependent; a GP map takes the state only")
        return False
    if not callable(fn):
        raise ValueError(f"{name} must be a callable or a MultiOutputGP, got {type(fn).__name__}")
    positional = _positional(fn)
    if is_time_dependent(fn):
        if positional is not None and len(positional) < 2:
            raise ValueError(f"{name} is marked time_dependent, so it is called {name}(x, t), but it takes a single positional parameter")
        return True
    if positional is not None and len(positional) >= 2 and positional[1].default is inspect.Parameter.empty:
        raise ValueError(
            f"{name} has a second required positional parameter {positional[1].name!r}, but an unmarked map is called "
            f"{name}(x): if {positional[1].name!r} is the time index, mark the map with "
            "pyro_smc.models.time_dependent(...) to have it called (x, t); otherwise give the parameter a default"
        )
    return False


class NonlinearGaussianSSM(PyroModule):
    """Nonlinear Gaussian state-space model.

    Args:
        transition: ``f(x)`` (or, marked with :func:`time_dependent`, ``f(x, t)``) mapping
            ``(..., d)`` to ``(..., d)``, or a ``MultiOutputGP`` with ``d`` inputs and ``d`` outputs.
        transition_cov: ``Q``, ``(d, d)`` positive definite.
        observation: ``g(x)`` (or, marked, ``g(x, t)``) mapping ``(..., d)`` to ``(..., e)``, or a
            ``MultiOutputGP`` with ``d`` inputs and ``e`` outputs.
        observation_cov: ``R``, ``(e, e)`` positive definite.
        init_mean: ``(d,)``; its dtype and device are the model's.
        init_cov: ``(d, d)`` positive definite.

    Raises:
        ValueError: a covariance of the wrong shape, dtype or device, or not positive definite; an
            unmarked callable whose second positional parameter has no default (mark it with
            :func:`time_dependent` if that is the time index); a marked one that cannot take
            ``t``; or a map whose output at ``init_mean`` does not have shape ``(d,)``
            (transition) or the size of ``observation_cov`` (observation), or the model's dtype.

    Example:
        A time-varying observation ``g(x, t)`` beside a time-free transition ``f(x)``:

        >>> import torch
        >>> from pyro_smc.models import NonlinearGaussianSSM, time_dependent
        >>> from pyro_smc.models.protocol import GaussianStateSpaceModel
        >>> eye = torch.eye(2)
        >>> sensor = time_dependent(lambda x, t: x[..., :1] * t)
        >>> ssm = NonlinearGaussianSSM(
        ...     torch.tanh, 0.1 * eye, sensor, torch.eye(1), torch.zeros(2), eye
        ... )
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
        if not init_mean.is_floating_point():
            raise ValueError(f"init_mean must be a floating-point tensor (it sets the model's dtype), got {init_mean.dtype}")
        if not bool(torch.isfinite(init_mean).all()):
            raise ValueError("init_mean has non-finite entries")
        d = init_mean.shape[0]
        covs = {}
        for name, value in (("transition_cov", transition_cov), ("observation_cov", observation_cov), ("init_cov", init_cov)):
            value = torch.as_tensor(value, dtype=init_mean.dtype, device=init_mean.device) if not isinstance(value, Tensor) else value
            if value.dtype != init_mean.dtype or value.device != init_mean.device:
                raise ValueError(
                    f"{name} has dtype {value.dtype} on {value.device}, but the model's (init_mean's) is {init_mean.dtype} on "
                    f"{init_mean.device}: give every tensor of the model one dtype and device (e.g. {name}.to(init_mean))"
                )
            covs[name] = value
        for name, size in (("transition_cov", d), ("init_cov", d)):
            if tuple(covs[name].shape) != (size, size):
                raise ValueError(f"{name} must have shape ({size}, {size}) (init_mean has {size} entries), got {tuple(covs[name].shape)}")
        if covs["observation_cov"].dim() != 2:
            raise ValueError(f"observation_cov must have shape (e, e), got {tuple(covs['observation_cov'].shape)}")
        for name, value in covs.items():
            check_psd(name, value)
        self.transition = transition
        self.observation = observation
        for name, value in covs.items():
            self.register_buffer(name, value)
        self.register_buffer("init_mean", init_mean)
        self.transition_takes_time = _check_time_argument("transition", transition)
        self.observation_takes_time = _check_time_argument("observation", observation)
        e = covs["observation_cov"].shape[0]
        with torch.no_grad():
            for name, evaluate, size in (("transition", self.transition_mean_var, d), ("observation", self.observation_mean_var, e)):
                mean, _ = evaluate(init_mean, 0)
                if not isinstance(mean, Tensor):
                    raise ValueError(f"{name} must return a tensor, got {type(mean).__name__}")
                if name == "observation" and tuple(mean.shape) != (e,) and mean.dim() == 1:
                    # The map and observation_cov disagree on e; either may be the wrong one.
                    raise ValueError(
                        f"observation maps a state of shape ({d},) to shape {tuple(mean.shape)}, but observation_cov is "
                        f"{tuple(covs['observation_cov'].shape)}: the observation size e must agree (observation_cov ({mean.shape[0]}, "
                        f"{mean.shape[0]}) for this map)"
                    )
                if tuple(mean.shape) != (size,):
                    raise ValueError(f"{name} must map a state of shape ({d},) to shape ({size},), got {tuple(mean.shape)}")
                if mean.dtype != init_mean.dtype:
                    raise ValueError(f"{name} returns {mean.dtype} for a state of the model's dtype {init_mean.dtype}; it must keep the dtype")
                if not is_gp(getattr(self, name)):
                    _check_batched(name, evaluate, init_mean, size)
        self._t = 0

    @property
    def state_dim(self) -> int:
        """``d``, the length of ``init_mean``."""
        return self.init_mean.shape[0]

    @property
    def obs_dim(self) -> int:
        """``e``, the size of ``observation_cov``."""
        return self.observation_cov.shape[0]

    @property
    def transition_fn(self):
        """``f(x, t)`` (time always passed; an unmarked map ignores it) or the transition GP; what
        the projections take."""
        return self.transition if is_gp(self.transition) or self.transition_takes_time else _ignore_time(self.transition)

    @property
    def observation_fn(self):
        """``g(x, t)`` (time always passed; an unmarked map ignores it) or the observation GP; what
        the projections take."""
        return self.observation if is_gp(self.observation) or self.observation_takes_time else _ignore_time(self.observation)

    @staticmethod
    def _evaluate(fn, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        if is_gp(fn):
            return fn.predict(x)
        return fn(x, t), None

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """Mean of :math:`x_{t+1}` given :math:`x_t = x` ``(..., d)`` and the GP predictive variance (or ``None``)."""
        return self._evaluate(self.transition_fn, x, t)

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """Mean of :math:`y_t` given :math:`x_t = x` ``(..., e)`` and the GP predictive variance (or ``None``)."""
        return self._evaluate(self.observation_fn, x, t)

    # --- the SMC protocol -------------------------------------------------------------------
    def init(self, state: dict) -> None:
        """Starts a new sequence; the first :meth:`step` samples :math:`x_0` from the prior."""
        self._t = 0

    @staticmethod
    def _normal(mean: Tensor, cov: Tensor, var: Tensor | None) -> dist.MultivariateNormal:
        if var is None:
            return dist.MultivariateNormal(mean, covariance_matrix=cov)
        return dist.MultivariateNormal(mean, covariance_matrix=cov + torch.diag_embed(var))

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples :math:`x_t` (from the prior at :math:`t = 0`) and observes :math:`y_t`."""
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
