"""The messages of the EP smoother (``docs/math/ep.md#expectation-propagation``): three Gaussian
site messages per time step in natural form, their cavities and marginals, damped updates, and
the flat vector form in which :class:`~pyro_smc.EPSmoother` differentiates the fixed point
(``docs/math/ep.md#the-gradient-of-the-ep-evidence``); and what EP says when a message stops
being finite or a factorisation fails (both schedules)."""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.ops.gaussian import check_finite_steps, damp, is_proper, to_moment

__all__ = ["Natural", "Sites", "failure_hint", "improper_error", "in_sweep", "non_finite_error", "site_name"]

#: A Gaussian in natural form, ``(eta (d,), Lambda (d, d))``.
Natural = tuple[Tensor, Tensor]

_KINDS = ("fwd", "meas", "bwd")


def site_name(kind: str, t: int) -> str:
    """Message ``kind`` at step ``t`` in words, for error messages."""
    if kind == "fwd":
        return f"forward message into time step {t} (the transition from step {t - 1})"
    if kind == "bwd":
        return f"backward message into time step {t} (the transition to step {t + 1})"
    return f"measurement message at time step {t}"


class Sites:
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
    def unpack(cls, prior: Natural, theta: Tensor, T: int, d: int, status: list) -> Sites:
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

    def first_non_finite(self) -> tuple[str, int] | None:
        """``(kind, t)`` of the first message with a non-finite entry, in the order of a forward
        pass (``fwd`` then ``meas`` at each step) and then of the backward pass; ``None`` if none."""
        T = len(self.messages["fwd"])
        order = [(k, t) for t in range(T) for k in ("fwd", "meas")] + [("bwd", t) for t in range(T - 1, -1, -1)]
        for kind, t in order:
            eta, lam = self.messages[kind][t]
            if not bool(torch.isfinite(eta).all() and torch.isfinite(lam).all()):
                return kind, t
        return None

    def first_improper(self) -> int | None:
        """The first step whose marginal is not a proper Gaussian, or ``None``."""
        proper = is_proper(torch.stack([self.marginal(t)[1] for t in range(len(self.messages["fwd"]))])).tolist()
        return None if all(proper) else proper.index(False)

    def moments(self) -> tuple[Tensor, Tensor]:
        """The marginals' means ``(T, d)`` and covariances ``(T, d, d)``."""
        moments = [to_moment(*self.marginal(t)) for t in range(len(self.messages["fwd"]))]
        return torch.stack([m for m, _ in moments]), torch.stack([P for _, P in moments])


def failure_hint(sweep: int | None) -> str:
    """What to try when EP fails in ``sweep`` (0-based; ``None``: the gradient's extra sweep)."""
    if sweep == 0:
        return (
            "the first sweep is a Gaussian smoother of this projection (with power < 1, with scaled linearisation "
            "errors), so the model diverged or a map returned "
            "non-finite values there: check the transition and observation maps at those states (an unstable model, "
            "a wrong map or time index), the scales of the covariances, or run in float64"
        )
    return (
        "the first sweep (the Gaussian smoother) was sound, so the iteration went astray: damp it (damping < 1), "
        'use power < 1, try another projection ("unscented" is more robust than "linearization"), run in float64, '
        "or keep the first sweep (max_iter=1)"
    )


def in_sweep(sweep: int | None) -> str:
    return "in the sweep that differentiates the fixed point" if sweep is None else f"in sweep {sweep + 1}"


def improper_error(sites: Sites, sweep: int | None, skipped: int) -> ValueError:
    """The error for a marginal left improper by ``sweep`` (its updates skipped)."""
    t = sites.first_improper()
    return ValueError(
        f"EPSmoother: {in_sweep(sweep)} the marginal at time step {t} is not a proper Gaussian: its updates were skipped "
        f"({skipped} of this sweep, for an improper cavity or result); {failure_hint(sweep)}"
    )


def non_finite_error(sites: Sites, sweep: int | None) -> ValueError:
    """The error for non-finite marginals after ``sweep``: the first message that is not finite."""
    located = sites.first_non_finite()
    if located is None:  # finite messages with non-finite marginals: an overflow in the conversion
        means, covs = sites.moments()
        try:
            check_finite_steps(f"EPSmoother: {in_sweep(sweep)}", {"marginal mean": means, "marginal covariance": covs}, failure_hint(sweep))
        except ValueError as error:
            return error
        return ValueError(f"EPSmoother: {in_sweep(sweep)} the marginals are not finite; {failure_hint(sweep)}")
    kind, t = located
    return ValueError(f"EPSmoother: {in_sweep(sweep)} the {site_name(kind, t)} is not finite; {failure_hint(sweep)}")
