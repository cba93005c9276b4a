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

   the last term from one run of the model along the trajectory
   (:func:`~pyro_smc.infer.pmcmc.csmc.trajectory_log_density`). The proposal is an
   :class:`~pyro_smc.infer.pmcmc.proposals.AdaptiveRandomWalk`, adapted during warm-up only.

Unlike PMMH no likelihood is estimated: both updates are exact given the other block, so the
chain targets the posterior with any number of particles :math:`N \ge 2`; ancestor sampling keeps
the trajectory moving with few particles (Lindsten, Jordan and Schön 2014).

**What the chain reports.** The kernel's sample dict holds :math:`z` under each parameter's site
name (``transforms`` map it back, so ``MCMC.get_samples()`` gives :math:`\theta` on its support,
as for NUTS) and, beside it, the trajectory as the state after each time step, stacked over
time: ``get_samples()["x"]`` has shape ``(num_samples, T, *event)`` for a model whose ``step``
writes ``state["x"]``, the layout of :meth:`SMC.smooth <pyro_smc.SMC.smooth>`.
``trajectory_keys`` picks the keys (``()`` keeps none: long series make large samples), and
:attr:`ParticleGibbs.trajectory` holds the latest trajectory with its latent sites by name.

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

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from torch import Tensor

from pyro_smc.checks import int_at_least
from pyro_smc.infer.pmcmc.csmc import ConditionalSMC, Trajectory, _check_observations
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
        num_mh_steps: Metropolis-Hastings steps on :math:`\theta` per sweep (each costs one run
            of the model along the trajectory, about half a sweep).
        proposal: the random walk on the flattened unconstrained parameters (default:
            ``AdaptiveRandomWalk(D, target_accept=0.44 if D == 1 else 0.234)``).
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
        >>> kernel = ParticleGibbs(ssm, num_particles=5, num_mh_steps=2)
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
        proposal: AdaptiveRandomWalk | None = None,
        ancestor_sampling: bool = True,
        max_plate_nesting: int = 0,
        trajectory_keys: Sequence[str] | None = None,
    ) -> None:
        # None, as for an HMC kernel built from a potential function: Pyro's MCMC and ArviZ's
        # export would otherwise call the model as a whole-trajectory program, which it is not
        self.model = None
        self.csmc = ConditionalSMC(model, num_particles, ancestor_sampling=ancestor_sampling, max_plate_nesting=max_plate_nesting)
        self.static = _static_parameters(model, parameters)
        self.num_mh_steps = int_at_least("num_mh_steps", num_mh_steps, 1)
        size = 0 if self.static is None else self.static.unconstrained_size
        if proposal is not None and (not isinstance(proposal, AdaptiveRandomWalk) or proposal.dim != size):
            raise ValueError(f"proposal must be an AdaptiveRandomWalk of dim {size} (the unconstrained parameters), got {proposal!r}")
        if proposal is None and size:
            proposal = AdaptiveRandomWalk(size, target_accept=0.44 if size == 1 else 0.234)
        self.proposal = proposal
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
        self._accepted = 0
        self._num_proposals = 0
        self._mean_accept_prob = 0.0
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
        """Checks the data, draws the start (the parameters from the prior unless given) and the
        first trajectory from a plain particle filter at them."""
        if observations is None:
            raise ValueError("observations: run the chain as MCMC(kernel, ...).run(observations, *args)")
        _check_observations(observations)
        self._reset()
        self._warmup_steps = warmup_steps
        self._data = (observations, args, kwargs)
        z = {}
        if self.static is not None:
            given = self._initial_params or {}
            missing = [n for n in self.static.names if n not in given]
            z = {n: given[n] for n in self.static.names if n in given}
            if missing:
                prior = self.static.unconstrain(self.static.sample())
                z.update({n: prior[n] for n in missing})
            z = {n: torch.as_tensor(z[n]).reshape(self.static.unconstrained_shapes[n]) for n in self.static.names}
        self.trajectory = None
        self.trajectory = self._sweep(z)
        reported = self._reported(self.trajectory)
        clash = sorted(set(reported) & set(z))
        if clash:
            raise ValueError(f"trajectory_keys: state keys {clash} are also parameter names; pass trajectory_keys without them")
        self._initial_params = {**z, **reported}

    def sample(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """One particle Gibbs iteration: a conditional SMC sweep, then ``num_mh_steps``
        Metropolis-Hastings steps on the parameters given the new trajectory."""
        z = {} if self.static is None else {n: params[n] for n in self.static.names}
        previous = self.trajectory
        self.trajectory = self._sweep(z)
        self._count_path_updates(previous, self.trajectory)
        if self.static is not None:
            z = self._update_parameters(z)
        self._t += 1
        if self._t == self._warmup_steps:
            self.end_warmup()
        return {**z, **self._reported(self.trajectory)}

    def end_warmup(self) -> None:
        """Freezes the proposal's adaptation."""
        if self.proposal is not None:
            self.proposal.end_warmup()

    def logging(self) -> OrderedDict:
        """The progress bar's line: the parameters' acceptance probability and the proposal scale."""
        out = OrderedDict()
        if self.proposal is not None:
            out["step size"] = f"{self.proposal.scale:.2e}"
            out["acc. prob"] = f"{self._mean_accept_prob:.3f}"
        if self._path_updates is not None:
            out["path upd."] = f"{float(self._path_updates.min()) / max(self._num_sweeps, 1):.2f}"
        return out

    def diagnostics(self) -> dict[str, Any]:
        """``acceptance rate`` of the parameter moves after warm-up, ``path update rate``: the
        smallest, over the steps, fraction of sweeps that changed the trajectory there, and
        ``divergences`` (empty: ArviZ's export reads it)."""
        out: dict[str, Any] = {"divergences": []}
        if self.static is not None and self._num_proposals:
            out["acceptance rate"] = self._accepted / self._num_proposals
        if self._path_updates is not None and self._num_sweeps:
            out["path update rate"] = float(self._path_updates.min()) / self._num_sweeps
        return out

    @property
    def path_update_rate(self) -> Tensor | None:
        """``(T,)``: per time step, the fraction of sweeps after warm-up whose trajectory differs
        from the reference there (near 1 where the chain mixes well; plain conditional SMC
        drops towards 0 at the early steps of a long series)."""
        return None if self._path_updates is None else self._path_updates / max(self._num_sweeps, 1)

    # --- the two blocks ------------------------------------------------------------------------

    def _sweep(self, z: dict[str, Tensor]) -> Trajectory:
        observations, args, kwargs = self._data
        if self.static is None:
            return self.csmc.sweep(observations, *args, reference=self.trajectory, **kwargs)
        with self.static.fixed(self.static.constrain(z)):
            return self.csmc.sweep(observations, *args, reference=self.trajectory, **kwargs)

    def _log_target(self, z: dict[str, Tensor], log_joint: Tensor | None = None) -> Tensor:
        observations, args, kwargs = self._data
        log_prior = self.static.log_prior_unconstrained(z)
        if not bool(torch.isfinite(log_prior)):
            return log_prior.new_tensor(-math.inf)
        if log_joint is None:
            with torch.no_grad(), self.static.fixed(self.static.constrain(z)):
                log_joint = self.csmc.log_density(self.trajectory, observations, *args, **kwargs)
        total = log_prior + log_joint
        return torch.nan_to_num(total, nan=-math.inf)

    def _update_parameters(self, z: dict[str, Tensor]) -> dict[str, Tensor]:
        flat = self.static.flatten(z)
        # the sweep scored its path at the current parameters: no extra run of the model
        log_target = self._log_target(z, self.trajectory.log_density)
        for k in range(self.num_mh_steps):
            proposed = self.proposal.propose(flat)
            log_proposed = self._log_target(self.static.unflatten(proposed))
            log_ratio = float(log_proposed - log_target)
            accept_prob = 1.0 if log_ratio >= 0 else (math.exp(log_ratio) if log_ratio > -math.inf else 0.0)
            accepted = bool(torch.rand((), device=flat.device) < accept_prob)
            if accepted:
                flat, log_target = proposed, log_proposed
            if self._t < self._warmup_steps:
                self.proposal.update(flat, accept_prob)
            else:
                self._num_proposals += 1
                self._accepted += int(accepted)
            n = self._t * self.num_mh_steps + k + 1
            self._mean_accept_prob += (accept_prob - self._mean_accept_prob) / n
        return self.static.unflatten(flat)

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


def _static_parameters(model: Any, names: Sequence[str] | None) -> StaticParameters | None:
    """The model's static parameters, or ``None`` for a model that declares none (and names none)."""
    declares = any("_pyro_samples" in vars(m) and vars(m)["_pyro_samples"] for m in getattr(model, "modules", lambda: [])())
    if not declares and names is None:
        return None
    return StaticParameters(model, None if names is None else list(names))
