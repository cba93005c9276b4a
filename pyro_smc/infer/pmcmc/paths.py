r"""Runs of a model along one trajectory: the parameter moves of particle Gibbs.

Both parameter updates of :class:`~pyro_smc.infer.pmcmc.gibbs.ParticleGibbs` score the model along
a fixed path, many times per sweep. :class:`PathReplay` does it two ways:

* **centred** (the path :math:`x_{0:T}` held): :math:`\log p_\theta(x_{0:T}, y_{1:T})`. One run of
  ``init``, then the ``T`` steps either one at a time or, for a first-order Markov model whose
  steps share their site names, as **one** run of ``step`` over ``T`` rows (row :math:`t` starts
  from the path's state after step :math:`t - 1` and reads :math:`y_t`), which removes the
  per-step Python of the model and of Pyro's handlers. The one-run form is used only after it
  matched the step-by-step run on a first path (each step's log-density and the state it writes);
  a model that reads anything but its state, the step's draws and ``y`` (a step counter, say)
  fails that check and keeps the step-by-step run.
* **non-centred** (the noise held): every latent site whose distribution is a ``Normal`` or a
  ``MultivariateNormal`` (or an ``Independent`` of one), unmasked and unscaled, is written
  :math:`x = \mathrm{loc}_\theta + \mathrm{scale}_\theta\, \varepsilon` (the scale a Cholesky
  factor for the latter), and a move of :math:`\theta` holds :math:`\varepsilon` and recomputes
  the path step by step (other latent sites keep their values). For fixed :math:`\theta` the map from
  :math:`(\varepsilon, x_{\text{other}})` to the path is a triangular bijection with Jacobian
  :math:`\prod \mathrm{scale}_\theta`, so the target in these coordinates is

  .. math::

     \log \pi(\theta \mid \varepsilon) = \log p(\theta) + \log p_\theta(x(\theta, \varepsilon), y)
                                        + \sum \log \mathrm{scale}_\theta + \text{const}.

  Alternating it with the centred move is the ancillarity-sufficiency interweaving of Yu and
  Meng (2011), used for stochastic volatility by Kastner and Frühwirth-Schnatter (2014): the
  centred move mixes where the data pin the path down, the non-centred one where they do not.

Example:
    >>> import torch
    >>> from pyro_smc.infer.pmcmc.csmc import ConditionalSMC
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> one = torch.eye(1)
    >>> ssm = LinearGaussianSSM(0.5 * one, one, one, one, torch.zeros(1), one)
    >>> csmc = ConditionalSMC(ssm, num_particles=4)
    >>> ys = torch.zeros(5, 1)
    >>> path = csmc.sweep(ys)
    >>> replay = PathReplay(csmc)
    >>> bool(torch.isclose(replay.log_density(path, ys), path.log_density))
    True
    >>> noise = replay.noise(path, ys)
    >>> moved = replay.shift(path, noise.noise, ys)  # same parameters: the same path
    >>> bool(torch.allclose(moved.trajectory.stacked()["x"], path.stacked()["x"]))
    True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import Independent, MultivariateNormal, Normal

from pyro_smc.infer.pmcmc.csmc import ConditionalSMC, Trajectory
from pyro_smc.tracing import is_latent, is_scored

__all__ = ["NonCentred", "PathReplay"]


class NonCentred(NamedTuple):
    """A path in non-centred coordinates at given parameters.

    Attributes:
        trajectory: the path (its ``log_density`` the complete-data one at the parameters).
        noise: per stage, ``{site: standardised noise}`` of the ``Normal`` latent sites.
        log_scale: :math:`\\sum \\log \\mathrm{scale}_\\theta` over those sites (a scalar).
    """

    trajectory: Trajectory
    noise: list[dict[str, Tensor]]
    log_scale: Tensor


def _affine(fn: Any) -> tuple[Tensor, Tensor, bool] | None:
    """``(loc, scale, full)`` of the ``Normal`` (``full=False``, scale the sd) or
    ``MultivariateNormal`` (``full=True``, scale its Cholesky factor) under ``fn`` (itself, or
    inside ``Independent``), else ``None``."""
    while isinstance(fn, Independent):
        fn = fn.base_dist
    if isinstance(fn, Normal):
        return fn.loc, fn.scale, False
    if isinstance(fn, MultivariateNormal):
        return fn.loc, fn.scale_tril, True
    return None


class _AlongPath(Messenger):
    """Gives the latent sites named in ``values`` their path values (scored, not drawn); with
    ``noise``, a ``Normal`` site named there gets ``loc + scale * noise`` instead. Records each
    ``Normal`` site's noise and the sum of its ``log scale`` per row (the leading dim)."""

    def __init__(self, values: dict[str, Tensor], noise: dict[str, Tensor] | None, rows: int) -> None:
        super().__init__()
        self.values, self.shift, self.rows = values, noise, rows
        self.noise: dict[str, Tensor] = {}
        self.log_scale: Tensor | float = 0.0

    def _pyro_sample(self, msg: dict) -> None:
        name = msg["name"]
        if msg["is_observed"] or name not in self.values:
            return
        value = self.values[name]
        affine = _affine(msg["fn"])
        # a masked or scaled site is not the plain Normal the Jacobian assumes: it keeps its value
        if affine is not None and msg["mask"] is None and _is_one(msg["scale"]):
            loc, scale, full = affine
            shift = None if self.shift is None else self.shift.get(name)
            if full:
                if shift is not None:
                    value = loc + (scale @ shift.unsqueeze(-1)).squeeze(-1)
                eps = torch.linalg.solve_triangular(scale, (value - loc).unsqueeze(-1), upper=False).squeeze(-1)
                log_scale = scale.diagonal(dim1=-2, dim2=-1).log().sum(-1).broadcast_to(eps.shape[:-1])
            else:
                if shift is not None:
                    value = loc + scale * shift
                eps = (value - loc) / scale
                log_scale = scale.log().broadcast_to(eps.shape)
            self.noise[name] = eps
            self.log_scale = self.log_scale + log_scale.reshape(self.rows, -1).sum(-1)
        msg["value"] = value
        msg["is_observed"] = True


def _is_one(scale: Any) -> bool:
    """Whether a site's ``scale`` (a number or a tensor from ``poutine.scale``) is exactly 1."""
    return bool((torch.as_tensor(scale) == 1).all())


class _Stage(NamedTuple):
    values: dict[str, Tensor]
    state: dict[str, Tensor]
    log_density: Tensor | None  # (rows,)
    noise: dict[str, Tensor]
    log_scale: Tensor | float


class PathReplay:
    """The centred and non-centred scores of a model along a path, for a :class:`ConditionalSMC`'s
    model and plates (see the module docstring).

    Args:
        csmc: the sampler whose model, plates and observation checks to use.
        batched: run the ``T`` steps as one run of ``step`` where it matches the step-by-step run
            (``None``, the default: checked on the first path); ``False``: always one at a time.

    Example:
        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> one = torch.eye(1)
        >>> csmc = ConditionalSMC(LinearGaussianSSM(one, one, one, one, torch.zeros(1), one), 3)
        >>> replay = PathReplay(csmc)
        >>> path = csmc.sweep(torch.zeros(4, 1))
        >>> _ = replay.log_density(path, torch.zeros(4, 1))
        >>> replay.batched  # no: this model names its sites per step (x_0, x_1, ...)
        False
    """

    def __init__(self, csmc: ConditionalSMC, batched: bool | None = None) -> None:
        if batched not in (None, False):
            raise ValueError(f"batched must be None (checked on the first path) or False, got {batched!r}")
        self.csmc = csmc
        #: ``None`` until checked, then whether the steps run as one batch
        self.batched: bool | None = batched

    # --- the two public scores -------------------------------------------------------------------

    def log_density(self, trajectory: Trajectory, observations: Any, *args: Any, **kwargs: Any) -> Tensor:
        """:math:`\\log p_\\theta(x_{0:T}, y_{1:T})` along ``trajectory`` (a scalar tensor), at the
        parameters the model holds now."""
        return self.noise(trajectory, observations, *args, **kwargs).trajectory.log_density

    def noise(self, trajectory: Trajectory, observations: Any, *args: Any, **kwargs: Any) -> NonCentred:
        """The path's standardised noise at the parameters the model holds now, with its
        complete-data log-density and :math:`\\sum \\log \\mathrm{scale}`."""
        ys, missing = self.csmc._observations(observations)
        if len(trajectory.sites) != len(ys) + 1:
            raise ValueError(f"trajectory: {len(trajectory.sites) - 1} time steps, but the observations have {len(ys)}")
        if self.batched is None:
            self.batched = self._check_batched(trajectory, observations, ys, missing, args, kwargs)
        if self.batched:
            stages = self._batched(trajectory, observations, missing, args, kwargs)
        else:
            stages = self._one_at_a_time(trajectory, ys, missing, args, kwargs, None)
        return _collect(stages, trajectory)

    def shift(self, trajectory: Trajectory, noise: list[dict[str, Tensor]], observations: Any, *args: Any, **kwargs: Any) -> NonCentred:
        """The path with ``noise`` at the parameters the model holds now: ``Normal`` sites
        recomputed from their noise, the other latent sites as in ``trajectory``; step by step."""
        ys, missing = self.csmc._observations(observations)
        stages = self._one_at_a_time(trajectory, ys, missing, args, kwargs, noise)
        return _collect(stages, None)

    # --- the runs ---------------------------------------------------------------------------------

    def _stage(self, fn: Any, state: dict, rows: int, args: tuple, kwargs: dict, values: dict, noise: dict | None, skip, where: str) -> _Stage:
        """One run of ``fn`` on ``rows`` rows along the path; ``skip``: a bool, or a ``(rows,)``
        mask of the rows whose observed sites are not scored (predict-only steps)."""
        csmc = self.csmc
        along = _AlongPath(values, noise, rows)
        with csmc._handlers(rows), poutine.trace() as tracer, along:
            fn(state, *args, **kwargs)
        trace = tracer.trace
        unknown = [n for n, s in trace.nodes.items() if is_latent(s)]
        if unknown:
            raise ValueError(f"at {where} the model samples latent sites {unknown} that the trajectory does not hold")
        scored = [n for n, s in trace.nodes.items() if is_scored(s)]
        latent = [n for n in scored if n in values]
        observed = [n for n in scored if n not in values]
        log_density = csmc._log_density(trace, rows, latent, where)
        if skip is not True and observed:
            log_obs = csmc._log_density(trace, rows, observed, where)
            if skip is not False:
                log_obs = torch.where(skip, torch.zeros_like(log_obs), log_obs)
            log_density = log_obs if log_density is None else log_density + log_obs
        values = {n: trace.nodes[n]["value"] for n in latent}
        return _Stage(values, dict(state), log_density, along.noise, along.log_scale)

    def _one_at_a_time(self, trajectory: Trajectory, ys: list, missing: list, args: tuple, kwargs: dict, noise: list | None) -> list[_Stage]:
        model, state, stages = self.csmc.model, {}, []
        with torch.no_grad():
            for k, sites in enumerate(trajectory.sites):
                values = {name: value.unsqueeze(0) for name, value in sites.items()}
                fn, step_args = (model.init, args) if k == 0 else (model.step, (ys[k - 1],) + args)
                where = "init" if k == 0 else f"time step {k - 1}"
                stage_noise = None if noise is None else {n: e.unsqueeze(0) for n, e in noise[k].items()}
                stage = self._stage(fn, state, 1, step_args, kwargs, values, stage_noise, k > 0 and missing[k - 1], where)
                stages.append(_squeeze(stage))
        return stages

    def _batched(self, trajectory: Trajectory, observations: Tensor, missing: list, args: tuple, kwargs: dict) -> list[_Stage]:
        """``init`` on one row, then every step at once on ``T`` rows (checked beforehand)."""
        model, num_steps = self.csmc.model, len(trajectory.sites) - 1
        with torch.no_grad():
            values = {name: value.unsqueeze(0) for name, value in trajectory.sites[0].items()}
            first = _squeeze(self._stage(model.init, {}, 1, args, kwargs, values, None, False, "init"))
            state = {key: torch.stack([s[key] for s in trajectory.states[:-1]]) for key in trajectory.states[1]}
            values = {name: torch.stack([s[name] for s in trajectory.sites[1:]]) for name in trajectory.sites[1]}
            skip = False
            if any(missing):
                # a predict-only row is not scored, but the model still sees it: it gets an observed
                # row's value in its place, so that a site validating its value does not refuse NaN
                skip = torch.tensor(missing, device=observations.device)
                fill = observations[missing.index(False)]
                observations = torch.where(skip.reshape((-1,) + (1,) * (observations.dim() - 1)), fill, observations)
            rest = self._stage(model.step, state, num_steps, (observations,) + args, kwargs, values, None, skip, "the time steps")
        stages = [first]
        log_density = rest.log_density
        log_scale = rest.log_scale if isinstance(rest.log_scale, Tensor) else None
        for t in range(num_steps):
            stages.append(
                _Stage(
                    {n: v[t] for n, v in rest.values.items()},
                    {k: v[t] for k, v in rest.state.items()},
                    None if log_density is None else log_density[t],
                    {n: e[t] for n, e in rest.noise.items()},
                    0.0 if log_scale is None else log_scale[t],
                )
            )
        return stages

    def _check_batched(self, trajectory: Trajectory, observations: Any, ys: list, missing: list, args: tuple, kwargs: dict) -> bool:
        """Whether one run of ``step`` over the steps gives what the step-by-step run gives here."""
        sites, states = trajectory.sites[1:], trajectory.states
        # Without ancestor sampling the sweep never checked that the model is first-order Markov,
        # and a state that reads further back could match on this path and not on the next.
        if not isinstance(observations, Tensor) or len(sites) < 2 or all(missing) or not self.csmc.ancestor_sampling:
            return False
        if any(set(s) != set(sites[0]) for s in sites) or any(set(s) != set(states[1]) for s in states[:-1]):
            return False
        reference = self._one_at_a_time(trajectory, ys, missing, args, kwargs, None)
        try:
            batched = self._batched(trajectory, observations, missing, args, kwargs)
        except Exception:  # noqa: BLE001 - any failure of the batched run means: not batchable
            return False
        for ref, got in zip(reference[1:], batched[1:]):
            if (ref.log_density is None) != (got.log_density is None) or set(ref.state) != set(got.state) or set(ref.noise) != set(got.noise):
                return False
            pairs = [(ref.state[k], got.state[k]) for k in ref.state] + [(ref.noise[n], got.noise[n]) for n in ref.noise]
            if ref.log_density is not None:
                pairs.append((ref.log_density, got.log_density))
            pairs.append((torch.as_tensor(ref.log_scale), torch.as_tensor(got.log_scale)))
            for a, b in pairs:
                if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
                    return False
        return True


def _squeeze(stage: _Stage) -> _Stage:
    """A one-row stage without its row dim."""
    log_scale = stage.log_scale[0] if isinstance(stage.log_scale, Tensor) else stage.log_scale
    return _Stage(
        {n: v[0] for n, v in stage.values.items()},
        {k: v[0] for k, v in stage.state.items()},
        None if stage.log_density is None else stage.log_density[0],
        {n: e[0] for n, e in stage.noise.items()},
        log_scale,
    )


def _collect(stages: list[_Stage], like: Trajectory | None) -> NonCentred:
    """The stages as a path; ``like``: reuse its sites and states (the centred scores hold them)."""
    terms = [s.log_density for s in stages if s.log_density is not None]
    if not terms:
        raise ValueError("the model scores nothing along the trajectory")
    log_density = torch.stack(terms).sum(0)
    log_scale = sum((torch.as_tensor(s.log_scale, dtype=log_density.dtype) for s in stages), log_density.new_zeros(()))
    if like is None:
        trajectory = Trajectory([s.values for s in stages], [s.state for s in stages], log_density)
    else:
        trajectory = like._replace(log_density=log_density)
    return NonCentred(trajectory, [s.noise for s in stages], log_scale)
