r"""The Lorenz-96 model as a nonlinear Gaussian state-space model, in Kamthe et al.'s setting.

The Lorenz-96 system on a ring of :math:`d` sites, indices taken modulo :math:`d`, is

.. math::

    \frac{\mathrm d x_i}{\mathrm d t} = (x_{i+1} - x_{i-2}) \, x_{i-1} - x_i + F.

The quadratic (advection) term moves energy around the ring without changing
:math:`\tfrac12 \lVert x \rVert^2`, the linear term damps it and the forcing :math:`F` feeds it;
for :math:`F = 8` the flow is chaotic. One transition is one classical fourth-order
Runge-Kutta step of length :math:`\Delta t` (local error :math:`O(\Delta t^5)`), plus Gaussian
noise, and each site is observed through :math:`h`:

.. math::

    x_{t+1} = \mathrm{RK4}_{\Delta t}(x_t) + w_t, \quad w_t \sim \mathcal N(0, q I), \qquad
    y_t = h(x_t) + v_t, \quad v_t \sim \mathcal N(0, r I),

with :math:`h(x) = x^2` entrywise (``observation="square"``: the sign of each site is not
observed, only the dynamics can tell it) or :math:`h(x) = x` (``"identity"``). The defaults are
the setting of Kamthe, Takao, Mohamed and Deisenroth (TMLR 2022): :math:`F = 8`,
:math:`\Delta t = 0.05`, :math:`q = 0.1`, :math:`r = 1`, squared observations, and
:math:`x_0 \sim \mathcal N(\bar x, I)` with :math:`\bar x` a point on the attractor reached from
:math:`F \mathbf 1 + 0.01 e_1` by 999 steps of the integrator (:func:`lorenz96_spin_up`).

:class:`Lorenz96SSM` is a :class:`~pyro_smc.models.NonlinearGaussianSSM`, so the Gaussian engines
(:class:`~pyro_smc.EPSmoother`, the Gaussian filters and smoothers) and :class:`~pyro_smc.SMC`
take it as it is.

Example:
    >>> import torch
    >>> from pyro_smc.models.lorenz96 import Lorenz96SSM
    >>> ssm = Lorenz96SSM(state_dim=40)
    >>> xs, ys = ssm.simulate(50, generator=torch.Generator().manual_seed(0))
    >>> xs.shape, ys.shape
    (torch.Size([50, 40]), torch.Size([50, 40]))
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pyro_smc.models.nonlinear_gaussian import NonlinearGaussianSSM

__all__ = ["Lorenz96SSM", "lorenz96_drift", "lorenz96_rk4", "lorenz96_spin_up"]

OBSERVATIONS = ("square", "identity")


def lorenz96_drift(x: Tensor, forcing: float = 8.0) -> Tensor:
    r"""The Lorenz-96 vector field :math:`(x_{i+1} - x_{i-2}) x_{i-1} - x_i + F` (indices mod ``d``).

    Args:
        x: ``(..., d)`` states, ``d >= 4`` sites on a ring (the last axis).
        forcing: :math:`F`.

    Returns:
        ``(..., d)``, the time derivative at ``x``.

    Example:
        The uniform state :math:`F \mathbf 1` is an equilibrium:

        >>> import torch
        >>> lorenz96_drift(torch.full((5,), 8.0))
        tensor([0., 0., 0., 0., 0.])
    """
    ahead, behind, two_behind = x.roll(-1, -1), x.roll(1, -1), x.roll(2, -1)
    return (ahead - two_behind) * behind - x + forcing


def lorenz96_rk4(x: Tensor, dt: float = 0.05, forcing: float = 8.0) -> Tensor:
    r"""One classical Runge-Kutta step of length ``dt`` of the Lorenz-96 flow.

    Args:
        x: ``(..., d)`` states (batched over the leading dims).
        dt: the step :math:`\Delta t`.
        forcing: :math:`F`.

    Returns:
        ``(..., d)``, :math:`x + \tfrac{\Delta t}{6} (k_1 + 2 k_2 + 2 k_3 + k_4)`.

    Example:
        >>> import torch
        >>> x = torch.full((2, 6), 8.0)
        >>> torch.equal(lorenz96_rk4(x), x)             # the equilibrium does not move
        True
    """
    k1 = lorenz96_drift(x, forcing)
    k2 = lorenz96_drift(x + dt / 2 * k1, forcing)
    k3 = lorenz96_drift(x + dt / 2 * k2, forcing)
    k4 = lorenz96_drift(x + dt * k3, forcing)
    return x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def lorenz96_spin_up(
    state_dim: int, forcing: float = 8.0, dt: float = 0.05, steps: int = 999, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Tensor:
    r"""A point on the attractor: :math:`F \mathbf 1 + 0.01 e_1` (the equilibrium, its first site
    nudged) run ``steps`` noise-free steps of :func:`lorenz96_rk4`, as Kamthe et al. make theirs.

    The flow is chaotic, so rounding differences grow over the ~50 time units: the point depends
    on the dtype (and may on the platform), though each is a point on the attractor. Pass
    ``init_mean`` to :class:`Lorenz96SSM` to pin it.

    Args:
        state_dim: ``d``.
        forcing, dt: as in :func:`lorenz96_rk4`.
        steps: the number of integrator steps.
        dtype, device: of the result (default: torch's default dtype, the CPU).

    Returns:
        ``(d,)``.

    Example:
        >>> x0 = lorenz96_spin_up(40)
        >>> x0.shape, bool((x0 - 8.0).abs().max() > 1.0)   # far from the equilibrium
        (torch.Size([40]), True)
    """
    x = torch.full((int(state_dim),), float(forcing), dtype=dtype, device=device)
    x[0] += 0.01
    for _ in range(int(steps)):
        x = lorenz96_rk4(x, dt, forcing)
    return x


def _square(x: Tensor) -> Tensor:
    return x * x


def _identity(x: Tensor) -> Tensor:
    return x


def _fixed_when_built(name: str, doc: str) -> property:
    """A read-only property over ``_<name>`` whose setter names the remedy."""

    def refuse(self, value: float) -> None:
        raise AttributeError(
            f"Lorenz96SSM.{name} is fixed when the model is built (the transition uses it); build Lorenz96SSM(..., {name}={value!r}) instead"
        )

    return property(lambda self: getattr(self, f"_{name}"), refuse, doc=doc)


class Lorenz96SSM(NonlinearGaussianSSM):
    r"""Lorenz-96 with additive Gaussian noise (the setting of Kamthe et al. by default).

    Args:
        state_dim: the number of sites ``d`` (``>= 4``); the observation has ``d`` entries too.
        forcing: :math:`F`.
        dt: the Runge-Kutta step :math:`\Delta t` of one transition.
        transition_var: :math:`q`, the variance of each entry of :math:`w_t`.
        observation: ``"square"`` (:math:`h(x) = x^2`) or ``"identity"``.
        observation_var: :math:`r`, the variance of each entry of :math:`v_t`.
        init_mean: ``(d,)`` the mean of :math:`x_0`; ``None``: :func:`lorenz96_spin_up`.
        init_var: the variance of each entry of :math:`x_0`.
        dtype, device: of the model's tensors when ``init_mean`` is ``None`` (default: torch's
            default dtype, the CPU); otherwise ``init_mean``'s.

    Raises:
        ValueError: ``state_dim < 4``, an unknown ``observation``, a ``dt``, ``transition_var``,
            ``observation_var`` or ``init_var`` that is not a positive finite number, or an
            ``init_mean`` that is not of shape ``(d,)``.

    Example:
        The model is a Gaussian state-space model, so the Gaussian engines take it:

        >>> import torch
        >>> from pyro_smc.infer import unscented_rts_smoother
        >>> from pyro_smc.models.lorenz96 import Lorenz96SSM
        >>> ssm = Lorenz96SSM(state_dim=8, dtype=torch.float64)
        >>> xs, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))
        >>> out = unscented_rts_smoother(ssm, ys)
        >>> out.means.shape, ssm.forcing, ssm.observation_kind
        (torch.Size([10, 8]), 8.0, 'square')
    """

    def __init__(
        self,
        state_dim: int = 40,
        forcing: float = 8.0,
        dt: float = 0.05,
        transition_var: float = 0.1,
        observation: str = "square",
        observation_var: float = 1.0,
        init_mean: Tensor | None = None,
        init_var: float = 1.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        if int(state_dim) != state_dim or state_dim < 4:
            raise ValueError(f"state_dim must be an integer >= 4 (the drift couples sites i-2, i-1, i, i+1), got {state_dim!r}")
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
        for name, value in (("dt", dt), ("transition_var", transition_var), ("observation_var", observation_var), ("init_var", init_var)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        d = int(state_dim)
        if init_mean is None:
            init_mean = lorenz96_spin_up(d, forcing, dt, dtype=dtype, device=device)
        elif tuple(init_mean.shape) != (d,):
            raise ValueError(f"init_mean must have shape ({d},) (state_dim), got {tuple(init_mean.shape)}")
        eye = torch.eye(d, dtype=init_mean.dtype, device=init_mean.device)
        super().__init__(
            functools.partial(lorenz96_rk4, dt=float(dt), forcing=float(forcing)),
            float(transition_var) * eye,
            _square if observation == "square" else _identity,
            float(observation_var) * eye,
            init_mean,
            float(init_var) * eye,
        )
        self._forcing, self._dt, self.observation_kind = float(forcing), float(dt), observation

    # Read-only: the transition was built from them (and the default initial mean spun up with
    # them), so assigning one used to change nothing and say nothing.
    forcing = _fixed_when_built("forcing", ":math:`F`, as built; read-only (build a new model for another forcing).")
    dt = _fixed_when_built("dt", "The RK4 step, as built; read-only (build a new model for another step).")
