"""Differentiable sequential Monte Carlo: the successor of ``pyro.infer.SMCFilter``.

See ``docs/math/smc.md#one-step-of-the-filter`` and ``docs/math/smc.md#log-evidence-estimate`` and
``docs/math/smc.md#effective-sample-size-and-adaptive-resampling``.

One step at time ``t`` reads as its equation::

    propose x_t ~ q(. | x_{t-1}, y_t)                          (reparameterised where possible)
    log omega = log f(x_t | x_{t-1}) + log g(y_t | x_t) - log q(x_t | x_{t-1}, y_t)
    log p_hat(y_t | y_{1:t-1}) = logsumexp(log w_{t-1} + log omega)
    log w_t = log w_{t-1} + log omega - log p_hat(y_t | y_{1:t-1})
    resample the filters whose ESS fell below ess_threshold * N

The log-weights and the log-evidence keep their autograd graph: differentiable through
:class:`~pyro_smc.resamplers.OTResampler`, or by the Fisher identity with an index resampler built
with ``gradient="stop_gradient"`` (:mod:`~pyro_smc.infer.smc.scores`). A step is strung from its
phases in :mod:`~pyro_smc.infer.smc.advance`.

Reference:
    Corenflos, Thornton, Deligiannidis, Doucet (2021). Differentiable particle filtering via
    entropy-regularized optimal transport. ICML.

    Scibior, Wood (2021). Differentiable particle filtering without modifying the forward pass.
    arXiv:2106.10314.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.smc import checkpoint, first_stage, smoothing
from pyro_smc.infer.smc.auxiliary import look_ahead_of
from pyro_smc.infer.smc.qmc import InverseCDFDraws
from pyro_smc.infer.smc.advance import StepSettings, advance
from pyro_smc.infer.smc.compiled import CompiledStep
from pyro_smc.infer.smc.convergence import ConvergenceReport
from pyro_smc.infer.smc.checks import (
    NonReparameterizedGradientWarning,
    ParticleDegeneracyWarning,
    check_finite_args,
    check_first_stage,
    check_programs,
    DegeneracyMonitor,
    check_settings,
    check_quantile_request,
    check_smooth_request,
)
from pyro_smc.infer.smc.importance import ParticleLayout, SMCFailedError
from pyro_smc.infer.smc.replay_loop import LoopPlan, run_replayed
from pyro_smc.infer.smc.result import SMCResult, StepRecord, stack_records
from pyro_smc.infer.smc.schedule import fill_missing, observation_schedule
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.infer.smc.trace_checks import TraceChecks
from pyro_smc.infer.smc.step import StepInputs, StepProgram
from pyro_smc.observations import step_observation
from pyro_smc.progress import progress, progress_enabled
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.resamplers import GradientEstimator, Resampler, SystematicResampler, estimator_of
from pyro_smc.resamplers.index import index_scheme

__all__ = ["SMC", "SMCState", "SMCFailedError", "NonReparameterizedGradientWarning", "ParticleDegeneracyWarning"]


class SMC:
    r"""Differentiable, vectorised particle filter over Pyro ``init``/``step`` models.

    The first four arguments are positional as in ``SMCFilter(model, guide, num_particles, max_plate_nesting)``.

    Args:
        model: object with ``init(state, *args)`` and ``step(state, *args)`` Pyro methods.
        guide: proposal with the same methods, or ``None`` for the bootstrap filter.
        num_particles: particles per filter, ``N >= 1`` (required).
        max_plate_nesting: number of plates the model uses inside a step (as in SMCFilter).
        resampler: a resampler from :mod:`pyro_smc.resamplers`; default systematic. Its
            ``gradient=`` picks the gradient estimator (:attr:`score_function`, :attr:`marginal`).
        ess_threshold: resample a filter when its ESS falls below ``ess_threshold * N``;
            in ``(0, 1]``.
        num_filters: independent filters ``B`` run in one vectorised pass, on one sequence or
            one each on a batch of ``B`` sequences (``run(..., batched=True)``).
        progress_bar: a tqdm bar in :meth:`run` and :meth:`smooth`: ``None`` (default) in
            interactive use only (a terminal or a Jupyter kernel with widgets; never under
            pytest or ``CI``), ``True`` always, ``False`` never (:mod:`pyro_smc.progress`).
        store_history: keep, per step, what :meth:`smooth` needs (the weighted particles, their
            parents and the latent sites' distributions; memory :math:`O(T B N)`; off by default).
        compile: replay a recording of a regular step instead of re-running the program
            (``docs/engines/smc.md#the-compiled-step``): ``None`` when safe, else silently on
            Pyro's handlers; ``True`` the same with a warning; ``False`` never.
        auxiliary: the auxiliary particle filter: resample at the start of each step by the
            weights times the guide's (else the model's) ``look_ahead(state, y, *args)``, the
            per-particle :math:`\log \eta_t(x_{t-1})`, and divide the new weights by it
            (``docs/engines/smc.md#auxiliary-particle-filter``).
        qmc: sequential quasi-Monte Carlo: resample every filter at the start of each step
            along the Hilbert curve of the particles by scrambled Sobol points, whose other
            coordinates draw the step's latent sites by their inverse CDFs (``ess_threshold``
            unused; an index resampler, whose ``gradient=`` is kept; not compiled;
            ``docs/engines/smc.md#sequential-quasi-monte-carlo``).

    Attributes:
        state: the particle state (:class:`~pyro_smc.infer.smc.state.SMCState`).
        ess: effective sample size after the last weighting, in ``[1, N]``, shape ``(B,)``;
            the run's results are the properties below (:attr:`result` holds them all).

    Raises:
        TypeError: ``num_particles`` is not given.
        ValueError: a setting is out of range, or the model or guide lacks ``init``/``step``.
            While running, naming the time step: a latent value kept on ``self`` instead of in
            ``state``, an observation of the wrong dtype, nothing sampled, a non-finite mean.

    Warns:
        ParticleDegeneracyWarning: the weights collapsed onto about one particle at a fifth of the
            steps or more, or in half the filters at one step (at the end of :meth:`run`; after
            steps taken one by one, when ``log_evidence`` or ``result`` is read).
        UserWarning: a guide with parameters under ``gradient="stop_gradient"`` (zero gradient).

    Example:
        The log-evidence estimate lies near the exact Kalman value :math:`\log p(y_{1:T})`:

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
        progress_bar: bool | None = None,
        store_history: bool = False,
        compile: bool | None = None,
        auxiliary: bool = False,
        qmc: bool = False,
    ):
        if num_particles is None:
            raise TypeError("SMC needs num_particles: SMC(model, guide, num_particles, max_plate_nesting) or SMC(model, num_particles=N)")
        check_settings(num_particles, num_filters, max_plate_nesting, ess_threshold, resampler)
        check_programs(model, guide)
        check_first_stage(auxiliary, qmc, resampler)
        self.model = model
        self.guide = guide
        self.num_particles = int(num_particles)
        self.num_filters = int(num_filters)
        self.max_plate_nesting = int(max_plate_nesting)
        self.resampler = resampler if resampler is not None else SystematicResampler()
        self.ess_threshold = float(ess_threshold)
        self.progress_bar = progress_bar
        progress_enabled(progress_bar)  # its TypeError, at construction
        self.store_history = bool(store_history)
        # Fixed for the engine's life; read several times per step.
        self._layout = ParticleLayout(self.num_filters, self.num_particles, self.max_plate_nesting)
        self._program = StepProgram(model, guide, self._layout)
        self._compiled = CompiledStep(compile)
        self.auxiliary, self.qmc = bool(auxiliary), bool(qmc)
        self._look_ahead = look_ahead_of(model, guide) if self.auxiliary else None
        self._qmc_dims: dict[str, int] = {}  # the QMC coordinates init and a step spend
        self._reset()

    def _reset(self) -> None:
        """Forgets the run: particles, weights, records, history and what the checks remember."""
        self.state = SMCState(self._state_log_weights)
        self._t = 0
        self._initialized = False
        self._weights: ParticleWeights | None = None
        self.ess: Tensor | None = None
        self._weighted: tuple[dict, Tensor] | None = None
        self._records: list[StepRecord] = []
        self._history: list[dict] = []  # per step, what smooth() needs (store_history)
        self._checks = TraceChecks(self.model, self._layout.particle_shape)
        self._degeneracy = DegeneracyMonitor(self.num_particles)
        self._compiled.reset()
        if self.qmc and self._compiled.enabled:
            self._compiled.give_up("qmc=True draws the latent sites by a handler, which a recording cannot replay")
        self._report: ConvergenceReport | None = None  # set by run() for its steps

    @property
    def score_function(self) -> bool:
        r"""Whether the resampler asks for a Fisher-identity gradient (``gradient="stop_gradient"``
        or ``"marginal_stop_gradient"``): detached draws, each proposal site adding
        :math:`\log q - \operatorname{stop\_grad}(\log q)` to the log-weight (``docs/math/smc.md#stop-gradient-resampling``)."""
        return estimator_of(self.resampler) in (GradientEstimator.SCORE, GradientEstimator.MARGINAL_SCORE)

    @property
    def marginal(self) -> bool:
        r"""Whether the resampler asks for the :math:`O(N^2)` marginal estimator: the log-weight gets
        :math:`m_i - \operatorname{stop\_grad}(m_i)`, :math:`m_i = \log \sum_j w_{t-1}^j f(x_t^i \mid x_{t-1}^j)`, in place of
        the single-ancestor score (``docs/math/smc.md#marginal-stop-gradient``)."""
        return estimator_of(self.resampler) is GradientEstimator.MARGINAL_SCORE

    def init(self, *args, **kwargs) -> SMC:
        """Starts new filters: runs ``model.init`` (and ``guide.init``) on fresh particles."""
        self._reset()
        check_finite_args(args, kwargs, "init")
        inputs = StepInputs(args, kwargs, None)
        draws = self._qmc_draws("init", inputs) if self.qmc else None
        self._advance(self.model.init, self.guide.init if self.guide is not None else None, inputs, draws)
        self._initialized = True
        return self

    def step(self, *args, **kwargs) -> SMC:
        """Advances every filter by one time step: propose, reweight, maybe resample.

        An observation (the first positional argument) that is ``None`` or all-NaN makes the step
        predict-only: the model's transition moves the particles and the observation's site is
        not scored (weights and ``log_evidence`` unchanged unless another observed site or a
        ``pyro.factor`` of the step is, which is scored as usual); a partly-NaN one is scored on its observed entries (the site must factorise
        over them, ``Normal(...).to_event(1)``) with the model's transition proposing. At both the
        guide is still called, missing entries set to zero, so its bookkeeping keeps step, and its
        draws are discarded. An infinite observation, or a NaN in another argument, is an error.
        ``step()`` with no argument is a regular step, as for ``SMCFilter``: the model scores
        whatever sites it observes itself (data it holds, as Pyro's ``CompartmentalModel`` does).
        See ``docs/math/smc.md#missing-observations``.
        """
        y = args[0] if args else None
        # No argument at all is a regular step, as under SMCFilter: the model scores the sites
        # it observes itself (data it holds); only an explicit None is a missing observation.
        observation = step_observation(y, self._t) if args and (y is None or isinstance(y, Tensor)) else None
        missing = observation is not None and observation.missing
        observed = None if observation is None else observation.observed
        args = fill_missing(args, observed)
        if observation is None:
            check_finite_args(args, kwargs, f"time step {self._t}")
        else:
            check_finite_args(args[1:], kwargs, f"time step {self._t}", first=1)
        return self._step(StepInputs(args, kwargs, self._t, missing, observed))

    def _step(self, inputs: StepInputs) -> SMC:
        if not self._initialized:
            raise RuntimeError("SMC.step called before SMC.init")
        proposes = not inputs.predict_only and inputs.observed is None
        guide_step = self.guide.step if self.guide is not None and proposes else None
        if self.guide is not None and not proposes:
            self._program.advance_guide(self.state, inputs)
        draws = None
        if (self.auxiliary or self.qmc) and self._weights is not None and self.state:
            draws = first_stage.run(self, inputs)
        elif self.qmc:
            draws = self._qmc_draws("step", inputs)
        self._advance(self.model.step, guide_step, inputs, draws)
        if self._weights is None:
            raise ValueError(
                f"at {inputs.where}: model.init and model.step sampled no site and wrote no state, so there is nothing to filter; "
                "a step must sample its latent site into state (state['x'] = pyro.sample(...)) and observe y"
            )
        self._t += 1
        return self

    def run(self, observations: Tensor, *args, lengths: Tensor | None = None, batched: bool = False, **kwargs) -> SMC:
        r"""``init(*args)`` then ``step(observations[t], *args)`` for every leading-dim slice.

        With ``batched=True`` filter ``b`` runs on sequence ``observations[b]`` (shape
        ``(B, T, ...)``, ``B == num_filters``): at step ``t`` the model gets
        ``observations[:, t].unsqueeze(1)``, of shape ``(B, 1, ...)``, which broadcasts against the
        particle dims ``(B, N)`` (with ``num_filters == 1``, ``observations[0, t]``), and
        ``log_evidence[b]`` estimates :math:`\log p(y^b_{1:L_b})`. The steps ``t >= lengths[b]`` and
        NaN rows are predict-only for filter ``b`` alone (padding is never read); a filter that
        observes nothing at a step moves by the model's transition, and a partly-NaN row moves
        every filter by it. The model and guide are called once per step for all filters: they
        must not branch on the observation's values. See
        ``docs/engines/smc.md#trajectories-particle-smoothing-missing-data-batches-of-sequences``
        and ``docs/math/smc.md#batches-of-sequences``.

        Args:
            observations: tensor ``(T, ...)``; with ``batched=True``, ``(B, T, ...)``. NaN entries
                are missing (see :meth:`step`); an infinite entry is an error naming the step.
            *args: further arguments of ``init`` and ``step`` (the same at every step).
            lengths: integer tensor ``(B,)`` of sequence lengths in ``[1, T]`` (``batched=True``
                only); ``None`` means every sequence has all ``T`` steps.
            batched: whether ``observations`` is a batch of ``num_filters`` sequences.
            **kwargs: further keyword arguments of ``init`` and ``step``.

        Returns:
            ``self``, with ``log_evidence`` ``(B,)`` and the per-step histories filled in.

        Raises:
            ValueError: ``observations`` is not a tensor of the shape above, has no time steps or is
                in half precision; ``lengths`` is not an integer ``(B,)`` in ``[1, T]``, or is given
                without ``batched``.

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
        report = ConvergenceReport()
        # From here on every step is regular: the loop of replay_loop may take them over.
        regular_from = len(schedule)
        while regular_from > 0 and _regular(schedule[regular_from - 1]):
            regular_from -= 1
        looped = False
        with pinned_posteriors(self.model, self.guide), progress(desc="SMC", enabled=progress_enabled(self.progress_bar), total=len(schedule)) as bar:
            self.init(*args, **kwargs)
            self._report = report  # after init(), which starts the run afresh
            try:
                t = 0
                while t < len(schedule):
                    step = schedule[t]
                    # Observations were checked above, all at once.
                    self._step(StepInputs((step.y,) + args, kwargs, t, step.predict_only, step.observed, step.active, step.ended, not batched))
                    t += 1
                    bar.update(1)
                    if not looped and t >= regular_from and t < len(schedule) and self._compiled.verified:
                        looped = True  # tried once: a recording the loop cannot take stays step by step
                        done = self._replay_rest(schedule, t, args, kwargs)
                        t += done
                        bar.update(done)
            finally:
                self._report = None
        summary = report.summary(len(schedule))
        if summary is not None:
            warnings.warn(SinkhornConvergenceWarning(summary), stacklevel=2)
        self._check_degeneracy(2)
        return self

    def _replay_rest(self, schedule: list, start: int, args: tuple, kwargs: dict) -> int:
        """Steps ``start, ...`` of a run (all regular) by the compiled loop of
        :mod:`~pyro_smc.infer.smc.replay_loop`; the number taken (0: the run goes on step by step)."""
        scheme = index_scheme(self.resampler)
        weights = self._weights
        if scheme is None or self.auxiliary or self.qmc or self.store_history or weights is None or weights.unreported is not None or not self.state:
            return 0
        step = schedule[start]
        inputs = StepInputs((step.y,) + args, kwargs, start)
        score = self.score_function
        found = self._compiled.loop_inputs(
            self._program,
            self.state,
            weights.log_weights,
            self.ess_threshold * self.num_particles,
            self.model.step,
            None if self.guide is None else self.guide.step,
            inputs,
            score,
            score and torch.is_grad_enabled(),
        )
        if found is None:
            return 0
        recording, values, observation, log_weights_at = found
        plan = LoopPlan(
            recording.function,
            recording.executors,
            tuple(self.state),
            values,
            observation,
            log_weights_at,
            len(recording.term_names) + int(recording.has_score),
            recording.checks,
            self.num_filters,
            scheme,
        )
        done = run_replayed(self, plan, [entry.y for entry in schedule[start:]])
        self._compiled.advance_counters(self._program, done)
        self._t += done
        return done

    # --- one step: propose -> weigh -> summarise -> maybe resample -------------------------------
    def _advance(self, model_fn: Callable, guide_fn: Callable | None, inputs: StepInputs, draws: InverseCDFDraws | None = None) -> None:
        """Takes one step (``inputs.t is None``: ``init``) and keeps what it made."""
        deferred = self.auxiliary or self.qmc
        settings = StepSettings(self._layout, self.resampler, self.ess_threshold, self.store_history, self._compiled, self._report, deferred, draws)
        outcome = advance(settings, self._program, self._checks, self.state, self._weights, model_fn, guide_fn, inputs)
        if draws is not None:
            self._qmc_dims["init" if inputs.t is None else "step"] = draws.used
        if outcome.weights is None:
            return
        self._weights, self.ess, self._weighted = outcome.weights, outcome.ess, outcome.weighted
        if outcome.record is not None:
            self._records.append(outcome.record)
        if outcome.history is not None:
            self._history.append(outcome.history)

    def _qmc_draws(self, kind: str, inputs: StepInputs) -> InverseCDFDraws:
        """SQMC's draws for a step without a first stage (``init``, or no particles yet)."""
        return InverseCDFDraws(None, self._layout, inputs.where, dims=self._qmc_dims.get(kind, 0))

    @property
    def compile_status(self) -> str | None:
        """Why this run is not compiled (``None``: compiled or undecided; ``docs/engines/smc.md#the-compiled-step``)."""
        return self._compiled.reason

    @property
    def log_weights(self) -> Tensor:
        """``(B, N)`` normalised log-weights after the last step.

        Raises:
            RuntimeError: before anything was weighed (``run``, or ``init`` and a ``step``).
        """
        return self._weights_or_raise("log_weights").log_weights

    def _weights_or_raise(self, name: str) -> ParticleWeights:
        if self._weights is None:
            raise RuntimeError(f"SMC.{name}: nothing has been filtered yet; call run(observations), or init() and then step(y)")
        return self._weights

    def _state_log_weights(self) -> Tensor | None:
        # What state._log_weights shows: SMCFilter's layout, (N,) with one filter; None before init.
        if self._weights is None:
            return None
        log_w = self._weights.log_weights
        return log_w[0] if self.num_filters == 1 else log_w

    @property
    def log_evidence(self) -> Tensor:
        r"""``(B,)`` :math:`\log \hat Z` of the steps so far, differentiable.

        Read after steps taken one by one (:meth:`init` and :meth:`step`), it first checks them for
        collapsed weights (:class:`~pyro_smc.infer.ParticleDegeneracyWarning`, once per run), as
        :meth:`run` does after its last step.

        Raises:
            RuntimeError: before anything was weighed, naming what to call.
        """
        log_z = self._weights_or_raise("log_evidence").log_evidence
        if self._report is None:  # not inside run(), which checks once at its end
            self._check_degeneracy(2)
        return log_z

    def _check_degeneracy(self, stacklevel: int) -> None:
        """Feeds the steps taken since the last check to the run's :class:`DegeneracyMonitor`, which
        warns once per run; ``stacklevel`` counts from this method's caller."""
        new = self._records[self._degeneracy.steps :]
        if new:
            self._degeneracy.add(torch.stack([record.ess for record in new]))
        self._degeneracy.warn(stacklevel + 1)

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """The :class:`~pyro_smc.infer.smc.result.StepRecord` of every step so far."""
        return tuple(self._records)

    def _stacked(self) -> SMCResult:
        if not self._records:
            raise RuntimeError("SMC has not taken a step; call run(observations) or init() and step()")
        return stack_records(self._records, self._weights_or_raise("log_evidence").log_evidence)

    @property
    def filtering_means(self) -> dict[str, Tensor]:
        """``{key: (T, B, *event)}`` weighted means of each state entry per step, before resampling,
        in the weights' dtype; for a 0/1 label the filtering probability of 1
        (``docs/engines/smc.md#discrete-latent-state``)."""
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
        r"""``(T, B)``: :math:`\log \hat p(y_t \mid y_{1:t-1})` per step; their sum over ``T`` is ``log_evidence``."""
        return self._stacked().log_evidence_increments

    @property
    def result(self) -> SMCResult:
        """A snapshot of the run so far as an :class:`~pyro_smc.infer.smc.result.SMCResult`.

        Example:
            >>> import torch
            >>> from pyro_smc import SMC
            >>> from pyro_smc.models import LinearGaussianSSM
            >>> ssm = LinearGaussianSSM(
            ...     0.5 * torch.eye(2),
            ...     torch.eye(2),
            ...     torch.eye(2),
            ...     torch.eye(2),
            ...     torch.zeros(2),
            ...     torch.eye(2),
            ... )
            >>> out = SMC(ssm, num_particles=10).run(ssm.simulate(5)[1]).result
            >>> out.log_evidence_increments.shape, out.ess.shape
            (torch.Size([5, 1]), torch.Size([5, 1]))
        """
        result = self._stacked()
        if self._report is None:  # as for log_evidence
            self._check_degeneracy(2)
        return result

    @property
    def weighted_particles(self) -> tuple[dict[str, Tensor], Tensor]:
        r"""The particles and normalised log-weights ``(B, N)`` after the last reweighting, before any
        resampling. For posterior summaries prefer these to ``state``: resampling only adds noise,
        and OT resampling also shrinks the cloud (its barycentric map has bias :math:`O(\epsilon)`)."""
        if self._weighted is None:
            raise RuntimeError("SMC has not been run; call init/step or run first")
        return self._weighted

    def smooth(self, num_samples: int, method: str = "ffbs", max_rounds: int = smoothing.REJECTION_MAX_ROUNDS) -> dict[str, Tensor]:
        r"""Draws ``num_samples`` trajectories per filter from the particle smoother (needs ``store_history=True``).

        ``method="ffbs"`` (forward filtering, backward sampling): each earlier state drawn among the
        particles with probability proportional to weight times :math:`f(x_t \mid x_{t-1})`; any resampler,
        :math:`O(S B N)` per step, no model plates. ``"rejection"``: the same kernel by rejection (Douc
        et al. 2011, with the exact fallback after ``max_rounds``), :math:`O(1)` per draw for Normal/MVN
        transitions. ``"genealogy"``: the ancestral lines (index resamplers only). See
        ``docs/math/smc.md#particle-smoothing``.

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
        check_smooth_request(self.store_history, self._history, method, num_samples, self.max_plate_nesting)
        has_ancestors = isinstance(self.resampler, Resampler) and self.resampler.draws_ancestors
        return smoothing.smooth(
            self._history, num_samples, method, self._layout, has_ancestors, max_rounds=max_rounds, progress_bar=progress_enabled(self.progress_bar)
        )

    def filtering_quantiles(self, probs: Sequence[float], key: str | None = None) -> Tensor:
        """Weighted quantiles of the filtering distribution of a state entry at every step (the
        particles after each step's reweighting, before resampling; needs
        ``store_history=True``).

        Args:
            probs: levels in ``[0, 1]``, e.g. ``(0.05, 0.5, 0.95)``.
            key: the state key (default: the only one).

        Returns:
            ``(len(probs), T, B, *event)``, entry by entry.

        Raises:
            RuntimeError: built without ``store_history=True``, or nothing filtered yet.
            ValueError: a level outside ``[0, 1]``, an unknown key (or none given with several),
                or a key holding integer labels.

        Example:
            >>> import torch
            >>> from pyro_smc import SMC
            >>> from pyro_smc.models import LinearGaussianSSM
            >>> eye = torch.eye(1)
            >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(1), eye)
            >>> _, ys = ssm.simulate(8)
            >>> smc = SMC(ssm, num_particles=500, store_history=True).run(ys)
            >>> smc.filtering_quantiles([0.05, 0.5, 0.95]).shape      # (Q, T, B, d)
            torch.Size([3, 8, 1, 1])
        """
        key, levels = check_quantile_request(self.store_history, self._history, probs, key)
        return smoothing.filtering_quantiles(self._history, levels, key)

    def get_empirical(self) -> dict[str, dist.Empirical]:
        """Each state tensor's weighted particles as ``SMCFilter`` returns them (batch ``(B,)`` if ``B > 1``)."""
        log_w = self.log_weights if self.num_filters > 1 else self.log_weights[0]
        return {key: dist.Empirical(value, log_w) for key, value in self.state.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the filters exactly: particles, weights, step records,
        smoothing history, step count, the model's (and guide's) plain attributes and the torch
        RNG state (``pyro_smc.infer.smc.checkpoint``). Parameters live in Pyro's param store:
        save it alongside. Tensors are detached: a resumed run continues the values, not the graph."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any], restore_rng: bool = True) -> None:
        """Restores :meth:`state_dict` into an ``SMC`` built with the same settings and model class;
        with ``restore_rng`` the filters continue bit-identically."""
        checkpoint.load_state_dict(self, state, restore_rng)


def _regular(step) -> bool:
    """Whether a scheduled step observes every entry of every filter (what the loop takes)."""
    return not step.predict_only and step.observed is None and step.active is None
