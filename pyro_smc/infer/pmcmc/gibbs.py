r"""Particle Gibbs with ancestor sampling, as a :mod:`pyro.infer.mcmc` kernel.

The target is the joint posterior :math:`p(\theta, x_{0:T} \mid y_{0:T})` of a state-space
model's static parameters :math:`\theta` (its ``PyroSample`` attributes, see
:class:`~pyro_smc.infer.static_parameters.StaticParameters`) and its state trajectory. One
iteration of :class:`ParticleGibbs` is a Gibbs sweep over the two blocks:

1. the trajectory given :math:`\theta`: one conditional SMC sweep with ancestor sampling
   (:class:`~pyro_smc.infer.pmcmc.csmc.ConditionalSMC`), conditioned on the current trajectory,
   which leaves :math:`p(x_{0:T} \mid \theta, y_{0:T})` invariant;
2. :math:`\theta` given the trajectory: ``num_mh_steps`` random-walk Metropolis-Hastings steps
   in the unconstrained space :math:`z = T^{-1}(\theta)` on the exact complete-data target

   .. math::

      \log \pi(z) = \log p(\theta) + \log |\det \partial\theta/\partial z|
                    + \log p_\theta(x_{0:T}, y_{0:T}),

   the last term from one run of the model along the trajectory (all steps as one batched run of
   ``step`` where the model allows it, see :class:`~pyro_smc.infer.pmcmc.paths.PathReplay`: then
   a step costs a few milliseconds whatever :math:`T`, and many steps per sweep are cheap);
3. optionally ``noncentred_steps`` more Metropolis-Hastings steps on :math:`\theta` given the
   path's standardised noise :math:`\varepsilon` (each ``Normal`` latent site written
   :math:`\mathrm{loc}_\theta + \mathrm{scale}_\theta\,\varepsilon`), the path recomputed from
   :math:`\varepsilon` at each proposal: the interweaving strategy of Yu and Meng (2011). When the
   path pins a parameter down tightly (a noise scale :math:`\sigma` given a long path), the
   centred step 2 moves it in tiny steps; the non-centred step moves :math:`\sigma` and the path
   together and mixes far better (stochastic volatility, Kastner and Frühwirth-Schnatter 2014).
   Each of its steps is one step-by-step run of the model, about half a sweep.

Each update leaves the joint posterior invariant, so the chain targets it with any number of
particles :math:`N \ge 2`; ancestor sampling keeps the trajectory moving with few particles
(Lindsten, Jordan and Schön 2014). Each parameter move has its own
:class:`~pyro_smc.infer.pmcmc.proposals.AdaptiveRandomWalk`, adapted during warm-up only.

**What the chain reports.** The kernel's sample dict holds :math:`z` under each parameter's site
name (``transforms`` map it back, so ``MCMC.get_samples()`` gives :math:`\theta` on its support,
as for NUTS) and, beside it, the trajectory as the state after each time step, stacked over
time: ``get_samples()["x"]`` has shape ``(num_samples, T, *event)`` for a model whose ``step``
writes ``state["x"]``, the layout of :meth:`SMC.smooth <pyro_smc.SMC.smooth>`.
``trajectory_keys`` picks the keys (``()`` keeps none: long series make large samples, and
``MCMC.diagnostics()``/``summary()`` report an ESS and R-hat per element of every reported
site, as they do for any vector site), and :attr:`ParticleGibbs.trajectory` holds the latest
trajectory with its latent sites by name. :meth:`ParticleGibbs.diagnostics` is compact: the
acceptance rate of each parameter move and the path update rate (the mean over time steps of the
fraction of sweeps that changed the state there, and its smallest value).

Example:
    >>> import torch, pyro.distributions as dist
    >>> from pyro.infer import MCMC
    >>> from pyro.nn import PyroSample
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> one = torch.eye(1)
    >>> ssm = LinearGaussianSSM(0.8 * one, one, one, one, torch.zeros(1), one)
    >>> _, ys = ssm.simulate(10)
    >>> ssm.A = PyroSample(dist.Uniform(-1.0, 1.0).expand([1, 1]).to_event(2))
    >>> kernel = ParticleGibbs(ssm, num_particles=5)
    >>> mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, disable_progbar=True)
    >>> mcmc.run(ys)
    >>> samples = mcmc.get_samples()
    >>> samples["A"].shape, samples["x"].shape
    (torch.Size([20, 1, 1]), torch.Size([20, 10, 1]))
    >>> bool(samples["A"].abs().max() < 1)
    True
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable

import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from torch import Tensor

from pyro_smc.checks import int_at_least
from pyro_smc.infer.pmcmc.csmc import ConditionalSMC, Trajectory, _check_observations
from pyro_smc.infer.pmcmc.paths import PathReplay
from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk
from pyro_smc.infer.static_parameters import StaticParameters

__all__ = ["ParticleGibbs"]


class ParticleGibbs(MCMCKernel):
    r"""Particle Gibbs with ancestor sampling over a Pyro ``init``/``step`` model.

    Use it with :class:`pyro.infer.MCMC`: ``MCMC(kernel, ...).run(observations, *args)`` passes
    the observations (``(T, ...)``, or a sequence of tensors and ``None``) and the model's extra
    arguments to :meth:`setup`. See the module docstring for the iteration and the sample dict.

    Args:
        model: a ``PyroModule`` in the ``init``/``step`` protocol whose static parameters are
            ``PyroSample`` attributes; a model without any samples the trajectory only (a
            particle MCMC smoother).
        num_particles: ``N >= 2`` particles of the conditional SMC sweep.
        parameters: the names of the static parameters to infer (default: all).
        num_mh_steps: centred Metropolis-Hastings steps on :math:`\theta` per sweep (each one run
            of the model along the trajectory: one batched ``step`` run where the model allows
            it, else about half a sweep).
        noncentred_steps: non-centred (interweaving) Metropolis-Hastings steps on :math:`\theta`
            per sweep, each about half a sweep (0: none). The model needs ``Normal`` latent sites.
        noncentred_parameters: the parameters the non-centred steps move (default: all of
            ``parameters``). With the noise held, a location or scale parameter moves the whole
            path coherently, while one that sets the dynamics (an autoregressive coefficient)
            reshapes it and is rarely accepted: move the former only.
        proposal: the random walk of the centred steps on the flattened unconstrained parameters
            (default: ``AdaptiveRandomWalk(D, target_accept=0.44 if D == 1 else 0.234)``).
        noncentred_proposal: the same for the non-centred steps (default: likewise).
        init_strategy: a Pyro initialisation strategy (``pyro.infer.autoguide.initialization``)
            applied to each parameter's prior; default the prior median, as :class:`PMMH`.
            ``MCMC(initial_params=)`` (unconstrained values) overrides it.
        ancestor_sampling: see :class:`~pyro_smc.infer.pmcmc.csmc.ConditionalSMC`.
        max_plate_nesting: the plates the model nests inside a step.
        trajectory_keys: the state keys reported in the samples (default: every key the state
            holds at every step; ``()``: none).

    Raises:
        ValueError: a bad argument, naming it.

    Example:
        >>> import torch, pyro.distributions as dist
        >>> from pyro.nn import PyroSample
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> one = torch.eye(1)
        >>> ssm = LinearGaussianSSM(0.5 * one, one, one, one, torch.zeros(1), one)
        >>> ssm.Q = PyroSample(dist.LogNormal(0.0, 1.0).expand([1, 1]).to_event(2))
        >>> kernel = ParticleGibbs(ssm, num_particles=5, num_mh_steps=2, noncentred_steps=1)
        >>> kernel.setup(0, torch.zeros(6, 1))
        >>> params = kernel.sample(kernel.initial_params)
        >>> sorted(params), params["x"].shape
        (['Q', 'x'], torch.Size([6, 1]))
    """

    def __init__(
        self,
        model: Any,
        num_particles: int = 10,
        *,
        parameters: Sequence[str] | None = None,
        num_mh_steps: int = 1,
        noncentred_steps: int = 0,
        noncentred_parameters: Sequence[str] | None = None,
        proposal: AdaptiveRandomWalk | None = None,
        noncentred_proposal: AdaptiveRandomWalk | None = None,
        init_strategy: Callable = init_to_median,
        ancestor_sampling: bool = True,
        max_plate_nesting: int = 0,
        trajectory_keys: Sequence[str] | None = None,
    ) -> None:
        # None, as for an HMC kernel built from a potential function: Pyro's MCMC and ArviZ's
        # export would otherwise call the model as a whole-trajectory program, which it is not
        self.model = None
        self.csmc = ConditionalSMC(model, num_particles, ancestor_sampling=ancestor_sampling, max_plate_nesting=max_plate_nesting)
        self.replay = PathReplay(self.csmc)
        self.static = _static_parameters(model, parameters)
        self.num_mh_steps = int_at_least("num_mh_steps", num_mh_steps, 1)
        self.noncentred_steps = int_at_least("noncentred_steps", noncentred_steps, 0)
        size = 0 if self.static is None else self.static.unconstrained_size
        self.proposal = _proposal("proposal", proposal, size)
        # the positions of the non-centred steps' parameters in the flattened unconstrained vector
        self._noncentred_index = _positions(self.static, noncentred_parameters)
        nc_size = size if self._noncentred_index is None else len(self._noncentred_index)
        self.noncentred_proposal = _proposal("noncentred_proposal", noncentred_proposal, nc_size) if self.noncentred_steps else None
        if not callable(init_strategy):
            raise ValueError(f"init_strategy must be a Pyro initialisation strategy (a callable), got {init_strategy!r}")
        self.init_strategy = init_strategy
        if trajectory_keys is not None and (isinstance(trajectory_keys, str) or not all(isinstance(k, str) for k in trajectory_keys)):
            raise ValueError(f"trajectory_keys must be a sequence of state keys, got {trajectory_keys!r}")
        self.trajectory_keys = None if trajectory_keys is None else list(trajectory_keys)
        #: MCMC maps each parameter's unconstrained value back with ``transforms[name].inv``
        self.transforms = {} if self.static is None else {n: t.inv for n, t in self.static.transforms.items()}
        self.trajectory: Trajectory | None = None
        self._initial_params: dict[str, Tensor] | None = None
        self._reset()

    def _reset(self) -> None:
        self._t = 0
        self._warmup_steps = 0
        # per move ("centred", "non-centred"): [accepted, tried] after warm-up, and the running
        # mean acceptance probability of the whole run (the progress bar's)
        self._counts = {"centred": [0, 0], "non-centred": [0, 0]}
        self._mean_accept = {"centred": [0.0, 0], "non-centred": [0.0, 0]}
        self._path_updates: Tensor | None = None
        self._num_sweeps = 0

    # --- MCMCKernel ----------------------------------------------------------------------------

    @property
    def initial_params(self) -> dict[str, Tensor]:
        """The parameters to start from, unconstrained (and, after :meth:`setup`, the first
        trajectory's stacked state)."""
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, Tensor]) -> None:
        self._initial_params = params

    def setup(self, warmup_steps: int, observations: Any = None, *args: Any, **kwargs: Any) -> None:
        """Checks the data, takes the start (``initial_params`` where given, else
        ``init_strategy``) and draws the first trajectory from a plain particle filter there."""
        if observations is None:
            raise ValueError("observations: run the chain as MCMC(kernel, ...).run(observations, *args)")
        _check_observations(observations)
        self._reset()
        self._warmup_steps = warmup_steps
        self._data = (observations, args, kwargs)
        z = {}
        if self.static is not None:
            given = self._initial_params or {}
            z = {n: given[n] for n in self.static.names if n in given}
            if len(z) < len(self.static.names):
                start = self.static.initial(self.init_strategy)
                z.update({n: start[n] for n in self.static.names if n not in z})
            z = {n: torch.as_tensor(z[n]).reshape(self.static.unconstrained_shapes[n]) for n in self.static.names}
        self.trajectory = None
        # the first sweep runs with Pyro's validation as the user set it, so that a model error
        # names its site; later sweeps skip the argument checks (a tenth of a sweep's time)
        self.trajectory = self._sweep(z)
        reported = self._reported(self.trajectory)
        clash = sorted(set(reported) & set(z))
        if clash:
            raise ValueError(f"trajectory_keys: state keys {clash} are also parameter names; pass trajectory_keys without them")
        self._initial_params = {**z, **reported}

    def sample(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """One particle Gibbs iteration: a conditional SMC sweep, then ``num_mh_steps`` centred
        and ``noncentred_steps`` non-centred Metropolis-Hastings steps on the parameters."""
        z = {} if self.static is None else {n: params[n] for n in self.static.names}
        previous = self.trajectory
        with pyro.validation_enabled(False):
            self.trajectory = self._sweep(z)
            self._count_path_updates(previous, self.trajectory)
            if self.static is not None:
                z = self._centred_moves(z)
                if self.noncentred_steps:
                    z = self._noncentred_moves(z)
        self._t += 1
        if self._t == self._warmup_steps:
            self.end_warmup()
        return {**z, **self._reported(self.trajectory)}

    def end_warmup(self) -> None:
        """Freezes the proposals' adaptation."""
        for proposal in (self.proposal, self.noncentred_proposal):
            if proposal is not None:
                proposal.end_warmup()

    def logging(self) -> OrderedDict:
        """The progress bar's line: the parameter moves' mean acceptance probability and the
        centred proposal's scale, and the mean path update rate."""
        out = OrderedDict()
        if self.proposal is not None:
            out["step size"] = f"{self.proposal.scale:.2e}"
            out["acc. prob"] = f"{self._mean_accept['centred'][0]:.3f}"
        if self.noncentred_proposal is not None:
            out["nc acc. prob"] = f"{self._mean_accept['non-centred'][0]:.3f}"
        if self._path_updates is not None:
            out["path upd."] = f"{float(self._path_updates.mean()) / max(self._num_sweeps, 1):.2f}"
        return out

    def diagnostics(self) -> dict[str, Any]:
        """Scalars over the samples after warm-up: ``acceptance rate`` of the centred parameter
        moves (and ``non-centred acceptance rate`` when there are any), ``path update rate``:
        the mean over time steps of the fraction of sweeps that changed the trajectory there,
        ``min path update rate``: the smallest over the steps (where the path sticks), and
        ``divergences`` (empty: ArviZ's export reads it). :attr:`path_update_rate` has the rate
        per time step."""
        out: dict[str, Any] = {"divergences": []}
        for name, key in (("centred", "acceptance rate"), ("non-centred", "non-centred acceptance rate")):
            accepted, tried = self._counts[name]
            if tried:
                out[key] = accepted / tried
        if self._path_updates is not None and self._num_sweeps:
            out["path update rate"] = float(self._path_updates.mean()) / self._num_sweeps
            out["min path update rate"] = float(self._path_updates.min()) / self._num_sweeps
        return out

    @property
    def path_update_rate(self) -> Tensor | None:
        """``(T,)``: per time step, the fraction of sweeps after warm-up whose trajectory differs
        from the reference there (near 1 where the chain mixes well; plain conditional SMC
        drops towards 0 at the early steps of a long series)."""
        return None if self._path_updates is None else self._path_updates / max(self._num_sweeps, 1)

    # --- the blocks ----------------------------------------------------------------------------

    def _fixed(self, z: dict[str, Tensor]):
        return contextlib.nullcontext() if self.static is None else self.static.fixed(self.static.constrain(z))

    def _sweep(self, z: dict[str, Tensor]) -> Trajectory:
        observations, args, kwargs = self._data
        with self._fixed(z):
            return self.csmc.sweep(observations, *args, reference=self.trajectory, **kwargs)

    def _log_prior(self, z: dict[str, Tensor]) -> Tensor:
        return self.static.log_prior_unconstrained(z)

    def _centred_moves(self, z: dict[str, Tensor]) -> dict[str, Tensor]:
        """``num_mh_steps`` random-walk steps on the parameters, the path held."""
        observations, args, kwargs = self._data
        if self.trajectory.log_density is None:
            with self._fixed(z):
                self.trajectory = self.trajectory._replace(log_density=self.replay.log_density(self.trajectory, observations, *args, **kwargs))

        def score(z_new: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            with self._fixed(z_new):
                log_joint = self.replay.log_density(self.trajectory, observations, *args, **kwargs)
            return log_joint, log_joint

        # the sweep scored its path at the current parameters: no extra run of the model
        z, log_joint = self._metropolis(z, self.trajectory.log_density, self.trajectory.log_density, score, self.num_mh_steps, "centred")
        self.trajectory = self.trajectory._replace(log_density=log_joint)
        return z

    def _noncentred_moves(self, z: dict[str, Tensor]) -> dict[str, Tensor]:
        """``noncentred_steps`` random-walk steps on the parameters, the path's noise held."""
        observations, args, kwargs = self._data
        with self._fixed(z):
            current = self.replay.noise(self.trajectory, observations, *args, **kwargs)
        if not any(current.noise):
            return z  # no Normal latent site: the move is the identity

        def score(z_new: dict[str, Tensor]) -> tuple[Tensor, Any]:
            with self._fixed(z_new):
                path = self.replay.shift(current.trajectory, current.noise, observations, *args, **kwargs)
            return path.trajectory.log_density + path.log_scale, path

        log_target = current.trajectory.log_density + current.log_scale
        z, path = self._metropolis(z, log_target, current, score, self.noncentred_steps, "non-centred")
        self.trajectory = path.trajectory
        return z

    def _metropolis(self, z: dict[str, Tensor], log_target: Tensor, payload: Any, score: Callable, num_steps: int, move: str) -> tuple[dict, Any]:
        """Random-walk Metropolis-Hastings on ``log prior + score(z)[0]``; returns the last state
        and its ``score(z)[1]`` (``payload`` for the start)."""
        proposal = self.proposal if move == "centred" else self.noncentred_proposal
        index = None if move == "centred" else self._noncentred_index
        flat = self.static.flatten(z)
        log_target = _finite_or_minus_inf(self._log_prior(z) + log_target)
        for _ in range(num_steps):
            if index is None:
                proposed = proposal.propose(flat)
            else:  # only the chosen parameters move; the rest keep their values
                proposed = flat.clone()
                proposed[index] = proposal.propose(flat[index])
            z_new = self.static.unflatten(proposed)
            log_prior = self._log_prior(z_new)
            log_proposed, new_payload = log_prior.new_tensor(-math.inf), None
            if bool(torch.isfinite(log_prior)):
                term, new_payload = score(z_new)
                log_proposed = _finite_or_minus_inf(log_prior + term)
            log_ratio = float(log_proposed - log_target)
            accept_prob = 1.0 if log_ratio >= 0 else (math.exp(log_ratio) if log_ratio > -math.inf else 0.0)
            accepted = bool(torch.rand((), device=flat.device) < accept_prob)
            if accepted:
                flat, log_target, payload = proposed, log_proposed, new_payload
            if self._t < self._warmup_steps:
                proposal.update(flat if index is None else flat[index], accept_prob)
            else:
                self._counts[move][0] += int(accepted)
                self._counts[move][1] += 1
            mean = self._mean_accept[move]
            mean[1] += 1
            mean[0] += (accept_prob - mean[0]) / mean[1]
        return self.static.unflatten(flat), payload

    def _count_path_updates(self, previous: Trajectory | None, new: Trajectory) -> None:
        if previous is None or self._t < self._warmup_steps:
            return
        changed = [any(not torch.equal(new.sites[k][name], previous.sites[k][name]) for name in new.sites[k]) for k in range(1, len(new.sites))]
        changed = torch.tensor(changed, dtype=torch.float64)
        self._path_updates = changed if self._path_updates is None else self._path_updates + changed
        self._num_sweeps += 1

    def _reported(self, trajectory: Trajectory) -> dict[str, Tensor]:
        if self.trajectory_keys == []:
            return {}
        return trajectory.stacked(self.trajectory_keys)


def _finite_or_minus_inf(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, nan=-math.inf)


def _positions(static: StaticParameters | None, names: Sequence[str] | None) -> Tensor | None:
    """The positions of ``names``' entries in ``static``'s flattened unconstrained vector
    (``None``: all of them)."""
    if names is None:
        return None
    if isinstance(names, str) or static is None or not names or any(n not in static.names for n in names):
        known = [] if static is None else static.names
        raise ValueError(f"noncentred_parameters must name some of the static parameters {known}, got {names!r}")
    positions, start = [], 0
    for n in static.names:
        size = math.prod(static.unconstrained_shapes[n])
        if n in names:
            positions.extend(range(start, start + size))
        start += size
    return torch.tensor(positions, dtype=torch.long)


def _proposal(name: str, proposal: AdaptiveRandomWalk | None, size: int) -> AdaptiveRandomWalk | None:
    if proposal is not None and (not isinstance(proposal, AdaptiveRandomWalk) or proposal.dim != size):
        raise ValueError(f"{name} must be an AdaptiveRandomWalk of dim {size} (the unconstrained parameters), got {proposal!r}")
    if proposal is None and size:
        proposal = AdaptiveRandomWalk(size, target_accept=0.44 if size == 1 else 0.234)
    return proposal


def _static_parameters(model: Any, names: Sequence[str] | None) -> StaticParameters | None:
    """The model's static parameters, or ``None`` for a model that declares none (and names none)."""
    declares = any("_pyro_samples" in vars(m) and vars(m)["_pyro_samples"] for m in getattr(model, "modules", lambda: [])())
    if not declares and names is None:
        return None
    return StaticParameters(model, None if names is None else list(names))
