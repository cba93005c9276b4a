r"""The score-function (stop-gradient) terms of :class:`~pyro_smc.SMC` that need the step's state.

With an index resampler built with ``gradient="stop_gradient"`` the engine detaches its proposal
draws and adds each draw's :math:`\log q - \operatorname{stop\_grad}(\log q)` to the particle's log-weight (zero in value,
the score in autograd); with ``gradient="marginal_stop_gradient"`` it adds the score of the marginal
(mixture) transition density instead. The per-site terms themselves are
:func:`~pyro_smc.infer.smc.importance.score_terms` and
:func:`~pyro_smc.infer.smc.importance.pairwise_transition_log_density`; this module holds the
marginal score (which reads the previous weights and may re-run the step) and the weighing of a
step that scored nothing but scores.
See ``docs/math/smc.md#stop-gradient-resampling`` and ``docs/math/smc.md#marginal-stop-gradient``.

**Stop-gradient (Fisher-identity) mode.** With an index resampler built with
``gradient="stop_gradient"`` (``SMC`` reads the resampler's
:class:`~pyro_smc.resamplers.GradientEstimator`; see :attr:`SMC.score_function <pyro_smc.SMC.score_function>`) the forward pass is unchanged bit for bit, but every proposal draw
is detached (no pathwise gradient) and each particle's log-weight gains
:math:`\log q(x) - \operatorname{stop\_grad}(\log q(x))` for each proposal site (guide sites; model latent sites the
guide does not sample, for which :math:`q = f`), zero in value. Autodiff of ``log_evidence`` then
returns :math:`G = \sum_i w_T^i \nabla_\theta \log p(x^i_{1:T}, y_{1:T})` over the particles' ancestral paths
(Scibior and Wood, 2021), which reaches parameters acting only through discrete draws (a
switching probability). What is unbiased: :math:`\mathbb E[\hat Z G] = \nabla_\theta Z` exactly, so
:math:`\mathbb E[(\hat Z / Z) G] = \nabla_\theta \log Z` (the exact score); :math:`\mathbb E[G]` itself is biased for the
score (a ratio of estimates; the bias is :math:`O(1/N)`). Proposal parameters get zero gradient in
this mode, and ``NonReparameterizedGradientWarning`` is not raised.
See ``docs/math/smc.md#stop-gradient-resampling``.

**Marginal stop-gradient mode.** With ``gradient="marginal_stop_gradient"`` (same resampler
output) each step after the first replaces the single-ancestor score by that of the marginal
transition density: the log-weight becomes :math:`\operatorname{stop\_grad}(\log w_{t-1}^i) + \log \omega_t^i + m_i -
\operatorname{stop\_grad}(m_i)`, :math:`m_i = \log \sum_j w_{t-1}^j f(x_t^i \mid x_{t-1}^j)` over all particle pairs of a
filter (one vectorised ``log_prob`` per latent site; :math:`O(B N^2)` time and memory per step). The
forward pass is again unchanged, :math:`\mathbb E[\hat Z G] = \nabla_\theta Z` still holds exactly, and the variance
of ``G`` grows far more slowly with ``T`` (Poyiadjis, Doucet and Singh, 2011). Bootstrap filters
only, ``max_plate_nesting == 0``, every latent site must depend on the previous state only and
the state must be written from the step's draws alone (:mod:`~pyro_smc.infer.smc.markov_checks`);
otherwise ``ValueError``. See ``docs/math/smc.md#marginal-stop-gradient``.

Example:
    >>> import torch
    >>> from pyro_smc.infer.smc.state import ParticleWeights
    >>> w = ParticleWeights.uniform(1, 3, torch.zeros(()))
    >>> out = add_scores(w, torch.zeros(1, 3))                 # zero in value
    >>> torch.equal(out.log_weights, w.log_weights), out.log_evidence.tolist()
    (True, [0.0])
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.infer.smc.importance import ParticleLayout, pairwise_transition_log_density
from pyro_smc.infer.smc.markov_checks import transition_problem
from pyro_smc.infer.smc.state import ParticleWeights
from pyro_smc.ops.resample import log_mixture_density
from pyro_smc.tracing import is_latent

__all__ = ["add_scores", "marginal_scores"]


def marginal_scores(program, proposal, log_weights: Tensor, before, state, inputs, layout: ParticleLayout) -> Tensor | None:
    r"""``m_i - stop_grad(m_i)`` ``(B, N)`` for the step just traced, with
    :math:`m_i = \log \sum_j w_{t-1}^j f(x_t^i \mid x_{t-1}^j)` and ``log_weights`` the previous ones (the
    caller then detaches them: their gradient enters through ``m_i`` only). ``None`` when the step
    drew nothing.

    ``before`` is the state and the model's plain attributes before the step: the step may be
    run once more from there to check that the latent sites give its transition density
    (:mod:`~pyro_smc.infer.smc.markov_checks`).

    Raises:
        ValueError: a latent site depends on another latent site of the step, or a state entry
            on the previous state beyond the step's draws (naming it and the step).
    """
    model_trace = proposal.model_trace
    latent = [name for name, site in model_trace.nodes.items() if is_latent(site)]
    if not latent:
        return None
    problem = transition_problem(program, proposal, before, state, inputs, layout)
    if problem is not None:
        raise ValueError(
            f"marginal stop-gradient at {inputs.where}: {problem}; the marginal estimator needs the step's latent "
            "sites to give its transition density (each depending on the previous state only, the state written "
            "from the draws alone): use gradient='stop_gradient'"
        )
    log_f = pairwise_transition_log_density(model_trace, layout)
    m = log_mixture_density(log_weights, log_f)
    return torch.where(torch.isfinite(m), m - m.detach(), torch.zeros_like(m))


def add_scores(weights: ParticleWeights, score: Tensor) -> ParticleWeights:
    r"""The weights after a step that scored nothing but its score terms ``score`` ``(B, N)``
    (zero in value).

    The weights take ``score - delta`` and the log-evidence ``delta``, with
    :math:`\delta = \mathrm{lse} - \operatorname{stop\_grad}(\mathrm{lse})` and :math:`\mathrm{lse} = \operatorname{logsumexp}(\log w + \mathrm{score})`: all zero in value, so
    the forward numbers stay bit-identical, while in autograd the weights stay normalised and
    ``log_evidence + log w`` keeps the scores of each particle's path.
    """
    joint = weights.log_weights + score
    lse = torch.logsumexp(joint, dim=-1)
    delta = torch.where(torch.isfinite(lse), lse - lse.detach(), torch.zeros_like(lse))
    return weights.gain(joint - delta.unsqueeze(-1), delta)
