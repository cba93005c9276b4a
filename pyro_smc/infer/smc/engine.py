"""Differentiable sequential Monte Carlo: the successor of ``pyro.infer.SMCFilter``.

See ``docs/math/smc.md#one-step-of-the-filter`` and ``docs/math/smc.md#log-evidence-estimate`` and
``docs/math/smc.md#effective-sample-size-and-adaptive-resampling``.

A model is an object with ``init(state, *args)`` and ``step(state, *args)`` methods that call
``pyro.sample``; ``state`` is a dict of tensors whose leading dimensions are the particle
dimensions, written only by the model. A guide (proposal) has the same methods, reads ``state``
and samples the model's latent sites. Without a guide the model's own transition is the proposal
(a bootstrap filter). Every ``pyro.infer.SMCFilter`` model runs unchanged.

One step at time ``t`` reads as its equation::

    propose x_t ~ q(. | x_{t-1}, y_t)                          (reparameterised where possible)
    log omega = log f(x_t | x_{t-1}) + log g(y_t | x_t) - log q(x_t | x_{t-1}, y_t)
    log p_hat(y_t | y_{1:t-1}) = logsumexp(log w_{t-1} + log omega)
    log w_t = log w_{t-1} + log omega - log p_hat(y_t | y_{1:t-1})
    resample the filters whose ESS fell below ess_threshold * N

Each site's term of ``log omega`` is shifted by its maximum over the particles of a filter before
the terms are summed, and the shifts are added back to ``log p_hat`` only: a term that is huge
but equal for all particles (a ``pyro.factor`` constant) would otherwise round the per-particle
differences away in float32. Values and gradients are those of the equations above.

Log-weights and the running log-evidence keep their autograd graph, so with a differentiable
resampler (:class:`~pyro_smc.resamplers.OTResampler`) ``log_evidence`` and the filtering means
are differentiable in model and proposal parameters.

**Score-function modes.** With an index resampler built with ``gradient="stop_gradient"`` or
``gradient="marginal_stop_gradient"`` the forward pass is unchanged bit for bit, but the gradient
of ``log_evidence`` is the Fisher-identity (score) estimator along the particles' paths, or its
``O(N^2)`` marginal version, which reaches parameters acting only through discrete draws; see
:mod:`~pyro_smc.infer.smc.scores` and ``docs/math/smc.md#stop-gradient-resampling``.

``num_filters`` independent filters run
vectorised in one pass: the state then has leading dimensions ``(num_filters, num_particles)``
(an outer ``pyro.plate("filters")``); with one filter it has ``(num_particles,)`` exactly as
under ``SMCFilter``.

Example:
    >>> import torch
    >>> from pyro_smc import SMC
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> from pyro_smc.resamplers import OTResampler
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(20)
    >>> smc = SMC(ssm, num_particles=100, num_filters=4, resampler=OTResampler(epsilon=0.5))
    >>> smc.run(ys).log_evidence.shape
    torch.Size([4])
    >>> smc.filtering_means["x"].shape                      # (T, num_filters, d)
    torch.Size([20, 4, 2])

With ``store_history=True``, :meth:`SMC.smooth` draws smoothed trajectories by forward filtering,
backward sampling (any resampler) or along the genealogy (index resamplers);
see ``docs/math/smc.md#particle-smoothing``:

    >>> smc = SMC(ssm, num_particles=100, num_filters=4, store_history=True).run(ys)
    >>> smc.smooth(10)["x"].shape                           # (num_samples, T, num_filters, d)
    torch.Size([10, 20, 4, 2])
    >>> smc.smooth(10, method="genealogy")["x"].shape
    torch.Size([10, 20, 4, 2])

Reference:
    Corenflos, Thornton, Deligiannidis, Doucet (2021). Differentiable particle filtering via
    entropy-regularized optimal transport. ICML.

    Scibior, Wood (2021). Differentiable particle filtering without modifying the forward pass.
    arXiv:2106.10314.
"""

from __future__ import annotations

from typing import Any, Callable

import pyro.distributions as dist
import torch
from torch import Tensor
from tqdm.auto import tqdm

from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.model_state import plain_attributes
from pyro_smc.infer.smc import checkpoint, smoothing
from pyro_smc.infer.smc.checks import (
    ESTIMATOR_OPTION,
    NonReparameterizedGradientWarning,
    ParticleDegeneracyWarning,
    TraceChecks,
    check_finite_args,
    check_marginal_supported,
    check_settings,
    warn_degenerate_weights,
)
from pyro_smc.infer.smc.importance import ParticleLayout, SMCFailedError, log_weight_terms, score_terms
from pyro_smc.infer.smc.result import SMCResult, StepRecord, stack_records
from pyro_smc.infer.smc.schedule import fill_missing, observation_schedule
from pyro_smc.infer.smc.scores import marginal_scores
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.infer.smc.step import StepInputs, StepProgram, maybe_resample, summarise, weigh
from pyro_smc.checks import positive_int
from pyro_smc.observations import step_observation
from pyro_smc.resamplers import GradientEstimator, Resampler, SystematicResampler, estimator_of

__all__ = ["SMC", "SMCState", "SMCFailedError", "NonReparameterizedGradientWarning", "ParticleDegeneracyWarning"]


class SMC:
    """Differentiable, vectorised particle filter over Pyro ``init``/``step`` models.

    The first four arguments are positional as in ``SMCFilter(model, guide, num_particles,
    max_plate_nesting)``, so a call written for ``SMCFilter`` works unchanged; the rest are
    keyword-only.

    Args:
        model: object with ``init(state, *args)`` and ``step(state, *args)`` Pyro methods.
        guide: proposal with the same methods, or ``None`` for the bootstrap filter.
        num_particles: particles per filter, ``N >= 1`` (required).
        max_plate_nesting: number of plates the model uses inside a step (as in SMCFilter).
        resampler: a resampler from :mod:`pyro_smc.resamplers`; default systematic. An index
            resampler with ``gradient="stop_gradient"`` switches on the Fisher-identity
            gradient, ``gradient="marginal_stop_gradient"`` its ``O(N^2)`` marginal version (above).
        ess_threshold: resample a filter when its ESS falls below ``ess_threshold * N``;
            in ``(0, 1]``.
        num_filters: independent filters ``B`` run in one vectorised pass: on one sequence, or
            one each on a batch of ``B`` sequences (``run(..., batched=True)``; see
            ``docs/math/smc.md#batches-of-sequences``).
        progress_bar: show a tqdm progress bar in :meth:`run` (off by default; the CLI demo turns it on).
        store_history: keep, per step, the weighted particles, the particles the step propagated
            from with their log-weights, its latent sites' distributions and the resampler's
            ancestors, for :meth:`smooth` (memory ``O(T B N)``; off by default). The history is
            part of :meth:`state_dict`.

    Attributes:
        state: the particle state (:class:`~pyro_smc.infer.smc.state.SMCState`).
        log_weights: normalised log-weights, shape ``(B, N)``.
        log_evidence: ``log Z_hat``, shape ``(B,)``, differentiable.
        ess: effective sample size after the last weighting, in ``[1, N]``, shape ``(B,)``.
        filtering_means: dict of ``(T, B, *event)`` weighted means per state key, one row per
            ``step`` (taken before resampling), in the weights' dtype; for a 0/1 label the
            filtering probability of 1 (see ``docs/engines/smc.md#discrete-latent-state``).
        ess_history: ``(T, B)``; resampled: ``(T, B)`` bool.
        log_evidence_increments: ``(T, B)`` per-step terms of ``log_evidence``.
        result: all of the above as a typed :class:`~pyro_smc.infer.smc.result.SMCResult`, plus
            whether each step's optimal-transport solve converged (``resampler_converged``).

    Raises:
        TypeError: ``num_particles`` is not given.
        ValueError: a count, ``max_plate_nesting`` or ``ess_threshold`` is out of range, the
            model or guide lacks ``init``/``step``, or the resampler is a class or not callable.
            While running (naming the time step): the model keeps a latent site's value on
            ``self`` instead of in ``state``, an observation's dtype is not its site's, the
            model samples nothing, or a state tensor's filtering mean is not finite.

    Warns:
        ParticleDegeneracyWarning: in :meth:`run`, when the weights collapsed onto about one
            particle at a fifth of the steps or more.
        UserWarning: a guide with parameters under ``gradient="stop_gradient"``, which gives
            them exactly zero gradient.

    Example:
        The log-evidence estimate lies near the exact Kalman value ``log p(y_{1:T})``:

        >>> import torch
        >>> from pyro_smc import SMC
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> _, ys = ssm.simulate(10)                            # ys: (T, dy)
        >>> smc = SMC(ssm, num_particles=200).run(ys)
        >>> smc.log_evidence.shape, smc.log_weights.shape       # (B,), (B, N)
        (torch.Size([1]), torch.Size([1, 200]))
        >>> bool(abs(smc.log_evidence - ssm.log_evidence(ys)) < 1.5)
        True
    """

    def __init__(
        self,
        model,
        guide=None,
        num_particles: int | None = None,
        max_plate_nesting: int = 0,
        *,
        resampler: Callable | None = None,
        ess_threshold: float = 0.5,
        num_filters: int = 1,
        progress_bar: bool = False,
        store_history: bool = False,
    ):
        if num_particles is None:
            raise TypeError("SMC needs num_particles: SMC(model, guide, num_particles, max_plate_nesting) or SMC(model, num_particles=N)")
        check_settings(num_particles, num_filters, max_plate_nesting, ess_threshold, resampler)
        for name, obj in (("model", model), ("guide", guide)):
            if obj is not None and not (callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))):
                raise ValueError(f"{name} must have init(state, ...) and step(state, ...) methods")
        self.model = model
        self.guide = guide
        self.num_particles = int(num_particles)
        self.num_filters = int(num_filters)
        self.max_plate_nesting = int(max_plate_nesting)
        self.resampler = resampler if resampler is not None else SystematicResampler()
        self.ess_threshold = float(ess_threshold)
        self.progress_bar = bool(progress_bar)
        self.store_history = bool(store_history)
        # Fixed for the engine's life; read several times per step.
        self._layout = ParticleLayout(self.num_filters, self.num_particles, self.max_plate_nesting)
        self._program = StepProgram(model, guide, self._layout)
        self._reset()

    def _reset(self) -> None:
        """Forgets the run: particles, weights, records, history and what the checks remember."""
        self.state = SMCState()
        self._t = 0
        self._initialized = False
        self._weights: ParticleWeights | None = None
        self.ess: Tensor | None = None
        self._weighted: tuple[dict, Tensor] | None = None
        self._records: list[StepRecord] = []
        # Per step, what smooth() needs (store_history).
        self._history: list[dict] = []
        self._checks = TraceChecks(self.model, self._layout.particle_shape)

    # --- the estimator the resampler asks for ---------------------------------------------------
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

    # --- public loop --------------------------------------------------------------------------
    def init(self, *args, **kwargs) -> SMC:
        """Starts new filters: runs ``model.init`` (and ``guide.init``) on fresh particles."""
        self._reset()
        check_finite_args(args, kwargs, "init")
        self._advance(self.model.init, self.guide.init if self.guide is not None else None, StepInputs(args, kwargs, None))
        self._initialized = True
        return self

    def step(self, *args, **kwargs) -> SMC:
        """Advances every filter by one time step: propose, reweight, maybe resample.

        A step whose observation (the first positional argument) is ``None`` or all-NaN is
        predict-only: the particles move by the model's own transition and no observed site is
        scored, so the weights and ``log_evidence`` do not change. A partly-NaN observation is
        scored on its observed entries only: the model gets it with the missing entries set to
        zero, the site that observes it must factorise over its entries
        (``Normal(...).to_event(1)``; a ``MultivariateNormal`` is an error), and the model's
        transition proposes, as in a predict-only step. At both kinds of step the guide, which
        may need the missing entries, does not propose: it is still called (with the missing
        entries set to zero) so that a step counter or hidden state it keeps stays in step with
        the model's, and its draws are discarded. An infinite observation, or a NaN in another
        argument, is an error. See ``docs/math/smc.md#missing-observations``.
        """
        y = args[0] if args else None
        observation = step_observation(y, self._t) if y is None or isinstance(y, Tensor) else None
        missing = observation is not None and observation.missing
        observed = None if observation is None else observation.observed
        args = fill_missing(args, observed)
        check_finite_args(args[1:] if missing else args, kwargs, f"time step {self._t}")
        return self._step(StepInputs(args, kwargs, self._t, missing, observed))

    def _step(self, inputs: StepInputs) -> SMC:
        if not self._initialized:
            raise RuntimeError("SMC.step called before SMC.init")
        proposes = not inputs.predict_only and inputs.observed is None
        guide_step = self.guide.step if self.guide is not None and proposes else None
        if self.guide is not None and not proposes:
            self._program.advance_guide(self.state, inputs)
        self._advance(self.model.step, guide_step, inputs)
        if self._weights is None:
            raise ValueError(
                f"at {inputs.where}: model.init and model.step sampled no site and wrote no state, so there is nothing to filter; "
                "a step must sample its latent site into state (state['x'] = pyro.sample(...)) and observe y"
            )
        self._t += 1
        return self

    def run(self, observations: Tensor, *args, lengths: Tensor | None = None, batched: bool = False, **kwargs) -> SMC:
        """``init(*args)`` then ``step(observations[t], *args)`` for every leading-dim slice.

        With ``batched=True`` the filters run on a batch of sequences, one each: ``observations``
        has shape ``(B, T, ...)`` with ``B == num_filters``, and at step ``t`` the model gets
        ``observations[:, t].unsqueeze(1)``, of shape ``(B, 1, ...)``, which broadcasts against
        the particle dims ``(B, N)`` of the state: a site
        ``pyro.sample("y", dist.Normal(loc, scale).to_event(1), obs=y)`` whose ``loc`` is
        ``(B, N, dy)`` scores filter ``b``'s particles on sequence ``b``. (With ``num_filters == 1``
        the state has no filter dim, and the model gets ``observations[0, t]`` as in an unbatched
        run.) A model written for ``run(ys)`` runs unchanged when it broadcasts its observation
        against the particles' batch shape, as :class:`~pyro_smc.models.LinearGaussianSSM` does.
        ``log_evidence[b]`` estimates ``log p(y^b_{1:L_b})`` of sequence ``b``.

        ``lengths`` marks sequences of different lengths in a padded batch: the steps
        ``t >= lengths[b]`` of filter ``b`` are predict-only for that filter alone (its weights
        and ``log_evidence[b]`` do not change; padded entries are never read and may hold
        anything, NaN included). A NaN row (all entries of ``observations[b, t]``) is
        predict-only for filter ``b`` alone, a partly-NaN row is scored on its observed entries
        (the site must factorise over them, as for an unbatched run). With a guide, a step at
        which some filters observe nothing still calls the guide for all filters (their
        observation rows reach it as zeros); the filters that observe move by the guide's
        draws, the others by the model's own transition (``q = f``, so their weights do not
        change). A step with a partly-NaN row moves *every* filter by the model's transition
        (the guide may need the missing entries; the estimate stays unbiased, the proposal is
        only less good there). The model and guide are called once per step for all filters:
        they must not branch on the observation's values.
        See ``docs/math/smc.md#batches-of-sequences``.

        Args:
            observations: tensor ``(T, ...)``; with ``batched=True``, ``(B, T, ...)``. A step whose
                slice is all-NaN is predict-only, a partly-NaN slice is scored on its observed
                entries (see :meth:`step`); an infinite entry is an error naming the step.
            *args: further arguments of ``init`` and ``step`` (the same at every step).
            lengths: integer tensor ``(B,)`` of sequence lengths in ``[1, T]`` (``batched=True``
                only); ``None`` means every sequence has all ``T`` steps.
            batched: whether ``observations`` is a batch of ``num_filters`` sequences.
            **kwargs: further keyword arguments of ``init`` and ``step``.

        Returns:
            ``self``, with ``log_evidence`` ``(B,)`` and the per-step histories filled in.

        Raises:
            ValueError: ``observations`` is not a tensor of the shape above (``batched=True`` with
                ``observations.shape[0] != num_filters``), has no time steps or is in half
                precision, ``lengths`` is not an integer tensor ``(B,)`` with entries in
                ``[1, T]``, or ``lengths`` is given without ``batched``.

        Example:
            >>> import torch
            >>> from pyro_smc import SMC
            >>> from pyro_smc.models import LinearGaussianSSM
            >>> eye = torch.eye(2)
            >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
            >>> ys = torch.stack([ssm.simulate(20)[1] for _ in range(3)])   # 3 sequences (B, T, dy)
            >>> smc = SMC(ssm, num_particles=100, num_filters=3)
            >>> smc.run(ys, lengths=torch.tensor([20, 12, 5]), batched=True).log_evidence.shape
            torch.Size([3])
        """
        schedule = observation_schedule(observations, self.num_filters, lengths=lengths, batched=batched)
        # A GP inside the model or guide computes its posterior once for the whole run (with its
        # graph when its hyperparameters require grad), not once per step.
        with pinned_posteriors(self.model, self.guide):
            self.init(*args, **kwargs)
            for t, step in enumerate(tqdm(schedule, desc="SMC", disable=not self.progress_bar, leave=False)):
                # Observations were checked above, all at once.
                self._step(StepInputs((step.y,) + args, kwargs, t, step.predict_only, step.observed, step.active))
        warn_degenerate_weights(self.ess_history, self.num_particles)
        return self

    # --- one step: propose -> weigh -> summarise -> maybe resample -------------------------------
    def _advance(self, model_fn: Callable, guide_fn: Callable | None, inputs: StepInputs) -> None:
        """Takes one step (``inputs.t is None``: ``init``) and keeps its weights and record."""
        score_function, marginal_mode = self.score_function, self.marginal
        option = ESTIMATOR_OPTION[estimator_of(self.resampler).value] if score_function else None
        weights = self._weights
        # The marginal estimator needs the previous weights; init (and a step before any weights)
        # scores its draws along the path, which is the same thing for a parentless draw.
        marginal = marginal_mode and torch.is_grad_enabled() and weights is not None
        if marginal_mode:
            check_marginal_supported(self.guide, self.max_plate_nesting)
        before = (dict(self.state), plain_attributes(self.model)) if marginal else None
        # The unbatched state: step_record adds the filter dim itself.
        parent = (dict(self.state), weights.log_weights) if self.store_history and weights is not None else None

        proposal = self._program.propose(self.state, model_fn, guide_fn, inputs, detach=score_function)
        self._checks.check(proposal, self.state, inputs, option)
        terms = log_weight_terms(proposal.model_trace, proposal.guide_trace, self._layout, inputs.predict_only, inputs.partial, inputs.active)
        history = None
        if self.store_history and inputs.t is not None:
            history = smoothing.step_record(proposal.model_trace, self.state, parent, self._layout)
        score = None
        if marginal:
            score = marginal_scores(self._program, proposal, weights.log_weights, before, self.state, self.model, inputs, self._layout)
            if score is not None:
                # The previous weights' gradient now enters through the marginal score only.
                weights = weights._replace(log_weights=weights.log_weights.detach())
        elif score_function and torch.is_grad_enabled():
            score = score_terms(proposal.model_trace, proposal.guide_trace, self._layout, inputs.active)
        self._checks.check_state(self.state, inputs.where)

        like = next(iter(self.state.values())) if self.state else None
        weights = weigh(weights, terms, score, self._layout, inputs, like)
        if weights is None:
            return
        means, self.ess = summarise(self.state, weights, self._layout, inputs)
        # References, not copies: resampling replaces the state tensors instead of mutating them.
        self._weighted = (dict(self.state), weights.log_weights)
        if history is not None:
            smoothing.record_weighted(history, self.state, weights.log_weights, self._layout)
            self._history.append(history)
        need = self.ess < self.ess_threshold * self.num_particles
        weights, resampling = maybe_resample(self.state, weights, need, self.resampler, self._checks.discrete_keys, self._layout, inputs.where)
        if history is not None and resampling is not None:
            smoothing.record_resampling(history, need, resampling.ancestors, self._layout)
        if inputs.t is None:
            # An init's log-evidence term stays unreported and joins step 0's increment.
            self._weights = weights
            return
        self._weights, increment = weights.reported()
        self._records.append(
            StepRecord(
                log_evidence_increment=increment,
                filtering_means=means,
                ess=self.ess,
                resampled=need if self.state else torch.zeros_like(need),
                # Kept with the history only: (B, N) per step is the smoother's memory, not the run's.
                ancestors=resampling.ancestors if resampling is not None and self.store_history else None,
                resampler_converged=None if resampling is None else resampling.converged,
            )
        )

    # --- results ------------------------------------------------------------------------------
    @property
    def log_weights(self) -> Tensor | None:
        """``(B, N)`` normalised log-weights after the last step (``None`` before ``init``)."""
        return None if self._weights is None else self._weights.log_weights

    @property
    def log_evidence(self) -> Tensor | None:
        """``(B,)`` ``log Z_hat`` of the steps so far, differentiable (``None`` before ``init``)."""
        return None if self._weights is None else self._weights.log_evidence

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """The :class:`~pyro_smc.infer.smc.result.StepRecord` of every step so far."""
        return tuple(self._records)

    def _stacked(self) -> SMCResult:
        if not self._records:
            raise RuntimeError("SMC has not taken a step; call run(observations) or init() and step()")
        return stack_records(self._records, self.log_evidence)

    @property
    def filtering_means(self) -> dict[str, Tensor]:
        """``{key: (T, B, *event)}`` weighted means of each state entry per step, before resampling."""
        return self._stacked().filtering_means

    @property
    def ess_history(self) -> Tensor:
        """``(T, B)`` the effective sample size after each step's reweighting."""
        return self._stacked().ess

    @property
    def resampled(self) -> Tensor:
        """``(T, B)`` bool, whether each filter resampled at each step."""
        return self._stacked().resampled

    @property
    def log_evidence_increments(self) -> Tensor:
        """``(T, B)``: ``log p_hat(y_t | y_{1:t-1})`` per step; their sum over ``T`` is ``log_evidence``."""
        return self._stacked().log_evidence_increments

    @property
    def result(self) -> SMCResult:
        """A snapshot of the run so far as an :class:`~pyro_smc.infer.smc.result.SMCResult`.

        Example:
            >>> import torch
            >>> from pyro_smc import SMC
            >>> from pyro_smc.models import LinearGaussianSSM
            >>> eye = torch.eye(2)
            >>> _, ys = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye).simulate(5)
            >>> out = SMC(LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye), num_particles=10).run(ys).result
            >>> out.log_evidence_increments.shape, out.ess.shape
            (torch.Size([5, 1]), torch.Size([5, 1]))
        """
        return self._stacked()

    @property
    def weighted_particles(self) -> tuple[dict[str, Tensor], Tensor]:
        """The particles and normalised log-weights ``(B, N)`` after the last reweighting, before any
        resampling. For posterior summaries prefer these to ``state``: resampling only adds noise,
        and OT resampling also shrinks the cloud (its barycentric map has bias ``O(epsilon)``)."""
        if self._weighted is None:
            raise RuntimeError("SMC has not been run; call init/step or run first")
        return self._weighted

    def smooth(self, num_samples: int, method: str = "ffbs", max_rounds: int = smoothing.REJECTION_MAX_ROUNDS) -> dict[str, Tensor]:
        """Draws ``num_samples`` trajectories per filter from the particle smoother (needs ``store_history=True``).

        ``method="ffbs"`` (forward filtering, backward sampling) draws the last state by the final
        weights, then each earlier state among the particles the next step propagated from, with
        probability proportional to their weight times the transition density
        ``f(x_t | x_{t-1})``; any resampler (after an optimal-transport resampling the parents
        are the transported particles). ``O(S B N)`` per step. It needs ``max_plate_nesting == 0``
        and every latent site of a step to depend on the previous state only (not on another
        latent site of the same step; not checked). ``method="genealogy"`` follows the ancestral
        lines of particles drawn by the final weights (path-space smoothing: cheap, but the
        lines coalesce, so early times have few distinct values); index resamplers only.
        ``method="rejection"`` draws from the same backward kernel as ``"ffbs"`` by rejection
        (Douc et al. 2011, with the hybrid fallback of Dau and Chopin 2022): it proposes a parent
        by the parent weights and accepts with probability ``f(x_t | parent) / C`` (``C`` the
        largest transition density, for ``Normal``, ``MultivariateNormal`` and ``Independent`` of
        those); draws still pending after ``max_rounds`` rounds get the exact FFBS draw. Its
        trajectories have exactly the FFBS distribution at ``O(1)`` expected density evaluations
        per draw instead of ``O(N)`` (5-6x faster at ``N = 10^4``); steps with other latent
        distributions use the FFBS draw. Same requirements as ``"ffbs"``.
        See ``docs/math/smc.md#particle-smoothing``.

        Args:
            num_samples: trajectories per filter, ``>= 1``.
            method: ``"ffbs"`` (default), ``"rejection"`` or ``"genealogy"``.
            max_rounds: rejection rounds before the exact fallback (``"rejection"`` only).

        Returns:
            ``{key: (num_samples, T, B, *event)}`` for every state key (labels in their dtype), ``T`` the
            number of steps taken, detached.

        Raises:
            RuntimeError: the engine was built without ``store_history=True``, or has taken no step.
            ValueError: an unknown ``method``, ``num_samples < 1``, ``"genealogy"`` with a resampler
                that draws no ancestors (``OTResampler``), ``"ffbs"``/``"rejection"`` with model plates.
        """
        if not self.store_history:
            raise RuntimeError("SMC.smooth needs the particle history: build the engine with SMC(..., store_history=True)")
        if method not in smoothing.SMOOTHING_METHODS:
            raise ValueError(f"method must be one of {smoothing.SMOOTHING_METHODS}, got {method!r}")
        positive_int("num_samples", num_samples)
        if not self._history:
            raise RuntimeError("SMC has not taken a step; call run(observations) (or init() and step()) before smooth")
        if method in ("ffbs", "rejection") and self.max_plate_nesting:
            raise ValueError(f"method={method!r} needs max_plate_nesting == 0 (got {self.max_plate_nesting}): steps with model plates are not supported")
        has_ancestors = isinstance(self.resampler, Resampler) and self.resampler.draws_ancestors
        return smoothing.smooth(self._history, num_samples, method, self._layout, has_ancestors, max_rounds=max_rounds)

    def get_empirical(self) -> dict[str, dist.Empirical]:
        """The weighted particle approximation of each state tensor, as ``SMCFilter`` returns it.

        Batch shape ``(B,)`` when ``num_filters > 1``, scalar otherwise.
        """
        log_w = self.log_weights if self.num_filters > 1 else self.log_weights[0]
        return {key: dist.Empirical(value, log_w) for key, value in self.state.items()}

    # --- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the filters exactly (``pyro_smc.infer.smc.checkpoint``):
        the particles, the weights, the step records, the smoothing history, the step count, the
        model's (and guide's) plain attributes (scalars such as a step counter, and cached
        tensors) and the torch RNG state. Model and proposal *parameters* live in Pyro's param
        store; save it alongside (``pyro.get_param_store().get_state()``). Tensors are detached:
        a resumed run continues the values, not the autograd graph."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any], restore_rng: bool = True) -> None:
        """Restores :meth:`state_dict` into an ``SMC`` built with the same settings and model class;
        with ``restore_rng`` the filters continue bit-identically."""
        checkpoint.load_state_dict(self, state, restore_rng)
