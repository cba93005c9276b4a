"""Pictures of a run: means with bands against the truth, ESS over time, EP's iterations.

Needs matplotlib (``pip install "pyro-smc[plot]"``), imported only when a function is called.
Every function draws into ``ax`` (default: a new figure's axes) and returns it, so plots compose
as in matplotlib itself.

- :func:`plot_means`: filtering or smoothing means of one state coordinate, with a central band,
  against the true path. It reads an :class:`~pyro_smc.SMC` run (the band from the weighted
  particles when it was built with ``store_history=True``: :meth:`~pyro_smc.SMC.filtering_quantiles`),
  trajectories from ``SMC.smooth`` (the band from their quantiles), or a Gaussian result
  (EP, the Gaussian filters and smoothers, Kalman: ``mean +- z sd``).
- :func:`plot_ess`: the effective sample size over time, per filter, with a mark where a filter
  resampled and the resampling threshold.
- :func:`plot_ep_iterations`: the largest change of the marginals at each EP sweep against ``tol``.

Example:
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import torch
    >>> from pyro_smc import SMC, EPSmoother
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> from pyro_smc.plotting import plot_ep_iterations, plot_ess, plot_means
    >>> eye = torch.eye(1)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.3 * eye, eye, 0.5 * eye, torch.zeros(1), eye)
    >>> xs, ys = ssm.simulate(30)
    >>> smc = SMC(ssm, num_particles=300, store_history=True).run(ys)
    >>> ax = plot_means(smc, truth=xs, label="SMC")
    >>> ax = plot_means(ssm.kalman_filter(ys), ax=ax, label="Kalman")
    >>> ax = plot_ess(smc)
    >>> ax = plot_ep_iterations(EPSmoother(ssm, tol=1e-6).smooth(ys), tol=1e-6)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pyro_smc.infer.gaussian import GaussianSmootherResult
from pyro_smc.infer.smc import SMC
from pyro_smc.ops.results import FilterResult, SmootherResult

__all__ = ["plot_ep_iterations", "plot_ess", "plot_means"]

_GAUSSIAN = (GaussianSmootherResult, FilterResult, SmootherResult)


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 3))[1]


def _numpy(x: Tensor):
    return x.detach().cpu().double().numpy()


def _coordinate(x: Tensor, dim: int, name: str) -> Tensor:
    """``x (T, ...)`` at state coordinate ``dim`` (flattened event), shape ``(T,)``."""
    flat = x.reshape(x.shape[0], -1)
    if not -flat.shape[1] <= dim < flat.shape[1]:
        raise ValueError(f"dim={dim} is out of range for {name} with {flat.shape[1]} coordinate(s) per step")
    return flat[:, dim]


def _band(obj: Any, key: str | None, dim: int, filter: int, level: float) -> tuple[Tensor, Tensor | None, Tensor | None, str, str]:
    """``(mean, lower, upper, what, name)``: the curves, each ``(T,)`` (no band when the object
    holds none), and the state key plotted (``"x"`` for a Gaussian result)."""
    lo, hi = (1 - level) / 2, (1 + level) / 2
    if isinstance(obj, _GAUSSIAN):
        mean = _coordinate(obj.means, dim, "the means")
        sd = _coordinate(obj.covariances.diagonal(dim1=-2, dim2=-1), dim, "the covariances").clamp(min=0).sqrt()
        z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(hi, dtype=torch.float64)))
        return mean, mean - z * sd, mean + z * sd, "Gaussian marginal", "x"
    if isinstance(obj, SMC):
        means = obj.filtering_means
        key = _only_key(means, key)
        if not -obj.num_filters <= filter < obj.num_filters:
            raise ValueError(f"filter={filter} is out of range for {obj.num_filters} filter(s)")
        mean = _coordinate(means[key][:, filter], dim, f"state key {key!r}")
        if not obj.store_history:
            return mean, None, None, "filtering mean", key
        q = obj.filtering_quantiles([lo, hi], key)[:, :, filter]  # (2, T, *event)
        return mean, _coordinate(q[0], dim, key), _coordinate(q[1], dim, key), "filtering", key
    if isinstance(obj, dict):  # SMC.smooth's trajectories {key: (S, T, B, *event)}
        key = _only_key(obj, key)
        paths = obj[key]
        if paths.dim() < 3:
            raise ValueError(f"trajectories must be SMC.smooth's {{key: (S, T, B, *event)}}, got {tuple(paths.shape)} for {key!r}")
        paths = paths[:, :, filter].double()
        paths = paths.reshape(paths.shape[0], paths.shape[1], -1)[..., dim]  # (S, T)
        q = torch.quantile(paths, torch.tensor([lo, hi], dtype=paths.dtype), dim=0)
        return paths.mean(0), q[0], q[1], "smoothed", key
    raise TypeError(f"plot_means takes an SMC run, SMC.smooth's trajectories or a Gaussian result, got a {type(obj).__name__}")


def _only_key(values: dict, key: str | None) -> str:
    if key is None:
        if len(values) != 1:
            raise ValueError(f"the state has several keys {list(values)}; pass key=")
        return next(iter(values))
    if key not in values:
        raise ValueError(f"unknown key {key!r}; the state holds {list(values)}")
    return key


def plot_means(
    obj: Any,
    truth: Tensor | None = None,
    *,
    key: str | None = None,
    dim: int = 0,
    filter: int = 0,
    level: float = 0.9,
    ax=None,
    label: str | None = None,
    color: str | None = None,
):
    """The means of one state coordinate over time with a central ``level`` band.

    Args:
        obj: an :class:`~pyro_smc.SMC` run (a band only with ``store_history=True``), the
            trajectories ``{key: (S, T, B, *event)}`` of ``SMC.smooth``, or a Gaussian result
            (``means (T, d)``, ``covariances (T, d, d)``).
        truth: the true path, ``(T,)`` or ``(T, d)``, drawn as a black line.
        key: the state key (SMC and trajectories; default: the only one).
        dim: the coordinate of the (flattened) state.
        filter: which of the ``B`` filters (SMC and trajectories).
        level: the band's probability, in ``(0, 1)``.
        ax: matplotlib axes to draw into (default: a new figure).
        label: the legend entry of the mean (default: what is drawn).
        color: matplotlib colour of the mean and its band.

    Returns:
        The axes.

    Raises:
        TypeError: an object of another kind.
        ValueError: ``level`` outside ``(0, 1)``, an unknown key, or ``dim``/``filter`` out of range.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    mean, lower, upper, what, name = _band(obj, key, dim, filter, level)
    ax = _axes(ax)
    t = range(mean.shape[0])
    (line,) = ax.plot(t, _numpy(mean), color=color, lw=1.5, label=label or f"{what} mean")
    if lower is not None:
        ax.fill_between(t, _numpy(lower), _numpy(upper), color=line.get_color(), alpha=0.2, lw=0, label=f"{level:.0%} band")
    if truth is not None:
        true = truth.reshape(truth.shape[0], -1)[:, dim] if truth.dim() > 1 else truth
        ax.plot(range(true.shape[0]), _numpy(true), color="black", lw=1, ls="--", label="truth")
    ax.set_xlabel("time step")
    ax.set_ylabel(f"{name}[{dim}]")
    ax.legend(loc="best", fontsize="small", frameon=False)
    return ax


def plot_ess(smc: SMC, *, filters: list[int] | None = None, ax=None):
    """The effective sample size over time as a fraction of ``N``, one line per filter, a tick
    at the bottom where a filter resampled, and the resampling threshold.

    Args:
        smc: a run :class:`~pyro_smc.SMC`.
        filters: which filters (default: up to the first 8).
        ax: matplotlib axes to draw into (default: a new figure).

    Returns:
        The axes.
    """
    if not isinstance(smc, SMC):
        raise TypeError(f"plot_ess takes an SMC run, got a {type(smc).__name__}")
    ess, resampled = smc.ess_history, smc.resampled  # (T, B)
    filters = list(range(min(8, ess.shape[1]))) if filters is None else list(filters)
    ax = _axes(ax)
    n = smc.num_particles
    for b in filters:
        (line,) = ax.plot(_numpy(ess[:, b] / n), lw=1, label=f"filter {b}" if len(filters) > 1 else "ESS / N")
        steps = resampled[:, b].nonzero().flatten().tolist()
        ax.plot(steps, [0.0] * len(steps), "|", color=line.get_color(), ms=8)
    ax.axhline(smc.ess_threshold, color="grey", lw=0.8, ls=":", label=f"threshold {smc.ess_threshold:g}")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("time step (ticks: resampled)")
    ax.set_ylabel("ESS / N")
    ax.legend(loc="best", fontsize="small", frameon=False)
    return ax


def plot_ep_iterations(result: GaussianSmootherResult, *, tol: float | None = None, ax=None):
    """EP's largest change of the marginals at each sweep (log scale) and the tolerance.

    Args:
        result: an :class:`~pyro_smc.EPSmoother` result (its ``history``).
        tol: the smoother's ``tol``, drawn as a line.
        ax: matplotlib axes to draw into (default: a new figure).

    Returns:
        The axes. The first sweep has no change to measure (it starts from nothing) and is left out.
    """
    history = getattr(result, "history", ())
    if not history:
        raise ValueError("plot_ep_iterations needs an EPSmoother result (its history of sweeps); this result has none")
    changes = [(k + 1, it.change) for k, it in enumerate(history) if it.change != float("inf")]
    ax = _axes(ax)
    if changes:
        ax.semilogy([k for k, _ in changes], [max(c, 1e-300) for _, c in changes], "o-", ms=3, label="largest change")
    if tol is not None:
        ax.axhline(tol, color="grey", lw=0.8, ls=":", label=f"tol {tol:g}")
    ax.set_xlabel("sweep")
    ax.set_ylabel("max |change| of the marginals")
    ax.set_title("converged" if result.converged else "not converged", fontsize="small")
    ax.legend(loc="best", fontsize="small", frameon=False)
    return ax
