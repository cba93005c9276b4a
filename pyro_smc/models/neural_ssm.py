r"""A deep state-space model and an amortised proposal for it, learned with ``SMCELBO``.

See ``docs/math/smc.md#a-neural-state-space-model``.

The model :class:`NeuralSSM` has a residual neural-network transition and a linear (or identity)
emission, with learned diagonal noise scales::

    x_0 ~ N(0, s_0^2 I)
    x_t = x_{t-1} + MLP_theta(x_{t-1}) + diag(q) eps_t,        eps_t ~ N(0, I)
    y_t = W x_t + b + diag(r) nu_t,                            nu_t ~ N(0, I)

and the proposal :class:`NeuralProposal` is a diagonal Gaussian whose mean and scale are a neural
network of the previous state and the new observation::

    q_phi(x_t | x_{t-1}, y_t) = N(x_{t-1} + m_phi(x_{t-1}, y_t), diag(softplus(s_phi(x_{t-1}, y_t))^2))

with ``x_{-1} = 0`` and an indicator input at ``t = 0``. Both are ``PyroModule``s: every weight
and scale is a Pyro parameter, so ``SVI(model, proposal, Adam(...), SMCELBO(...))`` trains both.
Each network's last layer starts at zero, so an untrained model is a Gaussian random walk and
an untrained proposal is a random walk with scale ``proposal_scale``.

Since the emission is linear-Gaussian, the model's *locally optimal* proposal
:math:`p(x_t \mid x_{t-1}, y_t)` is Gaussian in closed form: :class:`LocallyOptimalProposal` draws from it
(a fully adapted filter, whose weights do not depend on the new state). It has no parameters of
its own: it is the yardstick for a learned proposal and the low-variance way to estimate a
trained model's evidence.

All three follow the ``init``/``step`` protocol of :class:`~pyro_smc.SMC` and broadcast against the
particles, so a batch of sequences ``(B, T, dy)`` runs with ``run(..., batched=True)``.

Example:
    >>> import torch
    >>> from pyro_smc import SMC
    >>> from pyro_smc.models import NeuralProposal, NeuralSSM
    >>> model = NeuralSSM(state_dim=2, obs_dim=3)
    >>> xs, ys = model.simulate(10, generator=torch.Generator().manual_seed(0))
    >>> xs.shape, ys.shape
    (torch.Size([10, 2]), torch.Size([10, 3]))
    >>> smc = SMC(model, NeuralProposal(model), num_particles=50).run(ys)
    >>> smc.log_evidence.shape
    torch.Size([1])
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule, PyroParam
from pyro.nn.module import to_pyro_module_
from torch import Tensor, nn
from torch.distributions import constraints

__all__ = ["LocallyOptimalProposal", "NeuralProposal", "NeuralSSM"]

_EMISSIONS = ("linear", "identity")


def _mlp(in_dim: int, hidden_dim: int, out_dim: int) -> PyroModule:
    """``in -> hidden -> hidden -> out`` with tanh, the last layer zero (an untrained net outputs 0)."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, out_dim))
    nn.init.zeros_(net[-1].weight)
    nn.init.zeros_(net[-1].bias)
    to_pyro_module_(net)
    return net


def _check_dim(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_scale(name: str, value) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class NeuralSSM(PyroModule):
    """Residual neural-network transition, linear emission, learned diagonal noise.

    Args:
        state_dim: ``d``.
        obs_dim: ``e`` (default ``d``).
        hidden_dim: width of the transition network's two hidden layers.
        emission: ``"linear"`` (learned ``W`` ``(e, d)`` and ``b``; ``W`` starts as the first ``e``
            rows of a random orthogonal matrix, padded with zeros when ``e > d``) or
            ``"identity"`` (``y_t = x_t + noise``, needs ``e == d``; the latent space is then
            identified, so the learned vector field can be compared with the truth).
        init_scale: ``s_0``, fixed.
        transition_scale: initial ``q`` (learned, per coordinate).
        observation_scale: initial ``r`` (learned, per coordinate).

    Raises:
        ValueError: a non-positive dimension or scale, an unknown ``emission``, or ``"identity"``
            with ``obs_dim != state_dim``.

    Example:
        >>> import torch
        >>> from pyro_smc.models import NeuralSSM
        >>> _ = torch.manual_seed(0)
        >>> ssm = NeuralSSM(state_dim=2, obs_dim=3, hidden_dim=8)
        >>> xs, ys = ssm.simulate(5)                                  # (T, d), (T, e)
        >>> xs.shape, ys.shape
        (torch.Size([5, 2]), torch.Size([5, 3]))
    """

    def __init__(
        self,
        state_dim: int,
        obs_dim: int | None = None,
        hidden_dim: int = 32,
        emission: str = "linear",
        init_scale: float = 1.0,
        transition_scale: float = 0.5,
        observation_scale: float = 0.5,
    ):
        super().__init__()
        d = _check_dim("state_dim", state_dim)
        e = d if obs_dim is None else _check_dim("obs_dim", obs_dim)
        if emission not in _EMISSIONS:
            raise ValueError(f"emission must be one of {_EMISSIONS}, got {emission!r}")
        if emission == "identity" and e != d:
            raise ValueError(f"emission='identity' needs obs_dim == state_dim, got obs_dim={e}, state_dim={d}")
        self.state_dim, self.obs_dim, self.emission = d, e, emission
        self.init_scale = _check_scale("init_scale", init_scale)
        self.transition_net = _mlp(d, _check_dim("hidden_dim", hidden_dim), d)
        self.transition_scale = PyroParam(torch.full((d,), _check_scale("transition_scale", transition_scale)), constraint=constraints.positive)
        self.observation_scale = PyroParam(torch.full((e,), _check_scale("observation_scale", observation_scale)), constraint=constraints.positive)
        if emission == "linear":
            # An orthogonal start keeps every latent direction visible in y.
            basis = torch.linalg.qr(torch.randn(max(d, e), max(d, e)))[0]
            self.emission_weight = nn.Parameter(basis[:e, :d].contiguous())
            self.emission_bias = nn.Parameter(torch.zeros(e))
        self._t = 0

    def transition_mean(self, x: Tensor) -> Tensor:
        """``x + MLP(x)`` for ``x`` of shape ``(..., d)``."""
        return x + self.transition_net(x)

    def observation_mean(self, x: Tensor) -> Tensor:
        """``W x + b`` (or ``x``) for ``x`` of shape ``(..., d)``."""
        if self.emission == "identity":
            return x
        return x @ self.emission_weight.T + self.emission_bias

    def init(self, state: dict) -> None:
        r"""Starts a sequence; the first :meth:`step` draws :math:`x_0` from :math:`\mathcal N(0, s_0^2 I)`."""
        self._t = 0

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Draws ``x_t`` given ``state["x"]`` and observes ``y_t`` (``(..., e)``, broadcasting
        against the particles)."""
        t = self._t
        if "x" in state:
            prior = dist.Normal(self.transition_mean(state["x"]), self.transition_scale).to_event(1)
        else:
            scale = self.transition_scale
            prior = dist.Normal(torch.zeros_like(scale), torch.full_like(scale, self.init_scale)).to_event(1)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        # Checked on the handler path; a compiled step's recording (whose shapes are traced values,
        # and whose later steps have this step's shapes) skips it.
        if y is not None and not torch.jit.is_tracing() and y.shape[-1:] != (self.obs_dim,):
            raise ValueError(f"observation y_{t} has shape {tuple(y.shape)}, but the model observes vectors of size {self.obs_dim}")
        return pyro.sample(f"y_{t}", dist.Normal(self.observation_mean(x), self.observation_scale).to_event(1), obs=y)

    @torch.no_grad()
    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws ``(xs, ys)`` of shapes ``(T, d)`` and ``(T, e)`` from the model."""
        _check_dim("num_steps", num_steps)
        q, r = self.transition_scale, self.observation_scale
        x = self.init_scale * torch.randn(self.state_dim, generator=generator, dtype=q.dtype)
        xs, ys = [], []
        for t in range(num_steps):
            if t > 0:
                x = self.transition_mean(x) + q * torch.randn(self.state_dim, generator=generator, dtype=q.dtype)
            xs.append(x)
            ys.append(self.observation_mean(x) + r * torch.randn(self.obs_dim, generator=generator, dtype=r.dtype))
        return torch.stack(xs), torch.stack(ys)


class NeuralProposal(PyroModule):
    r"""Amortised Gaussian proposal :math:`q_\phi(x_t \mid x_{t-1}, y_t)` for a :class:`NeuralSSM`.

    It reads ``state["x"]`` (``x_{t-1}``; zero at ``t = 0``) and the observation, and samples the
    model's ``x_t`` site. It depends on the model only through its dimensions, so its parameters
    (``phi``) and the model's (``theta``) are separate Pyro parameters.

    Args:
        model: the :class:`NeuralSSM` it proposes for (its ``state_dim`` and ``obs_dim``).
        hidden_dim: width of the network's two hidden layers.
        proposal_scale: the untrained proposal's standard deviation.

    Raises:
        ValueError: a non-positive ``hidden_dim`` or ``proposal_scale``.

    Example:
        The proposal in a particle filter: :math:`\log \hat Z` reaches its parameters.

        >>> import torch
        >>> from pyro_smc import SMC
        >>> from pyro_smc.models import NeuralProposal, NeuralSSM
        >>> _ = torch.manual_seed(0)
        >>> ssm = NeuralSSM(state_dim=2, obs_dim=3, hidden_dim=8)
        >>> proposal = NeuralProposal(ssm, hidden_dim=8)
        >>> _, ys = ssm.simulate(5)                                   # (T, e)
        >>> log_z = SMC(ssm, proposal, num_particles=10).run(ys).log_evidence
        >>> log_z.shape                                               # (num_filters,)
        torch.Size([1])
        >>> log_z.sum().backward()
        >>> all(p.grad is not None for p in proposal.parameters())
        True
    """

    def __init__(self, model: NeuralSSM, hidden_dim: int = 32, proposal_scale: float = 0.5):
        super().__init__()
        d, e = model.state_dim, model.obs_dim
        self.state_dim = d
        self.proposal_net = _mlp(d + e + 1, _check_dim("hidden_dim", hidden_dim), 2 * d)
        # softplus(raw) = proposal_scale at the start.
        scale = _check_scale("proposal_scale", proposal_scale)
        self.proposal_net[-1].bias.data[d:] = torch.log(torch.expm1(torch.tensor(scale)))
        self._t = 0

    def init(self, state: dict) -> None:
        """Starts a new sequence (the guide's step counter), as the model's ``init``."""
        self._t = 0

    def step(self, state: dict, y: Tensor) -> None:
        r"""Samples :math:`x_t` from :math:`q_\phi(\cdot \mid x_{t-1}, y_t)`."""
        t, d = self._t, self.state_dim
        first = "x" not in state
        x_prev = y.new_zeros(y.shape[:-1] + (d,)) if first else state["x"]
        shape = torch.broadcast_shapes(x_prev.shape[:-1], y.shape[:-1])
        inputs = torch.cat([x_prev.expand(shape + (d,)), y.expand(shape + y.shape[-1:]), y.new_full(shape + (1,), float(first))], dim=-1)
        out = self.proposal_net(inputs)
        loc = x_prev + out[..., :d]
        scale = F.softplus(out[..., d:]) + 1e-4
        pyro.sample(f"x_{t}", dist.Normal(loc, scale).to_event(1))
        self._t = t + 1


class LocallyOptimalProposal:
    r"""The exact :math:`p(x_t \mid x_{t-1}, y_t)` of a :class:`NeuralSSM`: a Gaussian in closed form.

    With prior :math:`x_t \mid x_{t-1} \sim \mathcal N(\mu, \operatorname{diag}(v))` (:math:`\mu = x_{t-1} + \mathrm{MLP}(x_{t-1})`, :math:`v = q^2`; at
    :math:`t = 0`, :math:`\mu = 0`, :math:`v = s_0^2`) and :math:`y_t \mid x_t \sim \mathcal N(W x_t + b, \operatorname{diag}(r^2))`,

    .. math::

        P = (\operatorname{diag}(1 / v) + W^\top \operatorname{diag}(1 / r^2) W)^{-1}, \qquad m = P (\mu / v + W^\top ((y_t - b) / r^2)).

    The filter's weight increment is then :math:`p(y_t \mid x_{t-1})`, the same for every draw of
    ``x_t``. It reads the model's parameters each step (gradients reach them), has none of its own,
    and needs the observation at every step it is called.

    Args:
        model: the :class:`NeuralSSM`.

    Example:
        >>> import torch
        >>> from pyro_smc import SMC
        >>> from pyro_smc.models import LocallyOptimalProposal, NeuralSSM
        >>> model = NeuralSSM(2, obs_dim=3)
        >>> _, ys = model.simulate(5)
        >>> smc = SMC(model, LocallyOptimalProposal(model), num_particles=100).run(ys)
        >>> float(smc.ess_history[0, 0])  # the first step's weights are all equal
        100.0
    """

    def __init__(self, model: NeuralSSM):
        if not isinstance(model, NeuralSSM):
            raise ValueError(f"model must be a NeuralSSM, got {type(model).__name__}")
        self.model = model
        self._t = 0

    def init(self, state: dict) -> None:
        """Starts a new sequence (the guide's step counter), as the model's ``init``."""
        self._t = 0

    def step(self, state: dict, y: Tensor) -> None:
        """Samples ``x_t`` from ``p(x_t | x_{t-1}, y_t)``."""
        m, t = self.model, self._t
        q = m.transition_scale
        if "x" in state:
            mu, v = m.transition_mean(state["x"]), q**2
        else:
            mu, v = torch.zeros_like(q), torch.full_like(q, m.init_scale**2)
        r2 = m.observation_scale**2
        if m.emission == "identity":
            weight, residual = torch.eye(m.state_dim, dtype=q.dtype, device=q.device), y
        else:
            weight, residual = m.emission_weight, y - m.emission_bias
        cov = torch.cholesky_inverse(torch.linalg.cholesky(torch.diag_embed(1 / v) + (weight.T / r2) @ weight))
        loc = (mu / v + (residual / r2) @ weight) @ cov  # cov is symmetric
        scale_tril = torch.linalg.cholesky(cov)
        pyro.sample(f"x_{t}", dist.MultivariateNormal(loc, scale_tril=scale_tril))
        self._t = t + 1
