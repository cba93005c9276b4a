"""One warning per :meth:`~pyro_smc.SMC.run` for resampling solves that did not converge.

An OT resampler that stops at ``max_iter`` above its threshold warns
(:class:`~pyro_smc.ops.sinkhorn.SinkhornConvergenceWarning`); on a hard sequence it does so at
most steps, and one warning per step buried the message (22 warnings on a 30-step run).
Within ``run`` the first such warning is shown as it happens, with its time step (a warnings
filter set to ``"error"`` stops the run there, as before); the later ones are counted, and the
run ends with one summary: how many steps, which, the worst marginal error and the remedy.
Outside ``run`` (``init``/``step`` by hand) every step's warning is shown.

Example:
    >>> import warnings
    >>> report = ConvergenceReport()
    >>> report.add(
    ...     "time step 0",
    ...     "sinkhorn: 1 of 1 problems stopped ... error of up to 0.02 (threshold 0.001)",
    ... )
    True
    >>> report.add(
    ...     "time step 4",
    ...     "sinkhorn: 1 of 1 problems stopped ... error of up to 0.3 (threshold 0.001)",
    ... )
    False
    >>> print(report.summary(30))
    SMC.run: the Sinkhorn solve stopped above its threshold at 2 of 30 steps (time steps 0, 4; the first was reported as it happened), with a marginal error of up to 0.3 at time step 4: the transport and its gradient are inaccurate there; raise the resampler's max_iter or epsilon (OTResampler(epsilon=..., max_iter=...)), or anneal epsilon (scaling > 0; 0.75 is the default)
"""

from __future__ import annotations

import re

__all__ = ["ConvergenceReport"]

_ERROR = re.compile(r"up to ([0-9.]+(?:e[-+]?\d+)?)")


class ConvergenceReport:
    """The unconverged resampling solves of one run (see the module docstring).

    Attributes:
        steps: where each unconverged solve happened (``"init"``, ``"time step t"``), in order.
        worst: ``(error, where)`` of the largest marginal error read from the messages, or ``None``.
    """

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.worst: tuple[float, str] | None = None

    def add(self, where: str, message: str) -> bool:
        """Records a warning's ``message`` at ``where``; returns whether to show it now (the first)."""
        self.steps.append(where)
        found = _ERROR.search(message)
        if found is not None:
            error = float(found.group(1))
            if self.worst is None or error > self.worst[0]:
                self.worst = (error, where)
        return len(self.steps) == 1

    def summary(self, num_steps: int) -> str | None:
        """The run's one summary of ``num_steps`` steps, or ``None`` when there is nothing more to say
        (no solve, or only the one already shown)."""
        if len(self.steps) < 2:
            return None
        named = [where.removeprefix("time step ") for where in dict.fromkeys(self.steps)]
        shown = ", ".join(named[:8]) + (", ..." if len(named) > 8 else "")
        worst = "" if self.worst is None else f", with a marginal error of up to {self.worst[0]:.3g} at {self.worst[1]}"
        return (
            f"SMC.run: the Sinkhorn solve stopped above its threshold at {len(named)} of {num_steps} steps (time steps "
            f"{shown}; the first was reported as it happened){worst}: the transport and its gradient are inaccurate "
            "there; raise the resampler's max_iter or epsilon (OTResampler(epsilon=..., max_iter=...)), or anneal "
            "epsilon (scaling > 0; 0.75 is the default)"
        )
