"""The Sinkhorn solver's typed interface: its settings, its result and its warning.

Shared by every Sinkhorn module (:mod:`~pyro_smc.ops.sinkhorn_solver`,
:mod:`~pyro_smc.ops.sinkhorn_implicit`, :mod:`~pyro_smc.ops.sinkhorn_unrolled`,
:mod:`~pyro_smc.ops.sinkhorn`) and by :mod:`pyro_smc.ops.ensemble`; re-exported and documented
by :mod:`pyro_smc.ops.sinkhorn`. A solve takes one :class:`SinkhornSettings` and returns one
:class:`SinkhornResult`, whose diagnostics travel up to
:class:`~pyro_smc.resamplers.OTResampler` and from there to ``Resampled.diagnostics``.

Example:
    >>> import math, torch
    >>> from pyro_smc.ops.sinkhorn import SinkhornSettings, solve
    >>> cost = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    >>> log_a, log_b = torch.full((2,), -math.log(2)), torch.tensor([0.6, 0.4]).log()
    >>> result = solve(cost, log_a, log_b, SinkhornSettings(epsilon=0.5, threshold=1e-4))
    >>> bool(result.converged), int(result.num_iterations) >= 1
    (True, True)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

# warn_unconverged and refuse_second_derivative are shared by the solver modules, not part of the API.
__all__ = ["GRADIENT_MODES", "SinkhornSettings", "SinkhornConvergenceWarning", "SinkhornResult"]

#: The ``gradient=`` modes of Sinkhorn: how a solve is differentiated (``"implicit"``,
#: ``"unroll"``, ``"last_step"``; see :mod:`pyro_smc.ops.sinkhorn`).
GRADIENT_MODES = ("implicit", "unroll", "last_step")


@dataclass(frozen=True)
class SinkhornSettings:
    """How a batched Sinkhorn solve runs and is differentiated: one object, checked once.

    :class:`~pyro_smc.resamplers.OTResampler` builds one from its arguments and hands it to
    :func:`pyro_smc.ops.ensemble.ensemble_solve`, which hands it to the solver.

    Attributes:
        epsilon: regularisation strength, finite and ``> 0``, in the units of the cost.
        scaling: epsilon annealing factor in ``[0, 1)``; annealing starts at a quarter of the
            mean cost, so it only runs when ``epsilon`` is below that; 0 switches it off.
        threshold: ``> 0``; each problem stops when the L1 error of both marginals is below it.
        max_iter: maximum number of iterations at the final ``epsilon``, an int ``>= 1``.
        gradient: how the solve is differentiated, one of ``GRADIENT_MODES``:
            ``"implicit"`` (exact, the default), ``"unroll"`` (autograd through every
            iteration) or ``"last_step"`` (one differentiable update from the detached fixed
            point; approximate). See ``docs/math/smc.md#gradient-modes``.

    Raises:
        ValueError: a setting out of range, naming it.

    Example:
        >>> from pyro_smc.ops.sinkhorn import SinkhornSettings
        >>> settings = SinkhornSettings(0.1, max_iter=500, gradient="unroll")
        >>> settings.epsilon, settings.scaling, settings.threshold, settings.max_iter
        (0.1, 0.75, 0.001, 500)
        >>> SinkhornSettings(epsilon=0.0)
        Traceback (most recent call last):
            ...
        ValueError: sinkhorn: epsilon must be finite and > 0, got 0.0
    """

    epsilon: float = 0.5
    scaling: float = 0.75
    threshold: float = 1e-3
    max_iter: int = 100
    gradient: str = "implicit"

    def __post_init__(self) -> None:
        epsilon, scaling, threshold = (_real(name, getattr(self, name)) for name in ("epsilon", "scaling", "threshold"))
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"sinkhorn: epsilon must be finite and > 0, got {self.epsilon!r}")
        if not 0 <= scaling < 1:
            raise ValueError(f"sinkhorn: scaling must lie in [0, 1), got {self.scaling!r}")
        if not threshold > 0:
            raise ValueError(f"sinkhorn: threshold must be > 0, got {self.threshold!r}")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 1:
            raise ValueError(f"sinkhorn: max_iter must be an int >= 1, got {self.max_iter!r}")
        if self.gradient not in GRADIENT_MODES:
            raise ValueError(f"sinkhorn: gradient must be one of {GRADIENT_MODES}, got {self.gradient!r}")
        object.__setattr__(self, "epsilon", epsilon)
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "threshold", threshold)


def _real(name: str, value: object) -> float:
    """``value`` as a float (a Python or 0-d tensor number), or a ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"sinkhorn: {name} must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"sinkhorn: {name} must be a number, got {value!r}") from None


class SinkhornConvergenceWarning(UserWarning):
    """Warned when Sinkhorn stops at ``max_iter`` with a marginal error above ``threshold``.

    The plan, and the gradients implied by it, are then inaccurate: raise ``max_iter`` or
    ``epsilon``. Also warned when the implicit-gradient (adjoint) solve leaves a large residual.

    Example:
        >>> import math, warnings
        >>> import torch
        >>> from pyro_smc.ops.sinkhorn import sinkhorn
        >>> cost = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> log_a, log_b = torch.full((2,), -math.log(2)), torch.tensor([0.9, 0.1]).log()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = sinkhorn(
        ...         cost, log_a, log_b, epsilon=0.01, scaling=0.0, threshold=1e-9, max_iter=1
        ...     )
        >>> [w.category.__name__ for w in caught]
        ['SinkhornConvergenceWarning']
    """


class SinkhornResult(NamedTuple):
    """One batched Sinkhorn solve: the potentials and per-problem convergence diagnostics.

    Attributes:
        f: source potentials ``(..., N)``, with the gradient path of the chosen gradient mode.
        g: target potentials ``(..., M)``, likewise.
        converged: ``(...)`` bool, detached: whether the problem met the stopping rule (L1
            marginal error below ``threshold``) before ``max_iter``.
        num_iterations: ``(...)`` int64, detached: iterations run on the problem at the final
            epsilon. A problem that converges early may keep iterating with the rest of the
            batch (which only makes it more accurate), so this can exceed what it needed.
        marginal_error: ``(...)``, detached, dtype of the cost: the L1 marginal error the
            stopping rule measured at the problem's last check (``inf``/``nan`` where the
            scalings overflowed on the last iteration).

    Example:
        >>> import math, torch
        >>> from pyro_smc.ops.sinkhorn import sinkhorn_solve
        >>> cost = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).expand(3, 2, 2)
        >>> log_a, log_b = (
        ...     torch.full((3, 2), -math.log(2)),
        ...     torch.tensor([0.6, 0.4]).log().expand(3, 2),
        ... )
        >>> result = sinkhorn_solve(cost, log_a, log_b, epsilon=0.5, threshold=1e-4)
        >>> (
        ...     result.f.shape,
        ...     result.converged.tolist(),
        ...     bool((result.marginal_error < 1e-4).all()),
        ... )
        (torch.Size([3, 2]), [True, True, True], True)
    """

    f: Tensor
    g: Tensor
    converged: Tensor
    num_iterations: Tensor
    marginal_error: Tensor


def warn_unconverged(err: Tensor, threshold: float, max_iter: int, stacklevel: int = 3) -> None:
    """Tells the user that some problems ended at ``max_iter`` above ``threshold``.

    ``stacklevel`` counts from this function: the default names the caller of its caller.

    Args:
        err: the last measured L1 marginal error of each problem, any shape.
        threshold: the stopping threshold it was held to.
        max_iter: the iterations the solve was allowed (named in the message).
        stacklevel: as for :func:`warnings.warn`.

    Example:
        >>> import torch, warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_unconverged(torch.tensor([1e-5, 0.1]), 1e-3, 50)
        >>> str(caught[0].message).split(";")[0]
        'sinkhorn: 1 of 2 problems stopped at max_iter=50 with a marginal error of up to 0.1 (threshold 0.001)'
    """
    err = err.detach()
    bad = ~(err < threshold)
    if bool(bad.any()):
        warnings.warn(
            f"sinkhorn: {int(bad.sum())} of {err.numel()} problems stopped at max_iter={max_iter} with a marginal error of "
            f"up to {float(err[bad].max()):.3g} (threshold {threshold:g}); the transport and its gradient are inaccurate: "
            "raise max_iter or epsilon",
            SinkhornConvergenceWarning,
            stacklevel=stacklevel,
        )


def refuse_second_derivative(what: str) -> None:
    """Raises when a backward pass builds a graph (``create_graph=True``) through ``what``, an
    operation whose backward solves the adjoint without a graph of its own (the saved plan and
    kernel are constants to autograd, and the solve updates in place): its second derivative
    would be wrong or fail on an in-place write deep inside."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} is differentiable once: a backward pass with create_graph=True through it (a second derivative, "
            "a Hessian-vector product) is not supported; use gradient='unroll', which differentiates the iterations "
            "themselves, for second derivatives"
        )
