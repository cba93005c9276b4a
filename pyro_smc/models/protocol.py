r"""The state-space-model protocols every engine reads, and the rule for missing observations.

See ``docs/math/smc.md#state-space-model-and-proposal`` and ``docs/math/ep.md#model``.

:class:`StateSpaceModel` is what :class:`~pyro_smc.SMC` and
:class:`~pyro_smc.OnlineVariationalFilter` run: a Pyro program in the ``init``/``step`` protocol
with its dimensions and a simulator. :class:`GaussianStateSpaceModel` adds what the Gaussian
engines (:class:`~pyro_smc.EPSmoother` and the Gaussian filters and smoothers) read, for

``x_0 ~ N(init_mean, init_cov)``, ``x_{t+1} = f(x_t, t) + w_t``, ``w_t ~ N(0, transition_cov)``,
``y_t = g(x_t, t) + v_t``, ``v_t ~ N(0, observation_cov)``, with ``t`` the 0-based time index.

``transition_fn``/``observation_fn`` are what the projections
(:mod:`pyro_smc.infer.projections`) take: either a callable ``fn(x, t)`` batched over the
leading dims of ``x`` (time is always passed; ``NonlinearGaussianSSM`` adapts a map not marked
:func:`~pyro_smc.models.time_dependent` once, when it is built, to ignore it), or a GP
posterior with exact moments (``predict``, ``predict_moments``, ``linearize``, as
:class:`pyro_smc.gp.MultiOutputGP`), whose predictive variance adds to the noise. ``transition_mean_var(x, t)``/``observation_mean_var(x, t)`` evaluate
the same maps pointwise as ``(mean, variance or None)``. Both protocols are
``runtime_checkable``: ``isinstance(model, GaussianStateSpaceModel)`` checks the members exist.

Missing observations (one rule for every engine). At step ``t``:

* an observation that is ``None``, or a tensor whose entries are all NaN, is missing: the engine
  predicts and does not update, and the step adds nothing to the log-evidence;
* a vector observation with some NaN entries: the Gaussian engines (and ``ops.kalman``) condition
  on the observed entries only, with the exact Gaussian marginal of those entries (the rows of the
  observation map and the block of the noise covariance that belong to them);
* ``inf`` anywhere is an error naming the time step.

Example:
    >>> import torch
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> from pyro_smc.models.protocol import GaussianStateSpaceModel, StateSpaceModel
    >>> eye = torch.eye(2, dtype=torch.float64)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2, dtype=torch.float64), eye)
    >>> isinstance(ssm, StateSpaceModel), isinstance(ssm, GaussianStateSpaceModel)
    (True, True)
    >>> ys, observed = check_observations([torch.ones(2, dtype=torch.float64), None], 2, like=eye)
    >>> observed.tolist()
    [[True, True], [False, False]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["GaussianStateSpaceModel", "StateSpaceModel", "check_observations"]


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
    def state_dim(self) -> int: ...

    @property
    def obs_dim(self) -> int: ...

    def init(self, state: dict) -> None: ...

    def step(self, state: dict, y: Tensor | None = None) -> Tensor: ...

    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]: ...


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
        >>> isinstance(ssm, GaussianStateSpaceModel), ssm.transition_fn(torch.ones(3, 2), 0).shape
        (True, torch.Size([3, 2]))
        >>> isinstance(ChaoticRNN(state_dim=2), GaussianStateSpaceModel)
        False
    """

    @property
    def init_mean(self) -> Tensor: ...

    @property
    def init_cov(self) -> Tensor: ...

    @property
    def transition_cov(self) -> Tensor: ...

    @property
    def observation_cov(self) -> Tensor: ...

    @property
    def transition_fn(self): ...

    @property
    def observation_fn(self): ...

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]: ...

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, Tensor | None]: ...


def check_observations(observations: Tensor | Sequence[Tensor | None], obs_dim: int, like: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Validates observations and marks the observed entries (the rule in the module docstring).

    Args:
        observations: ``(T, e)`` (or ``(T,)`` when ``e = 1``) with NaN for missing entries, or a
            sequence of ``T`` tensors ``(e,)`` or ``None``; ``T >= 1``.
        obs_dim: ``e``.
        like: a tensor of the model (its ``init_mean``): the observations must have its dtype and
            device, and a sequence's missing steps take them (otherwise the first tensor's).

    Returns:
        ``(observations (T, e), observed (T, e) bool)``.

    Raises:
        ValueError: wrong type or shape, no time step, a dtype or device other than ``like``'s, or
            an ``inf`` (naming the first time step with one).
    """
    if not isinstance(observations, Tensor):
        if not isinstance(observations, Sequence):
            raise ValueError(f"observations must be a tensor of shape (T, {obs_dim}) or a sequence of tensors and None, got {type(observations).__name__}")
        ref = next((y for y in observations if isinstance(y, Tensor)), like)
        if ref is None:
            raise ValueError("observations: a sequence of only None needs like= for its dtype and device")
        missing = torch.full((obs_dim,), float("nan"), dtype=ref.dtype, device=ref.device)
        rows = []
        for t, y in enumerate(observations):
            if y is not None and not isinstance(y, Tensor):
                raise ValueError(f"observations[{t}] must be a tensor or None, got {type(y).__name__}")
            rows.append(missing if y is None else y.reshape(-1))
            if rows[-1].shape != missing.shape:
                raise ValueError(f"observations[{t}] must have shape ({obs_dim},), got {tuple(y.shape)}")
            if rows[-1].dtype != missing.dtype:
                raise ValueError(f"observations[{t}] has dtype {rows[-1].dtype}, the others {missing.dtype}: give every step one dtype")
        observations = torch.stack(rows) if rows else missing.new_zeros(0, obs_dim)
    if observations.dim() == 1 and obs_dim == 1:
        observations = observations.unsqueeze(-1)
    if observations.dim() != 2 or observations.shape[-1] != obs_dim:
        raise ValueError(f"observations must have shape (T, {obs_dim}), got {tuple(observations.shape)}")
    if observations.shape[0] == 0:
        raise ValueError(f"observations must have at least one time step, got shape {tuple(observations.shape)}")
    if like is not None and (observations.dtype != like.dtype or observations.device != like.device):
        raise ValueError(
            f"observations have dtype {observations.dtype} on {observations.device}, but the model's tensors are {like.dtype} on "
            f"{like.device}: convert the data, observations.to({like.dtype}) (or .to(ssm.init_mean) for dtype and device), or build the model in {observations.dtype}"
        )
    bad = torch.isinf(observations).any(-1)
    if bool(bad.any()):
        raise ValueError(f"observations contain inf at time step {int(bad.nonzero()[0, 0])} (use NaN for a missing measurement)")
    return observations, ~torch.isnan(observations)
