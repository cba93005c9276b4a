"""Checkpoints of the online variational filter: everything needed to continue a stream exactly.

A checkpoint holds the step count, the running log-evidence with its increment and standard
error, the guide's parameters, the frozen previous marginal and the window of backward kernels,
the value and score regressors, the parameters being learned, the carried state batch, the
per-step history behind ``result``, the model's plain attributes (scalars such as a step counter,
and cached tensors), and the torch RNG state. Adam's moments are not included: they are reset at
every step.

Example:
    >>> import torch
    >>> from pyro_smc import OnlineVariationalFilter
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(3)
    >>> vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=2).run(ys)
    >>> checkpoint = vf.state_dict()
    >>> checkpoint["t"], bool(checkpoint["log_evidence"] == vf.log_evidence)
    (3, True)
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from pyro.distributions import TorchDistribution
from torch import Tensor

from pyro_smc.guides.streaming.family import GaussianKernel, gaussian
from pyro_smc.infer.model_state import plain_attributes, restore_attributes, rng_state, set_rng_state

if TYPE_CHECKING:
    from pyro_smc.infer.online.filter import OnlineVariationalFilter

__all__ = ["load_state_dict", "state_dict"]


def state_dict(vf: OnlineVariationalFilter) -> dict[str, Any]:
    """The checkpoint of ``vf`` (see the module docstring); save it with ``torch.save``."""
    return {
        "t": vf.t,
        "log_evidence": vf.log_evidence.clone(),
        "log_evidence_increment": vf.log_evidence_increment.clone(),
        "log_evidence_standard_error": vf.log_evidence_standard_error.clone(),
        "unreliable_steps": list(vf.unreliable_steps),
        "param_names": list(vf._param_names),
        "guide": {k: v.detach().clone() for k, v in vf.guide.state_dict().items()},
        "previous": _marginal_state(vf._previous),
        "kernels": [vars(k).copy() for k in vf._kernels],
        "value": None if vf._value is None else vf._value.state_dict(),
        **vf._learner.state_dict(),
        "state": dict(vf._state),
        "state_key": vf._state_key,
        "obs_shape": vf._obs_shape,
        "history": {k: list(v) for k, v in vf._history.items()},
        "model_attributes": plain_attributes(vf.model),
        **rng_state(),
    }


def load_state_dict(vf: OnlineVariationalFilter, state: dict[str, Any], restore_rng: bool) -> None:
    """Restores :func:`state_dict` into ``vf``, built with the same model class, guide
    configuration and settings; with ``restore_rng`` the stream continues bit-identically."""
    vf.t = int(state["t"])
    vf.log_evidence = state["log_evidence"].clone()
    vf.log_evidence_increment = state["log_evidence_increment"].clone()
    vf.log_evidence_standard_error = state["log_evidence_standard_error"].clone()
    vf.unreliable_steps = list(state["unreliable_steps"])
    vf._param_names.update(dict.fromkeys(state["param_names"]))
    vf.guide.load_state_dict(state["guide"])
    prev = state["previous"]
    vf._previous = None if prev is None else gaussian(prev["loc"].clone(), prev["scale"].clone())
    vf._kernels = deque((GaussianKernel(**k) for k in state["kernels"]), maxlen=vf.window)
    vf._value = None
    if state["value"] is not None:
        vf._value_regressor.load_state_dict(state["value"])
        vf._value = vf._value_regressor
    vf._learner.load_state_dict(state, vf.model)
    vf._state = dict(state["state"])
    vf._state_key = state["state_key"]
    vf._obs_shape = state["obs_shape"]
    vf._history = {k: list(v) for k, v in state["history"].items()}
    restore_attributes(vf.model, state["model_attributes"])
    if restore_rng:
        set_rng_state(state)


def _marginal_state(marginal: TorchDistribution | None) -> dict[str, Tensor] | None:
    """A frozen marginal as ``{"loc", "scale"}`` (standard deviations or a Cholesky factor)."""
    if marginal is None:
        return None
    scale = marginal.scale_tril if hasattr(marginal, "scale_tril") else marginal.base_dist.scale
    return {"loc": marginal.mean.clone(), "scale": scale.clone()}
