"""The score-function (stop-gradient) machinery of :class:`~pyro_smc.infer.smc.SMC`.

With an index resampler built with ``gradient="stop_gradient"`` the engine detaches its proposal
draws and adds each draw's ``log q - stop_grad(log q)`` to the particle's log-weight (zero in value,
the score in autograd); with ``gradient="marginal_stop_gradient"`` it adds the score of the marginal
(mixture) transition density instead. This mixin holds the parts of that which need the engine's
state; the per-site terms themselves are :func:`~pyro_smc.infer.smc_weights.score_terms` and
:func:`~pyro_smc.infer.smc_weights.pairwise_transition_log_density`.
See ``docs/math/smc.md#stop-gradient-resampling`` and ``docs/math/smc.md#marginal-stop-gradient``.

The host class provides ``resampler``, ``model``, ``state``, ``log_weights``, ``log_evidence``,
``_unrecorded_increment``, ``_layout``, ``_particle_shape`` and ``_step_context()``.
"""

from __future__ import annotations

import pyro.poutine as poutine
import torch
from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes, restore_attributes
from pyro_smc.infer.smc_weights import pairwise_transition_log_density
from pyro_smc.ops.resample import log_mixture_density
from pyro_smc.resamplers import GradientEstimator, estimator_of
from pyro_smc.tracing import is_latent

__all__ = ["ScoreFunctionMixin"]


class ScoreFunctionMixin:
    """Stop-gradient and marginal stop-gradient scores for a particle filter (see the module docstring)."""

    @property
    def score_function(self) -> bool:
        """Whether the resampler asks for the Fisher-identity gradient (``gradient="stop_gradient"``
        or ``"marginal_stop_gradient"``).

        Then the proposal draws are detached and every proposal site adds
        ``log q - stop_grad(log q)`` to its particle's log-weight (in the marginal mode, the
        marginal transition's score instead; see :attr:`marginal`). See
        ``docs/math/smc.md#stop-gradient-resampling``.
        """
        return estimator_of(self.resampler) in (GradientEstimator.SCORE, GradientEstimator.MARGINAL_SCORE)

    @property
    def marginal(self) -> bool:
        """Whether the resampler asks for the ``O(N^2)`` marginal estimator (``gradient="marginal_stop_gradient"``).

        Then at every step after the first the particle's log-weight gets
        ``m_i - stop_grad(m_i)``, ``m_i = log sum_j w_{t-1}^j f(x_t^i | x_{t-1}^j)`` with the
        previous (gradient-carrying) log-weights, in place of the single-ancestor score and of the
        previous log-weight's own gradient. See ``docs/math/smc.md#marginal-stop-gradient``.
        """
        return estimator_of(self.resampler) is GradientEstimator.MARGINAL_SCORE

    def _marginal_scores(self, model_fn, model_trace, before, args, kwargs, where: str) -> Tensor | None:
        """``m_i - stop_grad(m_i)`` for the step just traced; detaches the previous log-weights,
        whose gradient now enters through ``m_i`` only. ``None`` when the step drew nothing.

        ``before`` is the state and the model's plain attributes before the step: a step with
        several latent sites is run once more, from there, with every draw rolled by one particle,
        to check that no site's distribution depends on another site of the step.
        """
        latent = [name for name, site in model_trace.nodes.items() if is_latent(site)]
        if not latent:
            return None
        if len(latent) > 1:
            self._check_sites_independent(model_fn, model_trace, latent, before, args, kwargs, where)
        log_f = pairwise_transition_log_density(model_trace, self._layout)
        m = log_mixture_density(self.log_weights, log_f)
        self.log_weights = self.log_weights.detach()
        return torch.where(torch.isfinite(m), m - m.detach(), torch.zeros_like(m))

    def _check_sites_independent(self, model_fn, model_trace, latent, before, args, kwargs, where: str) -> None:
        after = (dict(self.state), plain_attributes(self.model))
        dim = len(self._particle_shape) - 1
        rolled = {name: model_trace.nodes[name]["value"].roll(1, dims=dim) for name in latent}
        try:
            dict.clear(self.state)
            dict.update(self.state, before[0])
            restore_attributes(self.model, before[1])
            with self._step_context():
                check = poutine.trace(poutine.condition(model_fn, data=rolled)).get_trace(self.state, *args, **kwargs)
        finally:
            dict.clear(self.state)
            dict.update(self.state, after[0])
            restore_attributes(self.model, after[1])
        for name in latent:
            value = model_trace.nodes[name]["value"]
            if not torch.equal(check.nodes[name]["fn"].log_prob(value), model_trace.nodes[name]["fn"].log_prob(value)):
                raise ValueError(
                    f"marginal stop-gradient at {where}: the distribution of site '{name}' depends on another "
                    "latent site of the same step; the marginal estimator needs every latent site to depend on "
                    "the previous state only (use gradient='stop_gradient')"
                )

    def _add_scores(self, score: Tensor) -> None:
        """Adds a step's score terms (zero in value) when the step scored nothing else.

        The weights take ``score - delta`` and the log-evidence ``delta``, with
        ``delta = lse - stop_grad(lse)`` and ``lse = logsumexp(log w + score)``: all zero in
        value, so the forward numbers stay bit-identical, while in autograd the weights stay
        normalised and ``log_evidence + log w`` keeps the scores of each particle's path.
        """
        joint = self.log_weights + score
        lse = torch.logsumexp(joint, dim=-1)
        delta = torch.where(torch.isfinite(lse), lse - lse.detach(), torch.zeros_like(lse))
        self.log_weights = joint - delta.unsqueeze(-1)
        self.log_evidence = self.log_evidence + delta
        pending = self._unrecorded_increment
        self._unrecorded_increment = delta if pending is None else pending + delta
