"""Checkpoints of :class:`~pyro_smc.infer.smc.SMC`: ``state_dict`` and ``load_state_dict``.

A checkpoint holds everything needed to continue the filters exactly: particles, log-weights, the
running log-evidence, ESS, the per-step histories (the smoothing history included), the step
count, the model's and guide's plain attributes and the torch RNG state, detached. The host class
provides the engine's attributes (``state``, ``log_weights``, ``_means`` and the other histories,
``model``, ``guide``) and ``_reset``.
"""

from __future__ import annotations

from typing import Any

from pyro_smc.infer import smc_smoothing as smoothing
from pyro_smc.infer.model_state import plain_attributes, restore_attributes, rng_state, set_rng_state

__all__ = ["SMCCheckpointMixin"]


class SMCCheckpointMixin:
    """``state_dict`` / ``load_state_dict`` for a particle filter (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the filters exactly: particles, log-weights, the running
        log-evidence, ESS, the per-step histories, the step count, the model's (and guide's) plain
        attributes (scalars such as a step counter, and cached tensors) and the torch RNG state. Model and proposal
        *parameters* live in Pyro's param store; save it alongside (``pyro.get_param_store().get_state()``).
        Tensors are detached: a resumed run continues the values, not the autograd graph."""

        def detached(x):
            return None if x is None else x.detach().clone()

        return {
            "t": self._t,
            "initialized": self._initialized,
            "state": {k: v.detach().clone() for k, v in self.state.items()},
            "log_weights": detached(self.log_weights),
            "log_evidence": detached(self.log_evidence),
            "ess": detached(self.ess),
            "weighted": None if self._weighted is None else ({k: v.detach().clone() for k, v in self._weighted[0].items()}, detached(self._weighted[1])),
            "means": {k: [v.detach().clone() for v in values] for k, values in self._means.items()},
            "ess_history": [v.clone() for v in self._ess_history],
            "increments": [v.detach().clone() for v in self._increments],
            "converged": None if self._converged is None else [v.clone() for v in self._converged],
            "unrecorded_increment": detached(self._unrecorded_increment),
            "resampled": [v.clone() for v in self._resampled],
            "history": [smoothing.detached_record(record) for record in self._history],
            "model_attributes": plain_attributes(self.model),
            "guide_attributes": plain_attributes(self.guide),
            **rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any], restore_rng: bool = True) -> None:
        """Restores :meth:`state_dict` into an ``SMC`` built with the same settings and model class;
        with ``restore_rng`` the filters continue bit-identically."""
        self._reset()
        self._t = int(state["t"])
        self._initialized = bool(state["initialized"])
        for key, value in state["state"].items():
            dict.__setitem__(self.state, key, value.clone())
        self.log_weights, self.log_evidence, self.ess = state["log_weights"], state["log_evidence"], state["ess"]
        self._weighted = state.get("weighted")
        self._means = {k: list(v) for k, v in state["means"].items()}
        self._ess_history = list(state["ess_history"])
        # Checkpoints written before the increments were recorded resume without their history.
        self._increments = list(state.get("increments", []))
        self._unrecorded_increment = state.get("unrecorded_increment")
        self._converged = None if state.get("converged") is None else list(state["converged"])
        self._resampled = list(state["resampled"])
        self._history = list(state.get("history", []))
        restore_attributes(self.model, state["model_attributes"])
        restore_attributes(self.guide, state["guide_attributes"])
        if restore_rng:
            set_rng_state(state)
