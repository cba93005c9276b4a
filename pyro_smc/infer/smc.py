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

**Stop-gradient (Fisher-identity) mode.** With an index resampler built with
``gradient="stop_gradient"`` (``SMC`` reads the resampler's ``gradient`` attribute; see
:attr:`SMC.score_function`) the forward pass is unchanged bit for bit, but every proposal draw
is detached (no pathwise gradient) and each particle's log-weight gains
``log q(x) - stop_grad(log q(x))`` for each proposal site (guide sites; model latent sites the
guide does not sample, for which ``q = f``), zero in value. Autodiff of ``log_evidence`` then
returns ``G = sum_i w_T^i d log p(x^i_{1:T}, y_{1:T})`` over the particles' ancestral paths
(Scibior and Wood, 2021), which reaches parameters acting only through discrete draws (a
switching probability). What is unbiased: ``E[Z_hat G] = dZ/dtheta`` exactly, so
``E[(Z_hat / Z) G] = d log Z / d theta`` (the exact score); ``E[G]`` itself is biased for the
score (a ratio of estimates; the bias is ``O(1/N)``). Proposal parameters get zero gradient in
this mode, and ``NonReparameterizedGradientWarning`` is not raised.
See ``docs/math/smc.md#stop-gradient-resampling``.

**Marginal stop-gradient mode.** With ``gradient="marginal_stop_gradient"`` (same resampler
output) each step after the first replaces the single-ancestor score by that of the marginal
transition density: the log-weight becomes ``stop_grad(log w_{t-1}^i) + log omega_t^i + m_i -
stop_grad(m_i)``, ``m_i = log sum_j w_{t-1}^j f(x_t^i | x_{t-1}^j)`` over all particle pairs of a
filter (one vectorised ``log_prob`` per latent site; ``O(B N^2)`` time and memory per step). The
forward pass is again unchanged, ``E[Z_hat G] = dZ/dtheta`` still holds exactly, and the variance
of ``G`` grows far more slowly with ``T`` (Poyiadjis, Doucet and Singh, 2011). Bootstrap filters
only, ``max_plate_nesting == 0``, and every latent site must depend on the previous state only;
otherwise ``ValueError``. See ``docs/math/smc.md#marginal-stop-gradient``.

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

import contextlib
import math
import warnings
from typing import Callable

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.nn import PyroModule
from torch import Tensor
from tqdm.auto import tqdm

from pyro_smc.gp import pinned_posteriors
from pyro_smc.infer.model_state import plain_attributes
from pyro_smc.infer.smc_checks import (
    NonReparameterizedGradientWarning,
    ParticleDegeneracyWarning,
    check_finite_args,
    check_marginal_supported,
    check_observation_dtype,
    check_positive_int,
    check_resampler,
    discrete_state_keys,
    is_missing,
    latent_kept_outside_state,
    warn_degenerate_weights,
    warn_non_reparameterized,
    warn_untrainable_proposal,
)
from pyro_smc.infer import smc_smoothing as smoothing
from pyro_smc.infer.smc_checkpoint import SMCCheckpointMixin
from pyro_smc.infer.smc_observations import fill_missing, observation_schedule
from pyro_smc.infer.smc_scores import ScoreFunctionMixin
from pyro_smc.infer.smc_weights import (
    ParticleLayout,
    SMCFailedError,
    centred_increment,
    failure,
    log_weight_terms,
    score_terms,
)
from pyro_smc.ops.results import SMCResult
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.ops.weights import all_finite
from pyro_smc.ops.weights import ess as _ess
from pyro_smc.resamplers import Resampled, Resampler, SystematicResampler, resample
from pyro_smc.tracing import check_observed_shapes, detach_latent_draws, is_latent, is_scored, module_context, replay_where

__all__ = ["SMC", "SMCState", "SMCFailedError", "NonReparameterizedGradientWarning", "ParticleDegeneracyWarning"]


class SMCState(dict):
    """The particle state: a dict of tensors that only the model may write."""

    def __init__(self):
        super().__init__()
        self._locked = False

    @contextlib.contextmanager
    def _lock(self):
        self._locked = True
        try:
            yield
        finally:
            self._locked = False

    def __setitem__(self, key, value):
        if self._locked:
            raise RuntimeError("Guide cannot write to SMC state; only the model may")
        super().__setitem__(key, value)


class SMC(ScoreFunctionMixin, SMCCheckpointMixin):
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
        state: the particle state (:class:`SMCState`).
        log_weights: normalised log-weights, shape ``(B, N)``.
        log_evidence: ``log Z_hat``, shape ``(B,)``, differentiable.
        ess: effective sample size after the last weighting, in ``[1, N]``, shape ``(B,)``.
        filtering_means: dict of ``(T, B, *event)`` weighted means per state key, one row per
            ``step`` (taken before resampling), in the weights' dtype; for a 0/1 label the
            filtering probability of 1 (see ``docs/engines/smc.md#discrete-latent-state``).
        ess_history: ``(T, B)``; resampled: ``(T, B)`` bool.
        log_evidence_increments: ``(T, B)`` per-step terms of ``log_evidence``.
        result: all of the above as a typed :class:`~pyro_smc.ops.results.SMCResult`, plus
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
        self.num_particles = check_positive_int("num_particles", num_particles)
        self.num_filters = check_positive_int("num_filters", num_filters)
        if isinstance(max_plate_nesting, bool) or not isinstance(max_plate_nesting, int) or max_plate_nesting < 0:
            raise ValueError(f"max_plate_nesting must be an integer >= 0, got {max_plate_nesting!r}")
        if not (isinstance(ess_threshold, (int, float)) and 0 < ess_threshold <= 1):
            raise ValueError(f"ess_threshold must lie in (0, 1], got {ess_threshold!r}")
        for name, obj in (("model", model), ("guide", guide)):
            if obj is not None and not (callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))):
                raise ValueError(f"{name} must have init(state, ...) and step(state, ...) methods")
        if resampler is not None:
            check_resampler(resampler)
        self.model = model
        self.guide = guide
        self.resampler = resampler if resampler is not None else SystematicResampler()
        self.ess_threshold = float(ess_threshold)
        self.max_plate_nesting = max_plate_nesting
        # Fixed for the engine's life; read several times per step.
        self._layout = ParticleLayout(self.num_filters, self.num_particles, self.max_plate_nesting)
        self.progress_bar = bool(progress_bar)
        self.store_history = bool(store_history)
        self.state = SMCState()
        self._reset()

    # --- public loop --------------------------------------------------------------------------
    @property
    def _particle_shape(self) -> tuple[int, ...]:
        return self._layout.particle_shape

    def _reset(self) -> None:
        self.state = SMCState()
        self._t = 0
        self._initialized = False
        self.log_weights: Tensor | None = None
        self.log_evidence: Tensor | None = None
        self.ess: Tensor | None = None
        self._weighted: tuple[dict, Tensor] | None = None
        self._means: dict[str, list[Tensor]] = {}
        self._ess_history: list[Tensor] = []
        self._resampled: list[Tensor] = []
        self._increments: list[Tensor] = []
        # Per step, whether the resampler's inner solve converged (None: it solves nothing).
        self._converged: list[Tensor] | None = None
        self._step_converged: Tensor | None = None
        # log p_hat of the scoring since the last recorded step (an init's term joins step 0).
        self._unrecorded_increment: Tensor | None = None
        self._warned_sites: set[str] = set()
        # State keys holding a discrete-support site's value (float-coded labels): resampled by
        # copying an ancestor, never averaged. Kept for the run: a label drawn once stays one.
        self._discrete_keys: set[str] = set()
        self._dtype_checked = False
        self._warned_proposal = False
        # Per step, what smooth() needs (store_history); the record of the step being taken.
        self._history: list[dict] = []
        self._pending_record: dict | None = None
        mpn = self.max_plate_nesting
        self._block = poutine.block(hide_types=["sample"])
        self._has_modules = isinstance(self.model, PyroModule) or isinstance(self.guide, PyroModule)
        self._plates = [pyro.plate("particles", self.num_particles, dim=-1 - mpn)]
        if self.num_filters > 1:
            self._plates.insert(0, pyro.plate("filters", self.num_filters, dim=-2 - mpn))

    def init(self, *args, **kwargs) -> SMC:
        """Starts new filters: runs ``model.init`` (and ``guide.init``) on fresh particles."""
        self._reset()
        check_finite_args(args, kwargs, "init")
        self._propagate(self.model.init, self.guide.init if self.guide is not None else None, args, kwargs, "init")
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
        missing = is_missing(args)
        args, observed = fill_missing(args, missing)
        check_finite_args(args[1:] if missing else args, kwargs, f"time step {self._t}")
        return self._step(args, kwargs, missing, observed)

    def _step(self, args, kwargs, predict_only: bool = False, observed: Tensor | None = None, active: Tensor | None = None) -> SMC:
        # active: (B,) bool, the filters whose observation is scored at this step (None: all).
        if not self._initialized:
            raise RuntimeError("SMC.step called before SMC.init")
        where = f"time step {self._t}"
        partial = None if observed is None else (args[0], observed, where)
        proposes = not predict_only and partial is None
        guide_step = self.guide.step if self.guide is not None and proposes else None
        if self.guide is not None and not proposes:
            self._advance_guide(args, kwargs)
        self._propagate(self.model.step, guide_step, args, kwargs, where, predict_only, partial, active)
        if self.log_weights is None:
            raise ValueError(
                f"at {where}: model.init and model.step sampled no site and wrote no state, so there is nothing to filter; "
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
            for step in tqdm(schedule, desc="SMC", disable=not self.progress_bar, leave=False):
                # Observations were checked above, all at once.
                self._step((step.y,) + args, kwargs, step.predict_only, step.observed, step.active)
        warn_degenerate_weights(self.ess_history, self.num_particles)
        return self

    # --- results ------------------------------------------------------------------------------
    @property
    def filtering_means(self) -> dict[str, Tensor]:
        return {key: torch.stack(values) for key, values in self._means.items()}

    @property
    def ess_history(self) -> Tensor:
        return torch.stack(self._ess_history)

    @property
    def resampled(self) -> Tensor:
        return torch.stack(self._resampled)

    @property
    def log_evidence_increments(self) -> Tensor:
        """``(T, B)``: ``log p_hat(y_t | y_{1:t-1})`` per step; their sum over ``T`` is ``log_evidence``."""
        return torch.stack(self._increments)

    @property
    def result(self) -> SMCResult:
        """A snapshot of the run so far as an :class:`~pyro_smc.ops.results.SMCResult`.

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
        if not self._ess_history:
            raise RuntimeError("SMC has not taken a step; call run(observations) or init() and step()")
        return SMCResult(
            log_evidence=self.log_evidence,
            log_evidence_increments=self.log_evidence_increments,
            filtering_means=self.filtering_means,
            ess=self.ess_history,
            resampled=self.resampled,
            resampler_converged=None if self._converged is None else torch.stack(self._converged),
        )

    @property
    def weighted_particles(self) -> tuple[dict[str, Tensor], Tensor]:
        """The particles and normalised log-weights ``(B, N)`` after the last reweighting, before any
        resampling. For posterior summaries prefer these to ``state``: resampling only adds noise,
        and OT resampling also shrinks the cloud (its barycentric map has bias ``O(epsilon)``)."""
        if self.log_weights is None:
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
        check_positive_int("num_samples", num_samples)
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

    # --- one step -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _step_context(self):
        # The handlers are built once (in _reset) and re-entered each step: building them costs
        # more than the rest of a small step's bookkeeping.
        modules = module_context(self.model, self.guide) if self._has_modules else contextlib.nullcontext()
        with self._block, modules, contextlib.ExitStack() as stack:
            for plate in self._plates:
                stack.enter_context(plate)
            yield stack

    def _propagate(self, model_fn, guide_fn, args, kwargs, where: str, predict_only: bool = False, partial=None, active=None) -> None:
        score_function = self.score_function
        # The marginal estimator needs the previous weights; init (and a step before any weights)
        # scores its draws along the path, which is the same thing for a parentless draw.
        marginal = score_function and self.marginal and torch.is_grad_enabled() and self.log_weights is not None
        if score_function and self.marginal:
            check_marginal_supported(self.guide, self.max_plate_nesting)
        if marginal:
            before = (dict(self.state), plain_attributes(self.model))
        # The unbatched state: step_record adds the filter dim itself.
        parent = (dict(self.state), self.log_weights) if self.store_history and self.log_weights is not None else None
        with self._step_context() as stack:
            if score_function:
                # Inside the plates, outside the traces: the traces record the detached draws.
                stack.enter_context(detach_latent_draws())
            guide_trace, replay = None, contextlib.nullcontext()
            try:
                # poutine.trace() as a context manager: get_trace would copy the trace each step.
                if guide_fn is not None:
                    with self.state._lock(), poutine.trace() as tracer:
                        guide_fn(self.state, *args, **kwargs)
                    guide_trace = tracer.trace
                    if active is None:
                        model_fn = poutine.replay(model_fn, trace=guide_trace)
                    else:
                        # Filters that observe nothing here move by the model's own transition.
                        replay = replay_where(guide_trace, active, 1 + self.max_plate_nesting)
                with replay, poutine.trace() as tracer:
                    model_fn(self.state, *args, **kwargs)
                model_trace = tracer.trace
            except ValueError as error:
                if "collide" not in str(error):
                    raise
                raise ValueError(
                    f"at {where}: a model plate collides with the particle plate at dim "
                    f"{-1 - self.max_plate_nesting}; set max_plate_nesting (now {self.max_plate_nesting}) "
                    f"to the number of plates the model nests inside a step"
                ) from error
        if torch.is_grad_enabled() and not score_function:
            warn_non_reparameterized(model_trace, guide_trace, where, self._warned_sites)
        elif guide_trace is not None and torch.is_grad_enabled() and not self._warned_proposal:
            # Checked at the first step the guide samples anything (its init usually does not).
            self._warned_proposal = warn_untrainable_proposal(guide_trace, self.resampler.gradient)
        self._check_sites(model_trace, guide_trace, args, where, predict_only)
        terms = log_weight_terms(model_trace, guide_trace, self._layout, predict_only, partial, active)
        if self.store_history and where != "init":
            self._pending_record = smoothing.step_record(model_trace, self.state, parent, self._layout)
        if marginal:
            score = self._marginal_scores(model_fn, model_trace, before, args, kwargs, where)
        else:
            score = score_terms(model_trace, guide_trace, self._layout, active) if score_function and torch.is_grad_enabled() else None
        self._check_state(where)
        if not terms:
            # Nothing was scored (e.g. an init that only sets up bookkeeping, a predict-only step).
            if self.log_weights is None and self.state:
                self._init_weights(next(iter(self.state.values())))
            if self.log_weights is not None:
                if score is not None:
                    self._add_scores(score)
                self._record(where)
            return
        increment, offset = centred_increment(terms, self._layout)
        if score is not None:
            # Zero in value (so the forward numbers are unchanged bit for bit), the scores in autograd.
            increment = increment + score
        if self.log_weights is None:
            self._init_weights(increment)
        joint = self.log_weights + increment
        log_norm = torch.logsumexp(joint, dim=-1)
        if not all_finite(log_norm):
            raise failure(terms, self._layout, where)
        if active is not None:
            # A filter whose observation is masked scored nothing (the guide was not called): its
            # log_norm is 0 up to rounding; exactly 0 in value keeps its weights and evidence.
            log_norm = torch.where(active, log_norm, log_norm - log_norm.detach())
        self.log_weights = joint - log_norm.unsqueeze(-1)
        increment = log_norm + offset
        self.log_evidence = self.log_evidence + increment
        pending = self._unrecorded_increment
        self._unrecorded_increment = increment if pending is None else pending + increment
        self._record(where)

    def _advance_guide(self, args: tuple, kwargs: dict) -> None:
        """Calls the guide at a step where it cannot propose (a missing or partly missing
        observation), its draws discarded, so that its own bookkeeping (a step counter, a hidden
        state) stays in step with the model's. It gets the observation with missing entries set
        to zero, as the filters without an observation get theirs in a batch of sequences."""
        y = args[0] if args else None
        if isinstance(y, Tensor) and y.is_floating_point():
            args = (torch.nan_to_num(y, nan=0.0),) + tuple(args[1:])
        with self._step_context(), self.state._lock():
            self.guide.step(self.state, *args, **kwargs)

    def _init_weights(self, like: Tensor) -> None:
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        shape = (self.num_filters, self.num_particles)
        self.log_weights = torch.full(shape, -math.log(self.num_particles), dtype=dtype, device=like.device)
        self.log_evidence = torch.zeros(self.num_filters, dtype=dtype, device=like.device)

    def _check_sites(self, model_trace, guide_trace, args: tuple, where: str, predict_only: bool) -> None:
        """What the traces say: the guide's sites are the model's, discrete state keys, latents
        kept outside the state, and the observation's dtype (see :mod:`~pyro_smc.infer.smc_checks`)."""
        if guide_trace is not None:
            extra = [name for name, site in guide_trace.nodes.items() if is_scored(site) and name not in model_trace.nodes]
            if extra:
                own = [name for name, site in model_trace.nodes.items() if is_latent(site)]
                raise ValueError(
                    f"at {where}: the guide samples site '{extra[0]}', which the model's step does not have (its latent "
                    f"sites: {own}); the guide must name its sites as the model does at every step"
                )
        check_observed_shapes(model_trace, self._particle_shape, where)
        self._discrete_keys |= discrete_state_keys(model_trace, self.state)
        kept = latent_kept_outside_state(model_trace, self.state, self.model)
        if kept is not None:
            site, attribute = kept
            raise ValueError(
                f"at {where}: the model keeps latent site '{site}' as self.{attribute}, not in state: SMC resamples only "
                f"state, so that value is never resampled with its particle and every estimate would be wrong; store it as "
                f"state['{attribute}'] = pyro.sample(...) and read it from state in the next step"
            )
        if not self._dtype_checked and where != "init" and args:
            # Checked once, at the first step whose observation reaches a site (scored or not).
            self._dtype_checked = check_observation_dtype(model_trace, args[0], where)

    def _check_state(self, where: str) -> None:
        shape = self._particle_shape
        for key, value in self.state.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"state['{key}'] must be a tensor, got {type(value).__name__} at {where}")
            if tuple(value.shape[: len(shape)]) != shape:
                raise ValueError(
                    f"state['{key}'] has shape {tuple(value.shape)} at {where}, but every state tensor must have "
                    f"leading particle dims {shape}; sample it inside the particle plate (or expand it)"
                )

    def _batched_state(self) -> dict[str, Tensor]:
        return {key: self._layout.batched_particles(value) for key, value in self.state.items()}

    def _record(self, where: str) -> None:
        log_w = self.log_weights
        # ESS of normalised weights lies in [1, N] (Cauchy-Schwarz); rounding in the normalisation
        # may step past either end by an ulp, which a threshold comparison must not see.
        ess = _ess(log_w.detach()).clamp(1, self.num_particles)
        self.ess = ess
        if where != "init":
            w = log_w.exp()
            finite = None
            for key, value in self._batched_state().items():
                # Every key, labels included: the mean of a 0/1 label is its filtering probability.
                flat = value.reshape(value.shape[:2] + (-1,))
                mean = (w.unsqueeze(-2) @ flat.to(w.dtype)).squeeze(-2)
                ok = torch.isfinite(mean).all()
                finite = ok if finite is None else finite & ok
                self._means.setdefault(key, []).append(mean.reshape((self.num_filters,) + value.shape[2:]))
            if finite is not None and not bool(finite):
                bad = [key for key, values in self._means.items() if not bool(torch.isfinite(values[-1]).all())]
                raise ValueError(
                    f"at {where}: the filtering mean of state['{bad[0]}'] is not finite: a particle's state holds NaN or inf "
                    "(check the model's transition at that step)"
                )
            self._ess_history.append(ess)
            pending = self._unrecorded_increment
            self._increments.append(torch.zeros_like(self.log_evidence) if pending is None else pending)
            self._unrecorded_increment = None
        # References, not copies: resampling replaces the state tensors instead of mutating them.
        self._weighted = (dict(self.state), log_w)
        record = None
        if self._pending_record is not None:
            record, self._pending_record = self._pending_record, None
            smoothing.record_weighted(record, self.state, log_w, self._layout)
            self._history.append(record)
        need = ess < self.ess_threshold * self.num_particles
        self._step_converged = None
        if self.state and bool(need.any()):
            ancestors = self._resample(need, where)
            if record is not None:
                smoothing.record_resampling(record, need, ancestors, self._layout)
        if where != "init":
            self._resampled.append(need if self.state else torch.zeros_like(need))
            if self._step_converged is not None and self._converged is None:
                # The first solve seen: earlier steps solved nothing, so they count as converged.
                self._converged = [torch.ones_like(need) for _ in self._resampled[:-1]]
            if self._converged is not None:
                self._converged.append(torch.ones_like(need) if self._step_converged is None else self._step_converged)

    def _resample(self, need: Tensor, where: str) -> Tensor | None:
        particles = self._batched_state()
        # A float-coded label (dist.Bernoulli's 0./1.) travels as an integer tensor, which every
        # resampler copies from one ancestor instead of averaging it.
        labels = {key: particles[key].dtype for key in self._discrete_keys if key in particles and particles[key].is_floating_point()}
        for key in labels:
            particles[key] = particles[key].long()
        if bool(need.all()):
            out = self._call_resampler(particles, self.log_weights, where)
            new, new_log_w = out.particles, out.log_weights
        else:
            idx = need.nonzero().squeeze(-1)
            out = self._call_resampler({k: v[idx] for k, v in particles.items()}, self.log_weights[idx], where)
            new = {k: particles[k].index_put((idx,), out.particles[k]) for k in particles}
            new_log_w = self.log_weights.index_put((idx,), out.log_weights)
        self.log_weights = new_log_w
        for key, value in new.items():
            if key in labels:
                value = value.to(labels[key])
            dict.__setitem__(self.state, key, value if self.num_filters > 1 else value.squeeze(0))
        # An iterative resampler (OTResampler) reports its solve, one entry per filter it saw.
        if out.diagnostics is not None:
            converged = torch.ones_like(need)
            self._step_converged = converged.masked_scatter(need, out.diagnostics.converged.reshape(-1).to(need.device))
        return out.ancestors

    def _call_resampler(self, particles: dict[str, Tensor], log_weights: Tensor, where: str) -> Resampled:
        """Calls the resampler, prefixing its Sinkhorn convergence warnings with ``where``.

        The solver cannot know the time step; the user needs it to find the hard step. Only
        resamplers that may emit such warnings are wrapped: ``catch_warnings`` costs a few
        microseconds and, by mutating the warning filters, resets Python's once-per-location
        bookkeeping of every warning.
        """
        if not (isinstance(self.resampler, Resampler) and self.resampler.reports_convergence):
            return resample(self.resampler, particles, log_weights)
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", SinkhornConvergenceWarning)
                return resample(self.resampler, particles, log_weights)
        finally:
            # Re-emitted after the block has restored the user's filters, so they apply (an
            # "error" filter raises here, pytest.warns sees them); also when the resampler raised.
            for record in caught:
                if issubclass(record.category, SinkhornConvergenceWarning):
                    warnings.warn(SinkhornConvergenceWarning(f"at {where}: {record.message}"), stacklevel=2)
                else:
                    warnings.warn_explicit(record.message, record.category, record.filename, record.lineno, source=record.source)
