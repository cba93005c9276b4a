r"""Particle marginal Metropolis-Hastings: exact MCMC over a model's static parameters.

A state-space model with static parameters :math:`\theta` (``PyroSample`` attributes, see
:class:`~pyro_smc.infer.static_parameters.StaticParameters`) has the posterior
:math:`p(\theta \mid y_{1:T}) \propto p(\theta)\, p_\theta(y_{1:T})`, whose likelihood has no closed
form outside linear-Gaussian and finite-state models. A particle filter run given :math:`\theta`
gives a non-negative, unbiased estimate :math:`\hat Z(\theta)` of :math:`p_\theta(y_{1:T})`.
Metropolis-Hastings with :math:`\hat Z` in place of the likelihood (Andrieu, Doucet and Holenstein
2010) accepts a proposal :math:`\theta'` with probability

.. math::

    \min\Big(1, \frac{p(\theta')\, \hat Z(\theta')\, q(\theta \mid \theta')}
    {p(\theta)\, \hat Z(\theta)\, q(\theta' \mid \theta)}\Big),

where :math:`\hat Z(\theta)` is the estimate made when the current state was accepted, kept and
never recomputed. The chain then targets a distribution on :math:`\theta` and the filter's
randomness whose :math:`\theta`-marginal is the exact posterior, whatever the number of particles:
few particles make a noisier :math:`\hat Z` and a stickier chain, not a biased one. The noise
matters through the variance of :math:`\log \hat Z` near the posterior mode: a standard deviation of
about 1 to 1.7 balances the cost of a filter run against the mixing of the chain (Doucet, Pitt,
Deligiannidis and Kohn 2015); above about 3 the chain gets stuck for long stretches.

:class:`PMMH` is a :class:`~pyro.infer.mcmc.mcmc_kernel.MCMCKernel`: ``pyro.infer.MCMC`` runs it
(progress bar, ``get_samples``, ``summary``, ``diagnostics`` and ``arviz.from_pyro``). It moves in
the unconstrained space of :math:`\theta` (each prior's support mapped to the real line, the
log-Jacobian added to the prior), one block of parameters at a time, by an
:class:`~pyro_smc.infer.pmcmc.proposals.AdaptiveRandomWalk` per block that adapts during warm-up
only. Each filter runs under ``torch.no_grad``, with :class:`~pyro_smc.SMC`'s compiled step.

Not implemented: the correlated pseudo-marginal method (Deligiannidis, Doucet and Pitt 2018),
which moves the filter's Gaussian noise by a Crank-Nicolson step. It needs every random number the
filter draws (the model's draws inside ``pyro.sample`` and the resampler's) as one input vector,
and a resampling step that is continuous in that vector (the particles sorted before it); the
filter draws from torch's global generator inside the user's program, so no exact version fits.
Block updates are the option that keeps the acceptance rate up here.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from torch import Tensor

from pyro_smc.checks import boolean
from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk
from pyro_smc.infer.smc import SMC, SMCFailedError
from pyro_smc.infer.smc.checks import ParticleDegeneracyWarning
from pyro_smc.infer.static_parameters import StaticParameters

__all__ = ["PMMH"]


class PMMH(MCMCKernel):
    r"""Particle marginal Metropolis-Hastings over a state-space model's ``PyroSample`` parameters.

    The target is :math:`\log p(\theta) + \log \hat Z(\theta)`, :math:`\hat Z` the
    :class:`~pyro_smc.SMC` estimate of :math:`p_\theta(y_{1:T})` from a run of the model's ``init``
    and ``step`` given :math:`\theta` over the observations of ``MCMC.run(observations, *args)``
    (missing and partly missing observations as in :class:`~pyro_smc.SMC`). The estimate of the
    current state is kept, which makes the chain exact for any number of particles (module
    docstring).

    One call of :meth:`sample` (one MCMC iteration) updates every block in turn, one filter run per
    block. ``MCMC.get_samples()`` returns constrained values through the kernel's ``transforms``.

    Args:
        model: a ``PyroModule`` with ``init(state, *args)`` and ``step(state, y, *args)``, whose
            static parameters are ``PyroSample`` attributes (on it or on submodules).
        guide: the filter's proposal (as for :class:`~pyro_smc.SMC`), or ``None`` (bootstrap).
        num_particles: particles per filter, :math:`N \ge 1`.
        max_plate_nesting: plates the model uses inside a step (as for :class:`~pyro_smc.SMC`).
        resampler: the filter's resampler; default systematic. An unbiased :math:`\hat Z` needs
            an index resampler (systematic, stratified, multinomial): with a soft, OT or kernel
            resampler the chain targets an approximation.
        ess_threshold: resample a filter when its ESS falls below ``ess_threshold * N``.
        num_filters: :math:`B` independent filters run side by side; their estimates are averaged,
            :math:`\hat Z = \frac1B \sum_b \hat Z_b` (still unbiased, less noisy). With
            ``MCMC.run(..., batched=True)`` filter :math:`b` runs on sequence :math:`b` instead
            and the log-likelihood is :math:`\sum_b \log \hat Z_b` (sequences sharing
            :math:`\theta`).
        parameters: the site names of the parameters to infer (default: every ``PyroSample``
            attribute); see :class:`~pyro_smc.infer.static_parameters.StaticParameters`.
        blocks: the site names of each block, updated one block at a time (default: one block of
            all). Each parameter must lie in exactly one block.
        proposal: per block, an object with ``propose(z)``, ``update(z, accept_prob)`` and
            ``end_warmup()`` acting on the block's unconstrained vector (a list, one per block; or
            one object with one block). Default: an
            :class:`~pyro_smc.infer.pmcmc.proposals.AdaptiveRandomWalk` per block, made at
            :meth:`setup`, adapting during warm-up. A proposal must be symmetric.
        target_accept: the acceptance rate the default proposals tune their scale for. Lower than
            the 0.234 of an exact likelihood: the noise of :math:`\log \hat Z` caps the rate a
            small step reaches (at :math:`2 \Phi(-\sigma/\sqrt2)` for a noise standard deviation
            :math:`\sigma`, 0.2 at :math:`\sigma = 1.8`), and a target above the cap shrinks the
            step to nothing.
        adapt: whether the default proposals adapt during warm-up.
        init_strategy: a Pyro initialisation strategy (``pyro.infer.autoguide.initialization``)
            applied to each parameter's prior; default the prior median. ``MCMC(initial_params=)``
            (unconstrained values) overrides it.
        compile: the filter's ``compile`` setting (:class:`~pyro_smc.SMC`).

    Attributes:
        transforms: ``{name: transform}`` from each parameter's support to the real line, read by
            ``MCMC`` to return constrained samples.
        parameters: the :class:`~pyro_smc.infer.static_parameters.StaticParameters`.
        smc: the :class:`~pyro_smc.SMC` engine that estimates :math:`\hat Z`.
        log_evidence: :math:`\log \hat Z` of the current state.
        model: ``None``, as for a kernel built from a potential function: the target is not a
            Pyro program, so ``arviz.from_pyro`` exports the posterior and sample stats only.

    Raises:
        ValueError: a bad setting, naming it; at :meth:`setup`, no observations, or an initial
            state whose target is not finite.

    Example:
        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import MCMC
        >>> from pyro.nn import PyroModule, PyroSample
        >>> class AR1(PyroModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
        ...     def init(self, state):
        ...         state["x"] = pyro.sample("x0", dist.Normal(0.0, 1.0))
        ...     def step(self, state, y):
        ...         state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], 1.0))
        ...         pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)
        >>> ys = torch.randn(20)
        >>> kernel = PMMH(AR1(), num_particles=50)
        >>> mcmc = MCMC(kernel, num_samples=30, warmup_steps=20, disable_progbar=True)
        >>> mcmc.run(ys)
        >>> mcmc.get_samples()["rho"].shape
        torch.Size([30])
        >>> 0.0 <= mcmc.diagnostics()["acceptance rate"]["chain 0"] <= 1.0
        True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        guide: Any = None,
        *,
        num_particles: int,
        max_plate_nesting: int = 0,
        resampler: Callable | None = None,
        ess_threshold: float = 0.5,
        num_filters: int = 1,
        parameters: Sequence[str] | None = None,
        blocks: Sequence[Sequence[str]] | None = None,
        proposal: Any = None,
        target_accept: float = 0.15,
        adapt: bool = True,
        init_strategy: Callable = init_to_median,
        compile: bool | None = None,
    ) -> None:
        self.smc = SMC(
            model,
            guide,
            num_particles,
            max_plate_nesting,
            resampler=resampler,
            ess_threshold=ess_threshold,
            num_filters=num_filters,
            progress_bar=False,
            compile=compile,
        )
        self.static = StaticParameters(model, None if parameters is None else list(parameters))
        self.transforms = {name: transform.inv for name, transform in self.static.transforms.items()}
        self.model = None
        self._blocks = self._check_blocks(blocks)
        self._indices = [self._block_index(b) for b in self._blocks]
        self._proposal = self._check_proposal(proposal)
        if not (isinstance(target_accept, (int, float)) and 0 < target_accept < 1):
            raise ValueError(f"target_accept must lie in (0, 1), got {target_accept!r}")
        self.target_accept = float(target_accept)
        self.adapt = boolean("adapt", adapt)
        if not callable(init_strategy):
            raise ValueError(f"init_strategy must be a Pyro initialisation strategy (a callable), got {init_strategy!r}")
        self.init_strategy = init_strategy
        self._initial_params: dict[str, Tensor] | None = None
        self._data: tuple[tuple, dict] | None = None
        self.log_evidence: float | None = None

    # --- arguments -------------------------------------------------------------------------------

    def _check_blocks(self, blocks: Sequence[Sequence[str]] | None) -> list[tuple[str, ...]]:
        names = self.static.names
        if blocks is None:
            return [tuple(names)]
        if isinstance(blocks, str) or not all(isinstance(b, (list, tuple)) and b and all(isinstance(n, str) for n in b) for b in blocks):
            raise ValueError(f"blocks must be a list of non-empty lists of site names, got {blocks!r}")
        listed = [n for b in blocks for n in b]
        if sorted(listed) != sorted(names):
            raise ValueError(f"blocks must name every parameter exactly once: {names}, got {[list(b) for b in blocks]}")
        return [tuple(b) for b in blocks]

    def _check_proposal(self, proposal: Any) -> list | None:
        if proposal is None:
            return None
        proposals = list(proposal) if isinstance(proposal, (list, tuple)) else [proposal]
        if len(proposals) != len(self._blocks):
            raise ValueError(f"proposal: one per block ({len(self._blocks)}), got {len(proposals)}")
        for p in proposals:
            if not all(callable(getattr(p, m, None)) for m in ("propose", "update", "end_warmup")):
                raise ValueError(f"proposal must have propose(z), update(z, accept_prob) and end_warmup(), got {type(p).__name__}")
        return proposals

    # --- the MCMCKernel interface ----------------------------------------------------------------

    @property
    def initial_params(self) -> dict[str, Tensor]:
        """The unconstrained starting values (from ``init_strategy`` unless set)."""
        if self._initial_params is None:
            self._initial_params = self.static.initial(self.init_strategy)
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, Tensor]) -> None:
        self._initial_params = params

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Reads the data of ``MCMC.run(observations, *args, **kwargs)`` and makes the proposals."""
        if not args or not isinstance(args[0], Tensor):
            raise ValueError("PMMH needs the observations: MCMC(PMMH(...), ...).run(observations, *args), observations a tensor (T, ...)")
        self._data = (args, kwargs)
        self._warmup_steps = int(warmup_steps)
        self._t = 0
        self._proposals = self._proposal if self._proposal is not None else [self._default_proposal(b) for b in self._blocks]
        self._accepted = [0] * len(self._blocks)
        self._tried = [0] * len(self._blocks)
        self._current: tuple[dict[str, Tensor], Tensor, float, float] | None = None  # params, z, log prior, log Z
        if self._warmup_steps == 0:
            self.end_warmup()

    def _default_proposal(self, block: tuple[str, ...]) -> AdaptiveRandomWalk:
        dim = sum(math.prod(self.static.unconstrained_shapes[n]) for n in block)
        return AdaptiveRandomWalk(dim, target_accept=self.target_accept, adapt=self.adapt)

    def cleanup(self) -> None:
        """Forgets the filter's last run (its particles and compiled step: picklable again, as
        ``MCMC`` with several processes needs); the model keeps its recording for the next run."""
        self.smc._reset()

    def end_warmup(self) -> None:
        """Freezes the proposals and starts counting acceptances afresh."""
        for proposal in self._proposals:
            proposal.end_warmup()
        self._accepted = [0] * len(self._blocks)
        self._tried = [0] * len(self._blocks)

    def sample(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """One iteration: a pseudo-marginal Metropolis-Hastings step per block.

        Args:
            params: ``{name: unconstrained value}``, the current state (what the last call
                returned, or the initial parameters).

        Returns:
            The new state, same structure.
        """
        if self._data is None:
            raise RuntimeError("PMMH.sample called before PMMH.setup")
        z, log_prior, log_z = self._state_of(params)
        warmup = self._t < self._warmup_steps
        for k, index in enumerate(self._indices):
            proposed = z.clone()
            proposed[index] = self._proposals[k].propose(z[index])
            new_prior, new_z = self._log_prior(proposed), -math.inf
            if math.isfinite(new_prior):  # outside the support the filter need not run: Z_hat * 0
                new_z = self._log_evidence(proposed)
            log_ratio = (new_prior + new_z) - (log_prior + log_z)
            accept_prob = math.exp(min(log_ratio, 0.0)) if not math.isnan(log_ratio) else 0.0
            self._tried[k] += 1
            if torch.rand(()).item() < accept_prob:
                z, log_prior, log_z = proposed, new_prior, new_z
                self._accepted[k] += 1
            if warmup:
                self._proposals[k].update(z[index], accept_prob)
        self._t += 1
        if self._t == self._warmup_steps:
            self.end_warmup()
        new_params = self.static.unflatten(z)
        self._current = (new_params, z, log_prior, log_z)
        self.log_evidence = log_z
        return new_params

    def _block_index(self, block: tuple[str, ...]) -> Tensor:
        index, start = [], 0
        for n in self.static.names:
            size = math.prod(self.static.unconstrained_shapes[n])
            if n in block:
                index.extend(range(start, start + size))
            start += size
        return torch.tensor(index)

    def _state_of(self, params: dict[str, Tensor]) -> tuple[Tensor, float, float]:
        # The kept estimate is what makes the chain exact: it is reused while the state is the one
        # this kernel returned, and estimated afresh only for a state from outside (a new chain).
        if self._current is not None and params is self._current[0]:
            return self._current[1:]
        for n in self.static.names:
            shape = self.static.unconstrained_shapes[n]
            if n not in params or torch.as_tensor(params[n]).shape != shape:
                got = tuple(torch.as_tensor(params[n]).shape) if n in params else "nothing"
                raise ValueError(f"initial parameters: '{n}' must be an unconstrained value of shape {tuple(shape)}, got {got}")
        z = self.static.flatten({n: torch.as_tensor(params[n]) for n in self.static.names})
        log_prior = self._log_prior(z)
        log_z = self._log_evidence(z) if math.isfinite(log_prior) else -math.inf
        if not math.isfinite(log_prior + log_z):
            raise ValueError(
                f"the initial parameters {self.static.constrain(self.static.unflatten(z))} have log prior {log_prior} and "
                f"log-evidence estimate {log_z}: start where both are finite (init_strategy=, MCMC(initial_params=), more particles)"
            )
        self._current = (params, z, log_prior, log_z)
        self.log_evidence = log_z
        return z, log_prior, log_z

    def _log_prior(self, z: Tensor) -> float:
        return float(self.static.log_prior_unconstrained(self.static.unflatten(z)))

    def _log_evidence(self, z: Tensor) -> float:
        """:math:`\\log \\hat Z` at unconstrained ``z``: one filter run given the parameters."""
        args, kwargs = self._data
        values = self.static.constrain(self.static.unflatten(z))
        with torch.no_grad(), self.static.fixed(values), warnings.catch_warnings():
            # Proposals in the tails make degenerate filters; the chain rejects them.
            warnings.simplefilter("ignore", ParticleDegeneracyWarning)
            try:
                log_z = self.smc.run(*args, **kwargs).log_evidence
            except SMCFailedError:
                return -math.inf  # every weight zero: the estimate is 0
        if kwargs.get("batched", False):
            total = log_z.sum()
        else:
            total = torch.logsumexp(log_z, 0) - math.log(log_z.shape[0])
        total = float(total)
        return -math.inf if math.isnan(total) else total

    # --- reports ---------------------------------------------------------------------------------

    def acceptance_rate(self) -> float:
        """The fraction of accepted proposals, over all blocks, in the current phase (warm-up, or
        sampling once warm-up has ended)."""
        tried = sum(self._tried)
        return sum(self._accepted) / tried if tried else 0.0

    def logging(self) -> OrderedDict:
        """The acceptance rate (and each block's, with several blocks) for MCMC's progress bar."""
        out = OrderedDict([("acc. rate", f"{self.acceptance_rate():.3f}")])
        if len(self._blocks) > 1:
            for block, accepted, tried in zip(self._blocks, self._accepted, self._tried):
                out[f"acc. {','.join(block)}"] = f"{accepted / tried if tried else 0.0:.3f}"
        return out

    def diagnostics(self) -> dict[str, Any]:
        """``{"divergences": [], "acceptance rate": float, "block acceptance rates": {block: float}}``
        over the samples after warm-up (``divergences`` is empty: ArviZ reads it)."""
        rates = {",".join(b): (a / t if t else 0.0) for b, a, t in zip(self._blocks, self._accepted, self._tried)}
        return {"divergences": [], "acceptance rate": self.acceptance_rate(), "block acceptance rates": rates}
