"""What :meth:`SMC.state_dict` and :meth:`OnlineVariationalFilter.state_dict` share: the RNG
state and a model's plain attributes (step counters, cached tensors), so that a stream resumed
from a checkpoint continues bit-identically."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["plain_attributes", "restore_attributes", "rng_state", "set_rng_state"]

_PLAIN = (bool, int, float, str, Tensor)


def plain_attributes(obj: Any) -> dict[str, Any] | None:
    """The scalar and tensor attributes of ``obj`` (``None`` for ``None``)."""
    return None if obj is None else {k: v for k, v in vars(obj).items() if isinstance(v, _PLAIN)}


def restore_attributes(obj: Any, attributes: dict[str, Any] | None) -> None:
    """Writes :func:`plain_attributes` back (a no-op for ``None`` or an empty dict)."""
    if obj is not None and attributes:
        vars(obj).update(attributes)


def rng_state() -> dict[str, Any]:
    """``{"rng_state": ..., "cuda_rng_state": ...}``; the CUDA entry is ``None`` unless CUDA is in use.

    One copy of the CPU generator's state: a compiled SMC step snapshots it at every replay, and
    ``torch.cuda.is_initialized()`` alone (False where CUDA is absent) is cheaper than asking
    whether CUDA is available."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"rng_state": torch.default_generator.get_state(), "cuda_rng_state": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores the entries :func:`rng_state` wrote into ``state``."""
    torch.set_rng_state(state["rng_state"])
    if state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng_state"])
