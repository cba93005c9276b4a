r"""SMC^2: the sequential posterior of a state-space model's static parameters, with the evidence.

See ``docs/engines/smc2.md``. :math:`N_\theta` parameter particles :math:`\theta^m` with weights
:math:`W^m` each carry a particle filter of :math:`N_x` particles whose estimate
:math:`\hat p(y_{1:t} \mid \theta^m)` is unbiased. At time :math:`t`::

    advance every filter by y_t:     L_t^m = p_hat(y_t | y_{1:t-1}, theta^m)
    evidence increment:              p_hat(y_t | y_{1:t-1}) = sum_m W^m L_t^m
    reweight:                        W^m  <-  W^m L_t^m / p_hat(y_t | y_{1:t-1})
    if ESS(W) < ess_threshold * N_theta: resample the pairs (theta^m, filter^m), then move each
        by particle marginal Metropolis-Hastings steps targeting p_hat(y_{1:t} | theta) p(theta)
    optionally, if the moves accepted too rarely: exchange every filter for one of 2 N_x
        particles, reweighting by the ratio of the new to the old estimate of p(y_{1:t} | theta)

Reference:
    Chopin, Jacob, Papaspiliopoulos (2013). SMC^2: an efficient algorithm for sequential analysis
    of state space models. JRSS B 75(3).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_smc.checks import int_at_least, positive_float, positive_int, unit_interval
from pyro_smc.infer.smc import SMC
from pyro_smc.infer.smc2.filters import InnerFilters, log_evidence
from pyro_smc.infer.smc2.rejuvenation import PROPOSALS, fit_proposal, metropolis_hastings
from pyro_smc.infer.smc2.result import SMC2Result, SMC2StepRecord
from pyro_smc.infer.static_parameters import StaticParameters
from pyro_smc.ops.resample import systematic
from pyro_smc.progress import progress, progress_enabled

__all__ = ["SMC2"]


class SMC2:
    r"""SMC^2 over the ``PyroSample`` static parameters of an ``init``/``step`` Pyro model.

    The parameter particles' filters run as one batched :class:`~pyro_smc.SMC` with
    ``num_filters=num_parameter_particles``; each parameter reaches the model with shape
    ``(num_parameter_particles, 1, *shape)`` and must broadcast against the particles
    ``(num_parameter_particles, num_particles, ...)`` (see :class:`~pyro_smc.infer.smc2.filters.InnerFilters`).

    Args:
        model: a ``PyroModule`` with ``init(state, *args)`` and ``step(state, y, *args)`` whose
            static parameters are ``PyroSample`` attributes with their priors.
        guide: the filters' proposal (as for :class:`~pyro_smc.SMC`), or ``None`` (bootstrap).
        num_parameter_particles: :math:`N_\theta \geq 2`.
        num_particles: :math:`N_x \geq 1`, the state particles of each filter.
        resampler: the filters' resampler (default systematic). The parameter particles are
            always resampled systematically.
        ess_threshold: rejuvenate when the parameter particles' ESS falls below
            ``ess_threshold * num_parameter_particles``; in ``(0, 1]``.
        rejuvenation_steps: Metropolis-Hastings moves per rejuvenation (``0``: resample only).
            Each reruns the filters over every step so far.
        proposal: ``"random_walk"`` (default) or ``"independent"``, a Gaussian fitted to the
            weighted particles in the unconstrained space
            (:class:`~pyro_smc.infer.smc2.rejuvenation.GaussianProposal`).
        proposal_scale: the factor of the fitted covariance's square root (default
            :math:`2.38/\sqrt d` for the random walk, 1 for the independent proposal).
        filter_ess_threshold: the filters' own resampling threshold.
        exchange_below: double ``num_particles`` by an exchange step after a rejuvenation whose
            mean acceptance rate is below this (``None``, the default: never); in ``(0, 1]``.
        max_particles: the most ``num_particles`` an exchange may reach (default: no limit).
        parameters: the names of the static parameters to infer (default: all).
        max_plate_nesting: as for :class:`~pyro_smc.SMC`.
        progress_bar: a bar in :meth:`run` (``None``: in interactive use only).

    Attributes:
        num_particles: :math:`N_x` now (an exchange step doubles it).
        filters: the inner filters, one :class:`~pyro_smc.SMC` with ``num_filters=N_theta``
            (``None`` before :meth:`init`); filter ``m`` runs at parameter particle ``m``.
        static_parameters: the model's :class:`~pyro_smc.infer.static_parameters.StaticParameters`.

    Raises:
        ValueError: a setting out of range (naming it), or a model without static parameters.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro.nn import PyroModule, PyroSample
        >>> class AR1(PyroModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
        ...     def init(self, state):
        ...         state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))
        ...     def step(self, state, y=None):
        ...         state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], 1.0))
        ...         pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)
        >>> _ = torch.manual_seed(0)
        >>> ys = torch.randn(20)
        >>> smc2 = SMC2(AR1(), num_parameter_particles=50, num_particles=50).run(ys)
        >>> smc2.log_evidence.shape, smc2.parameters["rho"].shape, smc2.log_weights.shape
        (torch.Size([]), torch.Size([50]), torch.Size([50]))
        >>> smc2.result.ess.shape
        torch.Size([20])
    """

    def __init__(
        self,
        model: Any,
        guide: Any = None,
        *,
        num_parameter_particles: int,
        num_particles: int,
        resampler: Callable | None = None,
        ess_threshold: float = 0.5,
        rejuvenation_steps: int = 5,
        proposal: str = "random_walk",
        proposal_scale: float | None = None,
        filter_ess_threshold: float = 0.5,
        exchange_below: float | None = None,
        max_particles: int | None = None,
        parameters: list[str] | None = None,
        max_plate_nesting: int = 0,
        progress_bar: bool | None = None,
    ) -> None:
        self.num_parameter_particles = int_at_least("num_parameter_particles", num_parameter_particles, 2)
        self.num_particles = positive_int("num_particles", num_particles)
        self.ess_threshold = unit_interval("ess_threshold", ess_threshold)
        self.rejuvenation_steps = int_at_least("rejuvenation_steps", rejuvenation_steps, 0)
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        self.proposal = proposal
        self.proposal_scale = None if proposal_scale is None else positive_float("proposal_scale", proposal_scale)
        self.exchange_below = None if exchange_below is None else unit_interval("exchange_below", exchange_below)
        self.max_particles = None if max_particles is None else int_at_least("max_particles", max_particles, self.num_particles)
        progress_enabled(progress_bar)  # its TypeError, at construction
        self.progress_bar = progress_bar
        self.model, self.guide = model, guide
        self.static_parameters = StaticParameters(model, parameters)
        options = {"resampler": resampler, "ess_threshold": unit_interval("filter_ess_threshold", filter_ess_threshold)}
        options["max_plate_nesting"] = max_plate_nesting
        self._inner = InnerFilters(self.static_parameters, model, guide, self.num_parameter_particles, self.num_particles, **options)
        self.filters: SMC | None = None
        self._records: list[SMC2StepRecord] = []

    # --- the run ---------------------------------------------------------------------------------

    def init(self, *args: Any, **kwargs: Any) -> SMC2:
        """Draws the parameter particles from the prior and starts their filters."""
        params = self.static_parameters
        with torch.no_grad():
            values = params.sample((self.num_parameter_particles,))
            self._set(params.flatten(params.unconstrain(values)))
            self._init_call = (args, kwargs)
            self._steps: list[tuple] = []
            self._records = []
            self.filters = self._inner.start(self._values, args, kwargs)
            self._log_w = self._z.new_full((self.num_parameter_particles,), -math.log(self.num_parameter_particles))
            self._log_evidence = self._z.new_zeros(())
            # an init that scores sites weighs the parameters: its term joins the first record
            self._pending = self._reweight(log_evidence(self.filters).to(self._z), "init")
        return self

    def step(self, y: Any = None, *args: Any, **kwargs: Any) -> SMC2:
        """Advances every filter by observation ``y``, reweights the parameter particles and
        rejuvenates them if their ESS fell below the threshold. ``None`` or an all-NaN ``y`` is
        a step without observation (as in :meth:`SMC.step <pyro_smc.SMC.step>`)."""
        if self.filters is None:
            raise RuntimeError("SMC2.step called before SMC2.init")
        t = len(self._steps)
        with torch.no_grad():
            before = log_evidence(self.filters)
            self._inner.advance(self.filters, self.parameters, y, args, kwargs)
            self._steps.append((y, args, kwargs))
            increment = self._reweight(log_evidence(self.filters) - before, f"time step {t}") + self._pending
            self._pending = torch.zeros_like(increment)
            ess = self.ess
            rejuvenate = bool(ess < self.ess_threshold * self.num_parameter_particles)
            rates = self._rejuvenate() if rejuvenate else ()
            if rates and self._wants_exchange(rates):
                increment = increment + self._exchange()
        self._records.append(SMC2StepRecord(increment, ess, rejuvenate, rates, self.num_particles))
        return self

    def run(self, observations: Tensor, *args: Any, **kwargs: Any) -> SMC2:
        """``init(*args)`` then ``step(observations[t], *args)`` for every leading slice.

        Raises:
            ValueError: ``observations`` is not a tensor with at least one time step.
        """
        if not isinstance(observations, Tensor) or observations.dim() < 1 or len(observations) < 1:
            raise ValueError("observations must be a tensor (T, ...) with T >= 1")
        self.init(*args, **kwargs)
        for y in progress(observations, desc="SMC2", enabled=progress_enabled(self.progress_bar)):
            self.step(y, *args, **kwargs)
        return self

    def _reweight(self, log_likelihood: Tensor, where: str) -> Tensor:
        # A filter that failed (NaN) weighs its parameter particle to zero.
        log_likelihood = torch.nan_to_num(log_likelihood.to(self._log_w), nan=-math.inf)
        unnormalised = self._log_w + log_likelihood
        increment = torch.logsumexp(unnormalised, 0)
        if not torch.isfinite(increment):
            raise ValueError(f"at {where}: no parameter particle gives the observation a positive likelihood")
        self._log_w = unnormalised - increment
        self._log_evidence = self._log_evidence + increment
        return increment

    def _rejuvenate(self) -> tuple[float, ...]:
        """Resamples the parameter particles with their filters, then moves them."""
        params = self.static_parameters
        proposal = fit_proposal(self._z, self._log_w, self.proposal, self.proposal_scale)
        index = systematic(self._log_w)
        self._set(self._z[index])
        self._log_w = torch.full_like(self._log_w, -math.log(self.num_parameter_particles))
        InnerFilters.select(self.filters, index)
        log_target = self.log_likelihoods + params.log_prior_unconstrained(params.unflatten(self._z))
        rates = []
        for _ in range(self.rejuvenation_steps):
            z, log_target, rate = metropolis_hastings(self._z, log_target, proposal, self._target_of, self._accept)
            self._set(z)
            rates.append(rate)
        return tuple(rates)

    def _wants_exchange(self, rates: tuple[float, ...]) -> bool:
        below = self.exchange_below is not None and sum(rates) / len(rates) < self.exchange_below
        return below and (self.max_particles is None or 2 * self.num_particles <= self.max_particles)

    def _exchange(self) -> Tensor:
        """Doubles ``num_particles``: new filters at the same parameters replace the old, each
        particle reweighted by the ratio of the new to the old likelihood estimate (an unbiased
        estimate of 1 given the particle and its old filter); returns the log of the weighted
        mean ratio, the step's extra evidence factor."""
        self.num_particles *= 2
        self._inner.num_particles = self.num_particles
        filters = self._inner.replay(self._values, self._init_call, self._steps)
        ratio = log_evidence(filters).to(self._z) - self.log_likelihoods
        self.filters = filters
        return self._reweight(ratio, f"the exchange step at time step {len(self._steps) - 1}")

    def _set(self, z: Tensor) -> None:
        # the constrained values, computed once per change: the filters see the same tensors at
        # every step until the particles move
        params = self.static_parameters
        self._z, self._values = z, params.constrain(params.unflatten(z))

    def _target_of(self, z: Tensor) -> tuple[Tensor, SMC]:
        params = self.static_parameters
        log_prior = params.log_prior_unconstrained(params.unflatten(z))
        # a proposal outside the prior's support is rejected without running its filter
        z = torch.where(torch.isfinite(log_prior).unsqueeze(-1), z, self._z)
        filters = self._inner.replay(params.constrain(params.unflatten(z)), self._init_call, self._steps)
        return log_evidence(filters).to(log_prior) + log_prior, filters

    def _accept(self, filters: SMC, accept: Tensor) -> None:
        InnerFilters.merge(self.filters, filters, accept)

    # --- what it estimates -------------------------------------------------------------------------

    def _started(self, name: str) -> None:
        if self.filters is None:
            raise RuntimeError(f"SMC2.{name}: nothing has been run yet; call run(observations), or init() and step(y)")

    @property
    def unconstrained_parameters(self) -> Tensor:
        """``(N_theta, d)``: the parameter particles in the unconstrained space, flattened."""
        self._started("unconstrained_parameters")
        return self._z

    @property
    def parameters(self) -> dict[str, Tensor]:
        """``{name: (N_theta, *shape)}``: the parameter particles (weighted by :attr:`log_weights`)."""
        self._started("parameters")
        return self._values

    @property
    def log_weights(self) -> Tensor:
        """``(N_theta,)``: the parameter particles' normalised log-weights."""
        self._started("log_weights")
        return self._log_w

    @property
    def ess(self) -> Tensor:
        """``()``: the parameter particles' effective sample size, in ``[1, N_theta]``."""
        return 1.0 / torch.exp(2.0 * self.log_weights).sum()

    @property
    def log_likelihoods(self) -> Tensor:
        r"""``(N_theta,)``: each particle's filter estimate :math:`\log \hat p(y_{1:t} \mid \theta^m)`."""
        self._started("log_likelihoods")
        return log_evidence(self.filters).to(self._z)

    @property
    def log_evidence(self) -> Tensor:
        r"""``()``: the estimate of :math:`\log p(y_{1:t})`, the sum of the steps' increments."""
        self._started("log_evidence")
        return self._log_evidence

    def posterior_mean(self) -> dict[str, Tensor]:
        """``{name: shape}``: the weighted mean of each parameter under the current posterior."""
        w = self.log_weights.exp()
        return {n: torch.tensordot(w, v, dims=1) for n, v in self.parameters.items()}

    def posterior_variance(self) -> dict[str, Tensor]:
        """``{name: shape}``: the weighted variance of each entry of each parameter."""
        w = self.log_weights.exp()
        mean = self.posterior_mean()
        return {n: torch.tensordot(w, (v - mean[n]) ** 2, dims=1) for n, v in self.parameters.items()}

    def get_empirical(self) -> dict[str, dist.Empirical]:
        """Each parameter's weighted particles as a :class:`~pyro.distributions.Empirical`."""
        return {n: dist.Empirical(v, self.log_weights) for n, v in self.parameters.items()}

    @property
    def records(self) -> tuple[SMC2StepRecord, ...]:
        """The :class:`~pyro_smc.infer.smc2.result.SMC2StepRecord` of every step so far."""
        return tuple(self._records)

    @property
    def result(self) -> SMC2Result:
        """A snapshot of the run so far as an :class:`~pyro_smc.infer.smc2.result.SMC2Result`."""
        if not self._records:
            raise RuntimeError("SMC2 has not taken a step; call run(observations) or init() and step(y)")
        return SMC2Result.stack(self._records, self.log_evidence)
