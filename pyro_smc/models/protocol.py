r"""The state-space-model protocols every engine reads, and the rule for missing observations.

See ``docs/math/smc.md#state-space-model-and-proposal`` and ``docs/math/ep.md#model``.

:class:`StateSpaceModel` is what :class:`~pyro_smc.SMC` and
:class:`~pyro_smc.OnlineVariationalFilter` run: a Pyro program in the ``init``/``step`` protocol
with its dimensions and a simulator. :class:`GaussianStateSpaceModel` adds what the Gaussian
engines (:class:`~pyro_smc.EPSmoother` and the Gaussian filters and smoothers) read, for

:math:`x_0 \sim \mathcal N(\mathtt{init\_mean}, \mathtt{init\_cov})`, :math:`x_{t+1} = f(x_t, t) + w_t`, :math:`w_t \sim \mathcal N(0, \mathtt{transition\_cov})`,
:math:`y_t = g(x_t, t) + v_t`, :math:`v_t \sim \mathcal N(0, \mathtt{observation\_cov})`, with :math:`t` the 0-based time index.

``transition_fn``/``observation_fn`` are what the projections
(:mod:`pyro_smc.infer.gaussian.projections`) take: either a callable ``fn(x, t)`` batched over the
leading dims of ``x`` (time is always passed; ``NonlinearGaussianSSM`` adapts a map not marked
:func:`~pyro_smc.models.time_dependent` once, when it is built, to ignore it), or a GP
posterior with exact moments (``predict``, ``predict_moments``, ``linearize``, as
:class:`pyro_smc.gp.MultiOutputGP`), whose predictive variance adds to the noise. ``transition_mean_var(x, t)``/``observation_mean_var(x, t)`` evaluate
the same maps pointwise as ``(mean, variance or None)``. Both protocols are
``runtime_checkable``: ``isinstance(model, GaussianStateSpaceModel)`` checks the members exist.

Missing observations follow one rule in every engine, written in :mod:`pyro_smc.observations`.

Example:
    >>> import torch
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> from pyro_smc.models.protocol import GaussianStateSpaceModel, StateSpaceModel
    >>> eye = torch.eye(2, dtype=torch.float64)
    >>> ssm = LinearGaussianSSM(
    ...     0.5 * eye, eye, eye, eye, torch.zeros(2, dtype=torch.float64), eye
    ... )
    >>> isinstance(ssm, StateSpaceModel), isinstance(ssm, GaussianStateSpaceModel)
    (True, True)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["GaussianStateSpaceModel", "StateSpaceModel", "check_noise_covariances", "require_gaussian_model"]


class _ModuleProtocolMeta(type(Protocol)):
    # Python >= 3.12 checks protocol members with inspect.getattr_static, which does not see a
    # torch module's buffers and parameters (served by Module.__getattr__); hasattr does.
    def __instancecheck__(cls, instance) -> bool:
        if not getattr(cls, "_is_protocol", False):
            return super().__instancecheck__(instance)
        members = {n for base in cls.__mro__ if getattr(base, "_is_protocol", False) and base is not Protocol for n in vars(base) if not n.startswith("_")}
        return all(hasattr(instance, name) for name in members)


@runtime_checkable
class StateSpaceModel(Protocol, metaclass=_ModuleProtocolMeta):
    """A state-space model in the ``init``/``step`` protocol.

    ``init(state)`` starts a sequence; ``step(state, y=None)`` samples the latent site
    ``f"x_{t}"`` given ``state["x"]`` (from the prior on the first step), stores it in ``state``
    and observes ``f"y_{t}"`` (``y=None``: sampled, a missing observation). ``simulate(T)``
    draws ``(xs (T, state_dim), ys (T, obs_dim))``.

    Example:
        The protocol is runtime-checkable, so a ready model passes ``isinstance``:

        >>> import torch
        >>> from pyro_smc.models import ChaoticRNN
        >>> from pyro_smc.models.protocol import StateSpaceModel
        >>> ssm = ChaoticRNN(state_dim=3, generator=torch.Generator().manual_seed(0))
        >>> isinstance(ssm, StateSpaceModel), isinstance(object(), StateSpaceModel)
        (True, False)
    """

    @property
    def state_dim(self) -> int:
        """``d``, the dimension of the latent state ``x_t``."""

    @property
    def obs_dim(self) -> int:
        """``e``, the dimension of an observation ``y_t``."""

    def init(self, state: dict) -> None:
        """Starts a new sequence (resets the step counter); samples nothing for the bootstrap models."""

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples ``x_t`` given ``state["x"]`` (from the prior at the first step) into ``state`` and observes ``y_t``; returns ``x_t``."""

    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws a sequence of ``num_steps``: ``(xs (T, d), ys (T, e))``."""


@runtime_checkable
class GaussianStateSpaceModel(StateSpaceModel, Protocol):
    """A :class:`StateSpaceModel` with additive Gaussian noise, in the form the Gaussian engines read.

    Attributes:
        init_mean: ``(d,)``.
        init_cov: ``(d, d)``.
        transition_cov: ``(d, d)``, the covariance of ``w_t``.
        observation_cov: ``(e, e)``, the covariance of ``v_t``.
        transition_fn: ``f(x, t)`` ``(..., d) -> (..., d)`` or a GP posterior.
        observation_fn: ``g(x, t)`` ``(..., d) -> (..., e)`` or a GP posterior.

    A callable that ignores ``t`` may say so with an attribute ``time_invariant = True``; the
    parallel EP schedule then evaluates it at every time step in one call instead of one call per
    step (``NonlinearGaussianSSM`` marks so each map not marked ``time_dependent``).

    Example:
        A linear-Gaussian model is one; a chaotic RNN with Student-t observations is not:

        >>> import torch
        >>> from pyro_smc.models import ChaoticRNN, LinearGaussianSSM
        >>> from pyro_smc.models.protocol import GaussianStateSpaceModel
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
        >>> (
        ...     isinstance(ssm, GaussianStateSpaceModel),
        ...     ssm.transition_fn(torch.ones(3, 2), 0).shape,
        ... )
        (True, torch.Size([3, 2]))
        >>> isinstance(ChaoticRNN(state_dim=2), GaussianStateSpaceModel)
        False
    """

    @property
    def init_mean(self) -> Tensor:
        """``(d,)`` the mean of ``x_0``."""

    @property
    def init_cov(self) -> Tensor:
        """``(d, d)`` the covariance of ``x_0``."""

    @property
    def transition_cov(self) -> Tensor:
        """``(d, d)`` the covariance of the transition noise ``w_t``."""

    @property
    def observation_cov(self) -> Tensor:
        """``(e, e)`` the covariance of the observation noise ``v_t``."""

    @property
    def transition_fn(self):
        """``f(x, t)``, ``(..., d) -> (..., d)``, or a GP posterior."""

    @property
    def observation_fn(self):
        """``g(x, t)``, ``(..., d) -> (..., e)``, or a GP posterior."""

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """The mean of ``x_{t+1}`` given ``x_t = x`` ``(..., d)`` and a GP map's predictive variance (``None`` for a plain function)."""

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """The mean of ``y_t`` given ``x_t = x`` ``(..., e)`` and a GP map's predictive variance (``None`` for a plain function)."""


_GAUSSIAN_MEMBERS = ("state_dim", "obs_dim", "init_mean", "init_cov", "transition_fn", "transition_cov", "observation_fn", "observation_cov")


def require_gaussian_model(ssm: object, engine: str) -> None:
    """Raises a ``TypeError`` naming ``engine`` and what ``ssm`` lacks unless it has the members
    of :class:`GaussianStateSpaceModel` (a Pyro ``init``/``step`` program has none of them).

    Example:
        >>> class RW:
        ...     def init(self, state): ...
        ...     def step(self, state, y): ...
        >>> try:
        ...     require_gaussian_model(RW(), "EPSmoother")
        ... except TypeError as error:
        ...     print(str(error)[:61])
        EPSmoother needs a GaussianStateSpaceModel (additive Gaussian
    """
    missing = [name for name in _GAUSSIAN_MEMBERS if not hasattr(ssm, name)]
    if missing:
        raise TypeError(
            f"{engine} needs a GaussianStateSpaceModel (additive Gaussian noise, written as its maps and covariances: "
            f"NonlinearGaussianSSM, LinearGaussianSSM), got a {type(ssm).__name__} without {', '.join(missing)}; "
            "a model written as a Pyro init/step program runs on SMC (or OnlineVariationalFilter) instead"
        )


def check_noise_covariances(ssm: GaussianStateSpaceModel, engine: str) -> None:
    """Raises a ``ValueError`` naming ``engine`` and the attribute unless ``init_cov``,
    ``transition_cov`` and ``observation_cov`` are symmetric positive semi-definite, as they are
    at the call (a covariance assigned after construction is checked here, where the model's
    constructor cannot: a ``transition_cov`` with a negative eigenvalue in a direction the
    observations do not see gave the extended smoothers negative variances and a finite
    log-evidence, silently).

    Example:
        >>> import torch
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = NonlinearGaussianSSM(lambda x: x, eye, lambda x: x, eye, torch.zeros(2), eye)
        >>> ssm.transition_cov = torch.diag(torch.tensor([1.0, -0.1]))
        >>> try:
        ...     check_noise_covariances(ssm, "extended_rts_smoother")
        ... except ValueError as error:
        ...     print(str(error)[:58])
        extended_rts_smoother: transition_cov must be positive sem
    """
    from pyro_smc.ops.gaussian import check_psd

    for name in ("init_cov", "transition_cov", "observation_cov"):
        value = getattr(ssm, name)
        if isinstance(value, Tensor):
            try:
                check_psd(name, value, strict=False)
            except ValueError as error:
                raise ValueError(f"{engine}: {error}") from None
