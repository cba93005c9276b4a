"""Checkpoints of :class:`~pyro_smc.SMC`: the particle state plus the step records.

A checkpoint holds everything needed to continue the filters exactly: the particles, the
weights (:class:`~pyro_smc.infer.smc.state.ParticleWeights`), the effective sample size, the
step records (:class:`~pyro_smc.infer.smc.result.StepRecord`), the smoothing history, the step
count, the model's and guide's plain attributes and the torch RNG state, all detached.

Example:
    >>> import torch
    >>> from pyro_smc import SMC
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(4)
    >>> smc = SMC(ssm, num_particles=10).run(ys)
    >>> resumed = SMC(ssm, num_particles=10)
    >>> resumed.load_state_dict(smc.state_dict())
    >>> torch.equal(resumed.log_evidence, smc.log_evidence.detach()), len(resumed.records)
    (True, 4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from pyro_smc.infer.model_state import plain_attributes, restore_attributes, rng_state, set_rng_state
from pyro_smc.infer.smc import smoothing
from pyro_smc.infer.smc.result import StepRecord
from pyro_smc.infer.smc.state import ParticleWeights

if TYPE_CHECKING:
    from pyro_smc.infer.smc.engine import SMC

__all__ = ["load_state_dict", "state_dict"]


def _detached(x: Any) -> Any:
    """A detached copy of a tensor, of the tensors of a dict or tuple, or ``None``."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return type(x)(*[_detached(v) for v in x]) if hasattr(x, "_fields") else type(x)(_detached(v) for v in x)


def state_dict(smc: SMC) -> dict[str, Any]:
    """The checkpoint of ``smc`` (see the module docstring)."""
    return {
        "t": smc._t,
        "initialized": smc._initialized,
        "state": _detached(dict(smc.state)),
        "weights": _detached(smc._weights),
        "ess": _detached(smc.ess),
        "weighted": _detached(smc._weighted),
        "records": [_detached(record) for record in smc._records],
        "history": [smoothing.detached_record(record) for record in smc._history],
        "model_attributes": plain_attributes(smc.model),
        "guide_attributes": plain_attributes(smc.guide),
        **rng_state(),
    }


def load_state_dict(smc: SMC, state: dict[str, Any], restore_rng: bool) -> None:
    """Restores :func:`state_dict` into ``smc``, built with the same settings and model class."""
    smc._reset()
    smc._t = int(state["t"])
    smc._initialized = bool(state["initialized"])
    smc.state.replace({key: value.clone() for key, value in state["state"].items()})
    smc._weights = None if state["weights"] is None else ParticleWeights(*state["weights"])
    smc.ess = state["ess"]
    smc._weighted = state["weighted"]
    smc._records = [StepRecord(*record) for record in state["records"]]
    smc._history = list(state["history"])
    restore_attributes(smc.model, state["model_attributes"])
    restore_attributes(smc.guide, state["guide_attributes"])
    if restore_rng:
        set_rng_state(state)
