r"""Online learning of the model's parameters ``theta`` by the online variational filter.

See ``docs/math/streaming.md#online-parameter-learning``.

The variational analogue of recursive maximum likelihood: per-sample scores
:math:`s_t = \nabla_\theta [\log f + \log g]` feed a regression :math:`S_t(x_t) \approx S_{t-1}(x_{t-1}) + s_t`,
:math:`G_t = \mathbb E_{q_t}[S_t]` estimates :math:`\nabla_\theta L_t` (the gradient of the running lower bound),
and :math:`\theta \leftarrow \theta + \eta_t (G_t - G_{t-1})` with a Robbins-Monro step size :math:`\eta_t`.

``theta`` is every ``pyro.param`` / ``PyroParam`` that ``model.step`` reads, updated in place as
its unconstrained leaf in Pyro's parameter store.

Example:
    >>> import pyro, torch
    >>> from pyro_smc.infer.online.learning import ParameterLearner, robbins_monro
    >>> from pyro_smc.regression import make_regressor
    >>> pyro.clear_param_store()
    >>> a = pyro.param("a", torch.tensor([0.5], dtype=torch.float64))
    >>> learner = ParameterLearner(make_regressor("quadratic"), robbins_monro(0.1))
    >>> learner.track(["a"])
    >>> x = torch.randn(64, 1, dtype=torch.float64)
    >>> # per-sample, depends on a
    >>> delta = -(x - pyro.param("a").unconstrained()).square().sum(-1)
    >>> learner.update(delta, x, None, t=0)
    >>> sorted(learner.parameters())
    ['a']
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pyro
import pyro.poutine as poutine
import torch
from pyro.nn import PyroModule
from torch import Tensor

from pyro_smc.checks import positive_float
from pyro_smc.regression import Regressor
from pyro_smc.ops.jacobian import per_sample_gradients
from pyro_smc.tracing import module_context

__all__ = ["ParameterLearner", "model_parameter_names", "robbins_monro", "step_sizes"]


def robbins_monro(lr: float) -> Callable[[int], float]:
    r"""The step-size schedule :math:`\eta_t = 10 \, \mathrm{lr} / (10 + t^{0.6})` (``lr`` the base rate).

    Example:
        >>> round(robbins_monro(0.1)(0), 3), round(robbins_monro(0.1)(100), 3)
        (0.1, 0.039)
    """
    return lambda t: lr * 10.0 / (10.0 + t**0.6)


def step_sizes(parameter_lr: float | Callable[[int], float]) -> Callable[[int], float]:
    """The filter's ``parameter_lr`` as a schedule ``t -> eta_t``: a callable as it is, a number as
    ``eta_0`` of :func:`robbins_monro`.

    Raises:
        ValueError: a number that is not finite and > 0.

    Example:
        >>> step_sizes(0.1)(0), step_sizes(lambda t: 0.5)(7)
        (0.1, 0.5)
    """
    if callable(parameter_lr):
        return parameter_lr
    try:
        return robbins_monro(positive_float("parameter_lr", parameter_lr))
    except ValueError:
        raise ValueError(f"parameter_lr must be a finite number > 0 or a callable t -> step size, got {parameter_lr!r}") from None


class ParameterLearner:
    """The score recursion and Robbins-Monro updates of ``theta``.

    Args:
        score_regressor: the regressor fitted to ``S_t`` at every step (refitted in place).
        schedule: ``t -> eta_t``.

    Attributes:
        theta: ``{name: unconstrained leaf}`` of every parameter ``model.step`` has read
            (``None`` before the first step).
        score: the fitted ``S_{t-1}`` (``None`` until the first update).
        grad_previous: ``G_{t-1}``, the flat gradient estimate of the last update.
    """

    def __init__(self, score_regressor: Regressor, schedule: Callable[[int], float]):
        self.score_regressor = score_regressor
        self.schedule = schedule
        self.reset()

    def reset(self) -> None:
        """Forgets ``theta``'s names and the score recursion (a new stream)."""
        self.theta: dict[str, Tensor] | None = None
        self.score: Regressor | None = None
        self.grad_previous: Tensor | None = None

    def track(self, names: list[str]) -> None:
        """Adds the parameters ``names`` read by this step's model run to ``theta``.

        A parameter first read at this step (e.g. the transition's, unused at ``t = 0``) extends
        ``theta``: it has not acted on the evidence so far, so its score and gradient up to now
        are zero, and the recursion of the others goes on (restarting it dropped their
        accumulated score: the gradient estimate lost the ``t = 0`` term, 2 of 12.7 on a test
        model).
        """
        if self.theta is None or not set(names) <= set(self.theta):
            theta = dict(self.theta or {})
            added = {name: pyro.param(name).unconstrained() for name in names if name not in theta}
            theta.update(added)
            self.theta = theta
            if self.grad_previous is not None:
                width = sum(leaf.numel() for leaf in added.values())
                self.grad_previous = torch.cat([self.grad_previous, self.grad_previous.new_zeros(width)])

    def update(self, delta: Tensor, x_t: Tensor, x_prev: Tensor | None, t: int) -> None:
        """One update from the step's regression draws.

        Args:
            delta: the per-sample increments ``(N,)``, differentiable in ``theta``.
            x_t: ``(N, d)``, the draws of ``x_t``.
            x_prev: ``(N, d)``, the paired draws of ``x_{t-1}`` (``None`` at the first step).
            t: the step index, for ``eta_t``.
        """
        leaves = list(self.theta.values())
        # Only log f + log g depend on theta, so the per-sample gradient of delta is the score s_t.
        scores = per_sample_gradients(delta, leaves)
        if x_prev is not None and self.score is not None:
            previous = self.score(x_prev)
            # Zero for the parameters first read after the score was last fitted (see track).
            missing = scores.shape[-1] - previous.shape[-1]
            if missing:
                previous = torch.cat([previous, previous.new_zeros(previous.shape[:-1] + (missing,))], -1)
            scores = scores + previous
        self.score = self.score_regressor.fit(x_t, scores)
        grad = self.score(x_t).mean(0)
        step = grad if self.grad_previous is None else grad - self.grad_previous
        self.grad_previous = grad
        eta = self.schedule(t)
        try:
            valid = not isinstance(eta, bool) and math.isfinite(float(eta)) and float(eta) >= 0
        except (TypeError, ValueError, RuntimeError):
            valid = False
        if not valid:
            # A negative step would walk down the likelihood, silently.
            raise ValueError(f"at step {t}: parameter_lr({t}) must be a finite number >= 0, got {eta!r}")
        with torch.no_grad():
            offset = 0
            for leaf in leaves:
                size = leaf.numel()
                leaf.add_(eta * step[offset : offset + size].reshape(leaf.shape))
                offset += size

    def gradient(self) -> dict[str, Tensor]:
        r"""The last estimate :math:`G_t` of :math:`\nabla_\theta \log p(y_{1:t})`, per parameter (with respect to
        its unconstrained value, detached); empty before the first update."""
        if self.theta is None or self.grad_previous is None:
            return {}
        out, offset = {}, 0
        for name, leaf in self.theta.items():
            out[name] = self.grad_previous[offset : offset + leaf.numel()].reshape(leaf.shape).detach().clone()
            offset += leaf.numel()
        return out

    def parameters(self) -> dict[str, Tensor]:
        """``theta``'s current constrained values, detached."""
        if self.theta is None:
            return {}
        return {name: pyro.param(name).detach().clone() for name in self.theta}

    # --- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``theta`` (unconstrained values), the score regressor and ``G_{t-1}``."""
        return {
            "score": None if self.score is None else self.score.state_dict(),
            "grad_previous": self.grad_previous,
            "theta": None if self.theta is None else {name: leaf.detach().clone() for name, leaf in self.theta.items()},
        }

    def load_state_dict(self, state: dict[str, Any], model: Any) -> None:
        """Restores :meth:`state_dict`, writing ``theta`` into Pyro's parameter store.

        Raises:
            ValueError: a parameter is not in the store (a model that is not a ``PyroModule``
                must have the store restored first).
        """
        self.score = None
        if state["score"] is not None:
            self.score_regressor.load_state_dict(state["score"])
            self.score = self.score_regressor
        self.grad_previous = state["grad_previous"]
        self.theta = None
        if state["theta"] is None:
            return
        _register_params(model)
        self.theta = {}
        for name, value in state["theta"].items():
            if name not in pyro.get_param_store():
                raise ValueError(
                    f"load_state_dict: parameter {name!r} is not in Pyro's param store; for a model that is not a "
                    "PyroModule, restore the param store (pyro.get_param_store().set_state) first"
                )
            leaf = pyro.param(name).unconstrained()
            with torch.no_grad():
                leaf.copy_(value)
            self.theta[name] = leaf


def model_parameter_names(model: Any) -> list[str]:
    """The Pyro names of every ``PyroParam`` / ``nn.Parameter`` of a ``PyroModule`` model (each read
    once inside the model's context, which puts it in the param store under the name its sites
    use); ``[]`` for a model that is not a ``PyroModule``.

    Example:
        >>> import pyro, torch
        >>> from pyro_smc.models import DiagonalLinearGaussianSSM
        >>> pyro.clear_param_store()
        >>> model_parameter_names(
        ...     DiagonalLinearGaussianSSM(torch.ones(2), torch.ones(2), 1.0, 1.0)
        ... )
        ['transition_diag', 'emission_diag']
    """
    if not isinstance(model, PyroModule):
        return []
    with poutine.block():
        trace = poutine.trace(_read_parameters).get_trace(model)
    return [name for name, site in trace.nodes.items() if site["type"] == "param"]


def _read_parameters(model: PyroModule) -> None:
    with module_context(model):
        for module in model.modules():
            if isinstance(module, PyroModule):
                for name in list(module._pyro_params) + [n for n, _ in module.named_parameters(recurse=False)]:
                    getattr(module, name.removesuffix("_unconstrained"))


def _register_params(model: Any) -> None:
    """Puts every parameter of a ``PyroModule`` model in the param store (see :func:`model_parameter_names`)."""
    model_parameter_names(model)
