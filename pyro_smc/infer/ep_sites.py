"""The messages of the EP smoother (``docs/math/ep.md#expectation-propagation``): three Gaussian
site messages per time step in natural form, their cavities and marginals, damped updates, and
the flat vector form in which :class:`~pyro_smc.EPSmoother` differentiates the fixed point
(``docs/math/ep.md#the-gradient-of-the-ep-evidence``)."""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.ops.gaussian import damp, is_proper, to_moment

__all__: list[str] = []

Natural = tuple[Tensor, Tensor]

_KINDS = ("fwd", "meas", "bwd")


class _Sites:
    """EP's three Gaussian site messages per time step, in natural form: ``fwd`` (the transition
    from ``t - 1``), ``meas`` (the observation) and ``bwd`` (the transition to ``t + 1``)."""

    def __init__(self, prior: Natural, T: int, d: int):
        zero = (prior[0].new_zeros(d), prior[0].new_zeros(d, d))
        self.messages = {"fwd": [prior] + [zero] * (T - 1), "meas": [zero] * T, "bwd": [zero] * T}

    def marginal(self, t: int, skip: str | None = None, alpha: float = 1.0) -> Natural:
        """``q(x_t)``, with the message named ``skip`` raised to ``1 - alpha`` (the cavity)."""
        # Two or three additions per call: this runs several times per message update, and with
        # small matrices the number of tensor operations is the cost.
        kept = [self.messages[k][t] for k in _KINDS if k != skip]
        eta, lam = kept[0][0] + kept[1][0], kept[0][1] + kept[1][1]
        if skip is None:
            eta, lam = eta + kept[2][0], lam + kept[2][1]
        elif alpha != 1.0:
            left = self.messages[skip][t]
            eta, lam = eta + (1 - alpha) * left[0], lam + (1 - alpha) * left[1]
        return eta, lam

    def accept(self, kind: str, t: int, new: Natural, gamma: float) -> bool:
        """Damps message ``kind`` at ``t`` towards ``new``, halving the step up to four times until
        the marginal is proper; keeps the old message and returns ``False`` if it never is."""
        messages = self.messages[kind]
        old = messages[t]
        for _ in range(4):
            messages[t] = damp(old, new, gamma)
            if bool(is_proper(self.marginal(t)[1])):
                return True
            gamma /= 2
        messages[t] = old
        return False

    def pack(self) -> Tensor:
        """All messages as one vector: ``eta`` ``(3, T, d)`` then ``Lambda`` ``(3, T, d, d)``, flattened."""
        eta = torch.stack([torch.stack([m[0] for m in self.messages[k]]) for k in _KINDS])
        lam = torch.stack([torch.stack([m[1] for m in self.messages[k]]) for k in _KINDS])
        return torch.cat([eta.reshape(-1), lam.reshape(-1)])

    @classmethod
    def unpack(cls, prior: Natural, theta: Tensor, T: int, d: int, status: list) -> _Sites:
        """The sites of a :meth:`pack` vector. The messages no sweep updates are constants, not
        entries of ``theta``: the first forward message (the prior, the model's), the last
        backward one and the measurement messages of steps without data (all zero). As entries
        of ``theta`` they would be fixed points of every map, so the adjoint iteration could not
        converge on them."""
        sites = cls(prior, T, d)
        eta, lam = theta[: 3 * T * d].reshape(3, T, d), theta[3 * T * d :].reshape(3, T, d, d)
        updated = {"fwd": range(1, T), "meas": [t for t in range(T) if status[t]], "bwd": range(T - 1)}
        for i, kind in enumerate(_KINDS):
            for t in updated[kind]:
                sites.messages[kind][t] = (eta[i, t], lam[i, t])
        return sites

    def moments(self) -> tuple[Tensor, Tensor]:
        """The marginals' means ``(T, d)`` and covariances ``(T, d, d)``."""
        moments = [to_moment(*self.marginal(t)) for t in range(len(self.messages["fwd"]))]
        return torch.stack([m for m, _ in moments]), torch.stack([P for _, P in moments])
