r"""The per-step objective of online variational filtering and its optimisation.

See ``docs/math/streaming.md#step-objective``.

With :math:`q_{t-1}` frozen, the step's log-evidence increment for a pair :math:`(x_{t-1}, x_t)` drawn
from :math:`q_t(x_t) \, q_t(x_{t-1} \mid x_t)` is

.. math::

    \delta(x_{t-1}, x_t) = {} & \log q_{t-1}(x_{t-1}) + \log f(x_t \mid x_{t-1}) + \log g(y_t \mid x_t) \\
                          & - \log q_t(x_{t-1} \mid x_t) - \log q_t(x_t)

(at the first step :math:`\log \mu(x_0) + \log g(y_0 \mid x_0) - \log q_0(x_0)`), and :math:`\phi_t` maximises
:math:`\mathbb E[U_{t-1}(x_{t-1}) + \delta]` where :math:`U_{t-1}` is the regression of the past (the running
lower bound on :math:`\log p(y_{1:t})` is that expectation). :func:`draw` samples the pair,
:func:`increment` evaluates :math:`\delta` per sample, and :class:`StepOptimiser` maximises the
reparameterised Monte Carlo estimate by Adam, until the gradient rule of
:mod:`~pyro_smc.infer.online.stopping` finds nothing more to resolve (before the first iteration
when the start is optimal).

Example:
    >>> import torch
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.infer.online.context import StepContext
    >>> from pyro_smc.infer.online.objective import draw, increment
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> state = {}
    >>> ssm.init(state)
    >>> ctx, _ = StepContext(
    ...     ssm, dict(vars(ssm)), state, None, torch.zeros(2), False, 0
    ... ).discover(8, 2)
    >>> delta, _ = increment(
    ...     ctx, draw(StreamingFilterGuide(2), ctx, 16, reparameterise=True)
    ... )
    >>> delta.shape, delta.requires_grad
    (torch.Size([16]), True)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from pyro.distributions import TorchDistribution
from torch import Tensor

from pyro_smc.guides.streaming.family import StreamingFamily
from pyro_smc.guides.streaming.frame import StepFrame
from pyro_smc.infer.online.context import StepContext
from pyro_smc.infer.online.stopping import CHECK_EVERY, group_gradients, signal_to_noise
from pyro_smc.regression import Regressor

__all__ = ["STOP_WINDOW", "Checked", "Draw", "StepOptimiser", "check_gradients", "converged", "draw", "increment"]

STOP_WINDOW = 10
"""``k`` of the stopping rule: the windows of :func:`converged` are ``k`` iterations long."""


def converged(values: list[float], tol: float, window: int = STOP_WINDOW) -> bool:
    """Whether the objective has stopped improving: at least ``2 window`` values, and the mean of
    the last ``window`` exceeds the mean of the ``window`` before by less than ``tol`` times its
    absolute value (1 when that is below 1, so that an objective near 0 does not need an
    improvement near 0). The objective is maximised; a noisy one that has converged fluctuates and
    stops at the first window that does not improve by ``tol``.

    Example:
        >>> (
        ...     converged([-10.0] * 4, 1e-3, window=2),
        ...     converged([-20.0, -20.0, -10.0, -10.0], 1e-3, window=2),
        ...     converged([-10.0] * 3, 1e-3, window=2),
        ... )
        (True, False, False)
    """
    if len(values) < 2 * window:
        return False
    last = sum(values[-window:]) / window
    before = sum(values[-2 * window : -window]) / window
    return last - before < tol * max(abs(before), 1.0)


class Draw(NamedTuple):
    r"""Samples from :math:`q_t(x_t) \, q_t(x_{t-1} \mid x_t)`.

    Attributes:
        marginal: ``q_t(x_t)``, event shape ``(d,)``.
        x_t: ``(N, d)``.
        kernel: :math:`q_t(x_{t-1} \mid x_t)` with batch shape ``(N,)`` (``None`` at the first step).
        x_prev: ``(N, d)`` (``None`` at the first step).
    """

    marginal: TorchDistribution
    x_t: Tensor
    kernel: TorchDistribution | None
    x_prev: Tensor | None


class Checked(NamedTuple):
    """The draws of the gradient check that stopped a step (:mod:`~pyro_smc.infer.online.stopping`),
    from the guide as fitted: the step's estimate is made from them.

    Attributes:
        pairs: the draws (``x_t`` and ``x_prev`` detached).
        delta: their increments ``(M,)`` (detached).
        state: the model's ``state`` after the step at those draws.
        z: the check's signal-to-noise ratio.
    """

    pairs: Draw
    delta: Tensor
    state: dict
    z: float


def draw(guide: StreamingFamily, context: StepContext, num_samples: int, reparameterise: bool) -> Draw:
    """``num_samples`` pairs from the guide's current marginal and kernel (``x_t`` alone at the
    first step), reparameterised (differentiable in ``phi_t``) or not."""
    marginal = guide.filtering_distribution()
    x_t = marginal.rsample((num_samples,)) if reparameterise else marginal.sample((num_samples,))
    if context.previous is None:
        return Draw(marginal, x_t, None, None)
    kernel = guide.backward_distribution(x_t)
    x_prev = kernel.rsample() if reparameterise else kernel.sample()
    return Draw(marginal, x_t, kernel, x_prev)


def increment(context: StepContext, pairs: Draw) -> tuple[Tensor, dict]:
    r"""``delta`` per sample, ``(N,)``, and the model's ``state`` after the step.

    Differentiable in ``phi_t`` through reparameterised draws and in the model's parameters
    through :math:`\log f + \log g` (the only terms that depend on them).
    """
    log_joint, state = context.log_joint(pairs.x_prev, pairs.x_t)
    delta = log_joint - pairs.marginal.log_prob(pairs.x_t)
    if pairs.x_prev is not None:
        delta = delta + context.previous.log_prob(pairs.x_prev) - pairs.kernel.log_prob(pairs.x_prev)
    return delta, state


class StepOptimiser:
    r"""Fits ``phi_t`` by Adam on the reparameterised estimate of :math:`\mathbb E[U_{t-1}(x_{t-1}) + \delta]`.

    Adam moves the whitened coordinates of the step's start
    (:class:`~pyro_smc.guides.streaming.frame.StepFrame`), not the family's parameters: an
    iteration moves the marginal's and the kernel's means by about ``lr`` of their standard
    deviations in every direction, and their scales by a factor of about ``e^lr``, whatever the
    units and the orientation of the state. (Adam on the parameters themselves moves each by
    about ``lr`` in its own units: at an observation noise of ``1e-4``, ``lr = 0.01`` moved the mean
    by 100 posterior standard deviations per iteration.) A new Adam is made at every step, so
    nothing of earlier steps is carried. The first step gets its own rate; the rate decays
    tenfold within each step to damp the Monte Carlo noise.

    Args:
        guide: the per-step family whose parameters are fitted.
        lr: the rate at ``t >= 1``.
        initial_lr: the rate at ``t = 0``.
        num_iterations: Adam iterations per step (0: leave the guide as it is).
        num_samples: Monte Carlo samples per iteration.
        tol: the objective rule's relative tolerance (``None``: off): after each iteration
            ``i >= 2 k - 1`` (``k =`` :data:`STOP_WINDOW`) the step stops when the mean objective of
            the last ``k`` iterations exceeds that of the ``k`` before by less than ``tol`` times its
            absolute value (:func:`converged`).
        stop_sigmas: the gradient rule (``None``: off): before the first iteration and every
            :data:`~pyro_smc.infer.online.stopping.CHECK_EVERY` after, the step stops when the
            signal-to-noise ratio of its whitened gradient on ``check_samples`` fresh draws is at
            most ``stop_sigmas`` (:mod:`~pyro_smc.infer.online.stopping`).
        check_samples: the gradient rule's draws per check (at least 2).

    Attributes:
        optim: the last step's Adam (over the whitened variables; ``None`` before the first).
        iterations: the number of iterations the last :meth:`fit` ran (0 before the first).
        checked: the check that stopped the last :meth:`fit` (``None`` when none did), whose
            draws are from the guide as fitted.
        exhausted: whether the last :meth:`fit` ran all ``num_iterations`` with a stopping rule
            on and neither rule stopped it.
    """

    def __init__(self, guide: StreamingFamily, *, lr: float, initial_lr: float, num_iterations: int, num_samples: int, tol: float | None = None, stop_sigmas: float | None = None, check_samples: int = 256):
        self.guide = guide
        self.lr, self.initial_lr = lr, initial_lr
        self.num_iterations, self.num_samples = num_iterations, num_samples
        self.tol, self.stop_sigmas, self.check_samples = tol, stop_sigmas, check_samples
        self.optim: torch.optim.Optimizer | None = None
        self.iterations = 0
        self.checked: Checked | None = None
        self.exhausted = False

    def fit(self, context: StepContext, value: Regressor | None) -> None:
        """Runs the step's iterations; ``value`` is ``U_{t-1}`` (``None`` at the first step).

        Raises:
            ValueError: an iteration made a parameter not finite (naming the step).
        """
        n = self.num_iterations
        self.iterations = 0
        self.checked = None
        self.exhausted = False
        if n == 0:
            return
        values: list[float] = []
        named = [(name, p) for name, p in self.guide.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        frame = StepFrame(self.guide)
        w = frame.variables()
        self.optim = torch.optim.Adam(list(w.values()), lr=self.lr)
        lr = self.initial_lr if context.t == 0 else self.lr
        for i in range(n):
            if self.stop_sigmas is not None and i % CHECK_EVERY == 0:
                self.checked = self._check(context, value, named, frame, w)
                if self.checked.z <= self.stop_sigmas:
                    break
                self.checked = None
            for group in self.optim.param_groups:
                group["lr"] = lr * 0.1 ** (i / n)
            pairs = draw(self.guide, context, self.num_samples, reparameterise=True)
            delta, _ = increment(context, pairs)
            objective = delta if pairs.x_prev is None else delta + value(pairs.x_prev).reshape(-1)
            mean = objective.mean()
            values.append(float(mean.detach()))
            grads = torch.autograd.grad(-mean, params, allow_unused=True)
            # The chain rule to the whitened variables: a vector-Jacobian product of the frame.
            phi = frame.parameters(w)
            used = [(phi[name], g) for (name, _), g in zip(named, grads) if g is not None]
            w_grads = torch.autograd.grad([out for out, _ in used], list(w.values()), [g for _, g in used], allow_unused=True)
            for v, g in zip(w.values(), w_grads):
                v.grad = torch.zeros_like(v) if g is None else g
            self.optim.step()
            with torch.no_grad():
                phi = frame.parameters(w)
                for name, p in named:
                    p.copy_(phi[name])
            bad = self.guide.invalid_parameter()
            if bad is not None:
                # Checked here: the next draw would fail inside a distribution, naming no step.
                raise ValueError(
                    f"at step {context.t}: iteration {i} of the step's optimisation made the variational parameter "
                    f"{bad!r} not finite (or a standard deviation 0 or inf): the objective or its gradient was not "
                    "finite at the draws (check the model at this step), or lr is too large (an iteration moves "
                    "each log standard deviation by about lr)"
                )
            self.iterations = i + 1
            if self.tol is not None and converged(values, self.tol, STOP_WINDOW):
                break
        else:
            self.exhausted = self.stop_sigmas is not None or self.tol is not None

    def _check(self, context: StepContext, value: Regressor | None, named: list, frame: StepFrame, w: dict[str, Tensor]) -> Checked:
        """The gradient rule's check at the guide's current parameters (``frame.parameters(w)``)."""
        G, checked = check_gradients(self.guide, context, value, named, frame, w, self.check_samples)
        return checked._replace(z=signal_to_noise(G))


def check_gradients(
    guide: StreamingFamily, context: StepContext, value: Regressor | None, named: list, frame: StepFrame, w: dict[str, Tensor], num_samples: int
) -> tuple[Tensor, Checked]:
    r"""The whitened gradients of the step's objective on ``num_samples`` fresh reparameterised
    draws, per group (:func:`~pyro_smc.infer.online.stopping.group_gradients`), ``(K, P)``, and
    the draws with their increments (``z`` left at ``nan``).

    The model's part of the objective, :math:`\log f + \log g + \log q_{t-1} + U_{t-1}`, depends on the
    variational parameters only through the draws, and each draw's value only on that draw: one
    plain backward pass gives its gradient in every draw, and only the guide's small graph is
    differentiated per group, through the surrogate
    :math:`\langle \nabla_x, x(\phi) \rangle - \log q_t(x_t) - \log q_t(x_{t-1} \mid x_t)`, whose gradient is the
    objective's (a batched pass through the model's graph costs about twice as much).
    """
    pairs = draw(guide, context, num_samples, reparameterise=True)
    x_t = pairs.x_t.detach().requires_grad_(True)
    x_prev = None if pairs.x_prev is None else pairs.x_prev.detach().requires_grad_(True)
    log_joint, state = context.log_joint(x_prev, x_t)
    guide_part = pairs.marginal.log_prob(pairs.x_t)
    model_part, leaves, draws = log_joint, [x_t], [pairs.x_t]
    if x_prev is not None:
        guide_part = guide_part + pairs.kernel.log_prob(pairs.x_prev)
        model_part = model_part + context.previous.log_prob(x_prev)
        leaves, draws = [x_t, x_prev], [pairs.x_t, pairs.x_prev]
    objective = model_part if x_prev is None else model_part + value(x_prev).reshape(-1)
    grads = torch.autograd.grad(objective.sum(), leaves, allow_unused=True) if objective.requires_grad else [None] * len(leaves)
    surrogate = -guide_part
    for g, x in zip(grads, draws):
        if g is not None:
            surrogate = surrogate + (g.detach() * x).sum(-1)
    G = group_gradients(surrogate, named, frame, w)
    detached = Draw(pairs.marginal, pairs.x_t.detach(), pairs.kernel, None if pairs.x_prev is None else pairs.x_prev.detach())
    return G, Checked(detached, (model_part - guide_part).detach(), state, math.nan)
