"""ArviZ export: ``to_inference_data`` for :class:`~pyro_smc.SMC` runs, streaming filters, Gaussian results and guides.

* An :class:`~pyro_smc.SMC` run becomes one chain per filter. The final weighted particles (after
  the last reweighting, before that step's resampling: ``SMC.weighted_particles``) are resampled
  to equal weight (multinomially, ``num_draws`` per filter, default the number of particles) into
  the ``posterior`` group; ``sample_stats`` holds each draw's ``log_weight`` (the normalised
  log-weight of the particle it copies), and the filter's ``log_evidence`` and ``ess`` (constant
  along the draw dimension, as ArviZ wants ``(chain, draw)`` arrays); ``attrs`` repeats the
  per-filter log-evidence.
* With ``smoothing="ffbs" | "rejection" | "genealogy"``, an :class:`~pyro_smc.SMC` run built with
  ``store_history=True`` exports smoothed trajectories instead (``SMC.smooth``): one chain per
  filter, ``num_draws`` trajectories per chain as draws, dims ``(chain, draw, time, *event)`` for
  every state key (labels included); ``sample_stats`` holds the filter's ``log_evidence`` (constant
  along the draw dimension) and ``attrs`` the per-filter log-evidence and the smoothing method.
* An :class:`~pyro_smc.OnlineVariationalFilter` becomes one chain of lagged smoothing draws
  ``x`` with dims ``(chain, draw, lag, state_dim)``; ``attrs`` holds the running ELBO.
* A Gaussian result (of :class:`~pyro_smc.EPSmoother`, a Gaussian filter or smoother of
  :mod:`pyro_smc.infer`, or the Kalman filter and RTS smoother of a
  :class:`~pyro_smc.models.LinearGaussianSSM`) becomes ``num_chains`` chains of draws from its
  marginals ``N(means[t], covariances[t])``, ``x`` with dims ``(chain, draw, time, x_dim_0)``.
  Each time step is drawn on its own: the draws carry the marginals exactly (what ``az.summary``
  and ``az.plot_forest`` read) but not the correlation between time steps, which these results do
  not hold. ``attrs`` holds the method, the log-evidence, and for EP whether it converged and
  each sweep's change.
* Any guide (an ``AutoGuide`` such as :class:`~pyro_smc.guides.AutoKroneckerFlow`, or a
  :class:`~pyro_smc.guides.StreamingFilterGuide`) is sampled with ``pyro.infer.Predictive``:
  every latent site of the model goes to ``posterior``, split into ``num_chains`` chains.

Example:
    >>> import torch, arviz as az
    >>> from pyro_smc import SMC
    >>> from pyro_smc.arviz import to_inference_data
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(10)
    >>> idata = to_inference_data(SMC(ssm, num_particles=200, num_filters=2).run(ys))
    >>> idata.posterior["x"].shape
    (2, 200, 2)
    >>> summary = az.summary(idata, var_names=["x"])

    Smoothed trajectories (needs ``store_history=True``):

    >>> smc = SMC(ssm, num_particles=200, num_filters=2, store_history=True).run(ys)
    >>> idata = to_inference_data(smc, smoothing="ffbs", num_draws=50)
    >>> idata.posterior["x"].dims
    ('chain', 'draw', 'time', 'x_dim_0')
    >>> idata.posterior["x"].shape
    (2, 50, 10, 2)

    An EP run's marginals:

    >>> from pyro_smc import EPSmoother
    >>> idata = to_inference_data(EPSmoother(ssm).smooth(ys), num_draws=400, num_chains=2)
    >>> idata.posterior["x"].shape, idata.attrs["method"]
    ((2, 200, 10, 2), 'EPSmoother')
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from pyro.infer import Predictive
from torch import Tensor

from pyro_smc.infer.gaussian import GaussianSmootherResult
from pyro_smc.infer.online import OnlineVariationalFilter
from pyro_smc.infer.smc import SMC
from pyro_smc.ops.results import FilterResult, SmootherResult
from pyro_smc.tracing import latent_sites, trace_program

__all__ = ["to_inference_data"]


def _numpy(x: Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def _check_started(smc: SMC) -> None:
    try:
        smc.log_weights  # noqa: B018 - the property raises before anything was weighed
    except RuntimeError:
        raise ValueError("to_inference_data: the SMC object has not been run (call .run or .init/.step first)") from None


def _from_smc(smc: SMC, num_draws: int | None, generator: torch.Generator | None):
    import arviz as az

    _check_started(smc)
    particles, log_w = smc.weighted_particles
    log_w = log_w.detach()  # (B, N)
    B, N = log_w.shape
    num_draws = N if num_draws is None else int(num_draws)
    if num_draws < 1:
        raise ValueError(f"num_draws must be >= 1, got {num_draws}")
    index = torch.multinomial(log_w.exp().cpu(), num_draws, replacement=True, generator=generator).to(log_w.device)  # (B, D)
    posterior = {}
    for key, value in particles.items():
        batched = value if smc.num_filters > 1 else value.unsqueeze(0)
        if not isinstance(batched, Tensor):
            continue
        gather = index.reshape(index.shape + (1,) * (batched.dim() - 2)).expand(index.shape + batched.shape[2:])
        posterior[key] = _numpy(torch.gather(batched.detach(), 1, gather))
    log_evidence = smc.log_evidence.detach()
    sample_stats = {
        "log_weight": _numpy(torch.gather(log_w, 1, index)),
        "log_evidence": _numpy(log_evidence.unsqueeze(-1).expand(B, num_draws)),
        "ess": _numpy(smc.ess.detach().unsqueeze(-1).expand(B, num_draws)),
    }
    attrs = {"inference_library": "pyro_smc", "method": "SMC", "log_evidence": _numpy(log_evidence).tolist(), "num_particles": N}
    return az.from_dict(posterior=posterior, sample_stats=sample_stats, attrs=attrs)


def _from_smc_smoothed(smc: SMC, method: str, num_draws: int | None, generator: torch.Generator | None):
    import arviz as az

    if not smc.store_history:
        raise ValueError("to_inference_data(..., smoothing=...) needs the particle history: build the engine with SMC(..., store_history=True)")
    _check_started(smc)
    if generator is not None:
        raise ValueError("to_inference_data: generator= is not supported with smoothing= (SMC.smooth uses the global RNG: torch.manual_seed)")
    num_draws = smc.num_particles if num_draws is None else int(num_draws)
    if num_draws < 1:
        raise ValueError(f"num_draws must be >= 1, got {num_draws}")
    trajectories = smc.smooth(num_draws, method=method)  # {key: (S, T, B, *event)}
    posterior, dims = {}, {}
    for key, value in trajectories.items():
        posterior[key] = _numpy(value.movedim(2, 0))  # (B, S, T, *event)
        dims[key] = ["time"] + [f"{key}_dim_{i}" for i in range(value.dim() - 3)]
    T = next(iter(trajectories.values())).shape[1] if trajectories else 0
    log_evidence = smc.log_evidence.detach()
    B = log_evidence.shape[0]
    attrs = {
        "inference_library": "pyro_smc",
        "method": "SMC",
        "smoothing": method,
        "log_evidence": _numpy(log_evidence).tolist(),
        "num_particles": smc.num_particles,
    }
    return az.from_dict(
        posterior=posterior,
        sample_stats={"log_evidence": _numpy(log_evidence.unsqueeze(-1).expand(B, num_draws))},
        coords={"time": np.arange(T)},
        dims=dims,
        attrs=attrs,
    )


def _from_online(vf: OnlineVariationalFilter, num_draws: int | None, lag: int | None):
    import arviz as az

    draws = vf.smoothing_samples(1000 if num_draws is None else num_draws, lag)
    return az.from_dict(
        posterior={"x": _numpy(draws).reshape((1,) + tuple(draws.shape))},
        dims={"x": ["lag", "state_dim"]},
        attrs={"inference_library": "pyro_smc", "method": "OnlineVariationalFilter", "elbo": float(vf.elbo), "t": vf.t},
    )


GAUSSIAN_RESULTS = (GaussianSmootherResult, FilterResult, SmootherResult)


def _from_gaussian(result, num_draws: int | None, num_chains: int, generator: torch.Generator | None):
    import arviz as az

    num_draws = 1000 if num_draws is None else int(num_draws)
    if num_draws < 1 or num_chains < 1 or num_draws % num_chains:
        raise ValueError(f"num_draws ({num_draws}) must be a positive multiple of num_chains ({num_chains})")
    means, covs = result.means.detach(), result.covariances.detach()
    if means.dim() != 2 or covs.shape != means.shape + means.shape[-1:]:
        raise ValueError(f"to_inference_data: a Gaussian result needs means (T, d) and covariances (T, d, d), got {tuple(means.shape)} and {tuple(covs.shape)}")
    chol, info = torch.linalg.cholesky_ex(covs)
    if bool((info > 0).any()):
        t = int((info > 0).nonzero()[0])
        raise ValueError(f"to_inference_data: the covariance at time step {t} is not positive definite; its marginal cannot be sampled")
    T, d = means.shape
    noise = torch.randn((num_draws, T, d, 1), dtype=means.dtype, device=means.device, generator=generator)
    draws = means + (chol @ noise).squeeze(-1)  # (S, T, d)
    if isinstance(result, GaussianSmootherResult) and result.history:
        method = "EPSmoother"
    else:
        method = {FilterResult: "Kalman filter", SmootherResult: "RTS smoother"}.get(type(result), "Gaussian smoother")
    attrs: dict[str, Any] = {"inference_library": "pyro_smc", "method": method, "marginal_draws": "independent across time"}
    log_evidence = result.log_evidence
    if log_evidence is not None:
        attrs["log_evidence"] = float(log_evidence.detach())
    if method == "EPSmoother":
        attrs["converged"] = int(result.converged)
        attrs["ep_changes"] = [float(it.change) for it in result.history]
    return az.from_dict(
        posterior={"x": _numpy(draws).reshape((num_chains, num_draws // num_chains, T, d))},
        coords={"time": np.arange(T)},
        dims={"x": ["time", "x_dim_0"]},
        attrs=attrs,
    )


def _latent_sites(model: Callable, args, kwargs) -> dict[str, torch.Size]:
    trace = trace_program(model, *args, **kwargs)
    return {name: trace.nodes[name]["value"].shape for name in latent_sites(trace)}


def _from_guide(guide: Callable, model: Callable | None, args, kwargs, num_draws: int | None, num_chains: int):
    import arviz as az

    model = model if model is not None else getattr(guide, "model", None)
    if model is None:
        model = getattr(guide, "_model", (None,))[0]
    if model is None:
        raise ValueError("to_inference_data: pass model= for a guide that does not carry its model")
    num_draws = 1000 if num_draws is None else int(num_draws)
    if num_draws < 1 or num_chains < 1 or num_draws % num_chains:
        raise ValueError(f"num_draws ({num_draws}) must be a positive multiple of num_chains ({num_chains})")
    sites = _latent_sites(model, args, kwargs)
    with torch.no_grad():
        samples = Predictive(model, guide=guide, num_samples=num_draws, return_sites=list(sites), parallel=False)(*args, **kwargs)
    # Predictive pads global sites with singleton plate dims; one trace's shape is the site's shape.
    posterior = {name: _numpy(value).reshape((num_chains, num_draws // num_chains) + tuple(sites[name])) for name, value in samples.items()}
    return az.from_dict(posterior=posterior, attrs={"inference_library": "pyro_smc", "method": type(guide).__name__})


def to_inference_data(
    obj: Any,
    *args,
    model: Callable | None = None,
    num_draws: int | None = None,
    num_chains: int = 1,
    lag: int | None = None,
    generator: torch.Generator | None = None,
    smoothing: str | None = None,
    **kwargs,
):
    """ArviZ ``InferenceData`` from an ``SMC`` run, an ``OnlineVariationalFilter``, a Gaussian
    result (EP, the Gaussian filters and smoothers, Kalman) or a guide.

    Args:
        obj: a run :class:`~pyro_smc.SMC`, an :class:`~pyro_smc.OnlineVariationalFilter`, a
            :class:`~pyro_smc.infer.GaussianSmootherResult` (or the Kalman filter's and RTS
            smoother's results), or a guide.
        *args: the model's positional arguments (guides only).
        **kwargs: the model's keyword arguments (guides only).
        model: the model a guide approximates (defaults to ``guide.model``).
        num_draws: draws per chain for SMC (default: the number of particles); total draws for
            a guide, a Gaussian result or a streaming filter (default 1000).
        num_chains: chains to split a guide's or a Gaussian result's draws into (SMC uses one
            chain per filter).
        lag: how far back a streaming filter's smoothing draws go (default: its whole window).
        generator: random generator for SMC's equal-weight resampling (not with ``smoothing``)
            and a Gaussian result's draws.
        smoothing: SMC only: export smoothed trajectories drawn by ``SMC.smooth(num_draws,
            method=smoothing)`` (``"ffbs"``, ``"rejection"`` or ``"genealogy"``) instead of the final
            filtering particles; the engine must be built with ``store_history=True``. The draws
            use the global torch RNG, so ``torch.manual_seed(s)`` before this call gives the
            same trajectories as ``torch.manual_seed(s); smc.smooth(num_draws, method)``.

    Returns:
        ``arviz.InferenceData`` with a ``posterior`` group (and ``sample_stats`` for SMC). For SMC,
        a state key ``x`` of per-filter shape ``(N, *event)`` becomes ``(num_filters, num_draws,
        *event)`` (dims ``chain, draw, x_dim_0, ...``); with ``smoothing`` it becomes
        ``(num_filters, num_draws, T, *event)`` (dims ``chain, draw, time, x_dim_0, ...``, ``T``
        the number of steps taken). ``sample_stats["log_evidence"]`` is ``(num_filters, num_draws)``.
        A Gaussian result gives ``x`` of shape ``(num_chains, num_draws / num_chains, T, d)``.

    Raises:
        ValueError: an SMC that has not been run, ``smoothing`` on an engine without
            ``store_history=True`` or with ``generator``, ``num_draws < 1``, a guide's
            ``num_draws`` not a multiple of ``num_chains``, a Gaussian result whose covariance
            is not positive definite (naming the time step), or an object of another type.

    Example:
        >>> import torch
        >>> from pyro_smc import SMC
        >>> from pyro_smc.arviz import to_inference_data
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
        >>> _, ys = ssm.simulate(5)
        >>> smc = SMC(ssm, num_particles=20, num_filters=3).run(ys)
        >>> idata = to_inference_data(smc, num_draws=10)
        >>> idata.posterior["x"].shape                       # (num_filters, num_draws, d)
        (3, 10, 2)
        >>> idata.sample_stats["log_evidence"].shape         # (num_filters, num_draws)
        (3, 10)
    """
    if smoothing is not None and not isinstance(obj, SMC):
        raise ValueError(f"to_inference_data: smoothing= applies to an SMC run, not a {type(obj).__name__}")
    if isinstance(obj, SMC):
        if smoothing is not None:
            return _from_smc_smoothed(obj, smoothing, num_draws, generator)
        return _from_smc(obj, num_draws, generator)
    if isinstance(obj, OnlineVariationalFilter):
        return _from_online(obj, num_draws, lag)
    if isinstance(obj, GAUSSIAN_RESULTS):
        return _from_gaussian(obj, num_draws, num_chains, generator)
    if callable(obj):
        return _from_guide(obj, model, args, kwargs, num_draws, num_chains)
    raise ValueError(f"to_inference_data: cannot convert a {type(obj).__name__}; pass an SMC, an OnlineVariationalFilter, a Gaussian result or a guide")
