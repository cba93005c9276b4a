r"""The chaotic recurrent neural network of Campbell et al. (2021), with Student-t observations.

.. math::

    x_t &= x_{t-1} + (\Delta / \tau) (-x_{t-1} + \gamma W \tanh(x_{t-1})) + \mathcal N(0, q^2 I), \\
    y_t &= x_t + \operatorname{StudentT}(\nu, 0, r) \text{ per coordinate},

a discretised continuous-time RNN in its chaotic regime (:math:`\gamma = 2.5`), :math:`W_{ij} \sim \mathcal N(0, 1/d)`;
the paper's setting is :math:`d = 5`, :math:`\Delta = 0.001`, :math:`\tau = 0.025`, :math:`q = 0.1`, :math:`r = 0.1`,
:math:`\nu = 2` (``df``; the authors' configuration), :math:`x_1 \sim \mathcal N(0, I)`. ``step`` follows the ``init``/``step``
protocol of :class:`~pyro_smc.SMC` and :class:`~pyro_smc.OnlineVariationalFilter` (the model is a
:class:`~pyro_smc.models.protocol.StateSpaceModel`, not a Gaussian one);
:meth:`ChaoticRNN.as_nonlinear_gaussian` gives the same dynamics with a Gaussian observation
surrogate for the EKF/UKF/EP baselines (a ``df = 2`` Student-t has no variance).

Example:
    >>> import torch
    >>> from pyro_smc.models import ChaoticRNN
    >>> rnn = ChaoticRNN(generator=torch.Generator().manual_seed(0))
    >>> xs, ys = rnn.simulate(100, generator=torch.Generator().manual_seed(1))
    >>> xs.shape, ys.shape
    (torch.Size([100, 5]), torch.Size([100, 5]))
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import Tensor

from pyro_smc.models.nonlinear_gaussian import NonlinearGaussianSSM

__all__ = ["ChaoticRNN"]


def _t_upper_quartile(df: float) -> float:
    """The 0.75 quantile of a standard Student-t (closed forms for df = 1, 2; scipy otherwise)."""
    if df == 1:
        return 1.0
    if df == 2:
        return 0.5 / math.sqrt(0.375)  # (2p - 1) / sqrt(2 p (1 - p)) at p = 0.75
    try:
        from scipy.stats import t
    except ImportError as error:
        raise ValueError(f"observation_sd is needed for df={df} without scipy") from error
    return float(t.ppf(0.75, df))


class ChaoticRNN(PyroModule):
    """Chaotic RNN state-space model with Student-t observation noise.

    Args:
        state_dim: state (and observation) dimension ``d``.
        delta: time step ``Delta``.
        tau: time constant ``tau``.
        gamma: gain ``gamma`` (chaotic above 1).
        transition_scale: ``q``, the standard deviation of the transition noise.
        observation_scale: ``r``, the Student-t scale.
        observation_df: Student-t degrees of freedom.
        weight: the ``(d, d)`` recurrent matrix; drawn as ``N(0, 1/d)`` from ``generator`` if ``None``.
        generator: random generator for ``weight``.

    Raises:
        ValueError: ``state_dim`` is not a positive int, a scale or ``observation_df`` is not
            positive, or ``weight`` is not ``(d, d)``.

    Example:
        >>> import torch
        >>> from pyro_smc.models import ChaoticRNN
        >>> ssm = ChaoticRNN(state_dim=3, generator=torch.Generator().manual_seed(0))
        >>> ssm.weight.shape                                          # (d, d)
        torch.Size([3, 3])
        >>> xs, ys = ssm.simulate(5, generator=torch.Generator().manual_seed(1))
        >>> xs.shape, ys.shape                                        # (T, d), (T, d)
        (torch.Size([5, 3]), torch.Size([5, 3]))
    """

    def __init__(
        self,
        state_dim: int = 5,
        delta: float = 0.001,
        tau: float = 0.025,
        gamma: float = 2.5,
        transition_scale: float = 0.1,
        observation_scale: float = 0.1,
        observation_df: float = 2.0,
        weight: Tensor | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if not isinstance(state_dim, int) or state_dim < 1:
            raise ValueError(f"state_dim must be a positive int, got {state_dim!r}")
        dim = state_dim
        for name, value in (("delta", delta), ("tau", tau), ("transition_scale", transition_scale), ("observation_scale", observation_scale), ("observation_df", observation_df)):
            if not float(value) > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if weight is None:
            weight = torch.randn(dim, dim, generator=generator) / math.sqrt(dim)
        if tuple(weight.shape) != (dim, dim):
            raise ValueError(f"weight must have shape ({dim}, {dim}), got {tuple(weight.shape)}")
        self.register_buffer("weight", weight)
        self.state_dim, self.delta, self.tau, self.gamma = dim, float(delta), float(tau), float(gamma)
        self.transition_scale, self.observation_scale, self.observation_df = float(transition_scale), float(observation_scale), float(observation_df)
        self._t = 0

    @property
    def obs_dim(self) -> int:
        """``e``, the dimension of an observation (the state's: every coordinate is observed)."""
        return self.state_dim

    def transition_mean(self, x: Tensor) -> Tensor:
        """``x + (Delta / tau)(-x + gamma W tanh(x))`` for ``x`` of shape ``(..., d)``."""
        return x + (self.delta / self.tau) * (-x + self.gamma * torch.tanh(x) @ self.weight.T)

    def init(self, state: dict) -> None:
        """Starts a new sequence; the first :meth:`step` samples ``x_0`` from the prior."""
        self._t = 0

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples ``x_t`` (from ``N(0, I)`` at ``t = 0``) and observes ``y_t`` with Student-t noise."""
        t = self._t
        zero = torch.zeros(self.state_dim, dtype=self.weight.dtype, device=self.weight.device)
        if "x" in state:
            prior = dist.Normal(self.transition_mean(state["x"]), self.transition_scale).to_event(1)
        else:
            prior = dist.Normal(zero, 1.0).to_event(1)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        return pyro.sample(f"y_{t}", dist.StudentT(self.observation_df, x, self.observation_scale).to_event(1), obs=y)

    @torch.no_grad()
    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws ``(xs, ys)`` of shapes ``(T, d)``."""
        w = self.weight
        xs, ys = [], []
        x = torch.randn(self.state_dim, generator=generator, dtype=w.dtype, device=w.device)
        for t in range(num_steps):
            if t > 0:
                x = self.transition_mean(x) + self.transition_scale * torch.randn(self.state_dim, generator=generator, dtype=w.dtype, device=w.device)
            xs.append(x)
            # Student-t as a Gaussian scale mixture, so the generator controls every draw.
            g = torch._standard_gamma(torch.full((self.state_dim,), self.observation_df / 2, dtype=w.dtype, device=w.device), generator=generator)
            noise = torch.randn(self.state_dim, generator=generator, dtype=w.dtype, device=w.device) * torch.sqrt(self.observation_df / (2 * g))
            ys.append(x + self.observation_scale * noise)
        return torch.stack(xs), torch.stack(ys)

    def as_nonlinear_gaussian(self, observation_sd: float | None = None) -> NonlinearGaussianSSM:
        r"""The same dynamics with Gaussian observation noise of standard deviation ``observation_sd``.

        The default matches the Student-t's interquartile range (a ``df = 2`` t has infinite variance):
        :math:`\mathrm{sd} = r \, t_{0.75}(\nu) / z_{0.75}` (:math:`t_{0.75}(\nu)`, :math:`z_{0.75}` the upper quartiles of the t with :math:`\nu` = ``df``
        degrees of freedom and of the normal).
        """
        if observation_sd is None:
            observation_sd = self.observation_scale * _t_upper_quartile(self.observation_df) / 0.6744897501960817
        w = self.weight
        eye = torch.eye(self.state_dim, dtype=w.dtype, device=w.device)
        return NonlinearGaussianSSM(
            self.transition_mean, self.transition_scale**2 * eye, lambda x: x, observation_sd**2 * eye, torch.zeros(self.state_dim, dtype=w.dtype, device=w.device), eye
        )
