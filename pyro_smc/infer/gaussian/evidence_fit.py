r"""Type-II maximum likelihood for Gaussian smoothers: fit a model's parameters by maximising
the EP (or Gaussian-filter) evidence with a torch optimiser.

See ``docs/engines/ep.md#learning-parameters`` and ``docs/math/ep.md#the-gradient-of-the-ep-evidence``.

The recipe is four lines, and :func:`fit_evidence` is those lines plus the care a long fit needs:

.. code-block:: python

    optim = torch.optim.Adam(ssm.parameters(), lr=0.05)
    for step in range(200):
        optim.zero_grad()
        loss = -EPSmoother(ssm).smooth(ys).log_evidence
        loss.backward(); optim.step()

The model is a :class:`~pyro_smc.models.NonlinearGaussianSSM` (a ``PyroModule``) whose learnable
parts are ``PyroParam``s or ``nn.Parameter``s: a transition or observation map that is itself a
``PyroModule``, a covariance replaced by a constrained ``PyroParam``
(``ssm.transition_cov = PyroParam(Q0, constraint=constraints.positive_definite)``), or the
hyperparameters and data of a :class:`~pyro_smc.gp.MultiOutputGP`. The gradient comes from
implicit differentiation at the EP fixed point, so its memory does not depend on the number of
sweeps; an EP run that did not converge is never differentiated implicitly (see
``on_nonconvergence``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.ep import EPConvergenceWarning
from pyro_smc.progress import logger, progress, progress_enabled

__all__ = ["fit_evidence"]


def fit_evidence(
    smoother,
    observations: Tensor | Sequence[Tensor],
    num_steps: int = 200,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 0.05,
    params: Iterable[Tensor] | None = None,
    on_nonconvergence: str = "raise",
    callback: Callable[[int, float], None] | None = None,
    warm_start: bool = True,
    progress_bar: bool | None = None,
) -> list[float]:
    """Maximises the smoother's ``log_evidence`` over the model's parameters.

    Args:
        smoother: an object with ``.smooth(observations)`` returning a result with
            ``log_evidence`` and ``converged`` (an :class:`~pyro_smc.EPSmoother`; for the plain
            Gaussian smoothers, ``EPSmoother(ssm, max_iter=1)``), and an ``ssm`` attribute whose
            ``parameters()`` are fitted unless ``params`` is given.
        observations: one sequence ``(T, e)`` or a list of sequences (of any lengths; their
            evidences add up).
        num_steps: optimiser steps.
        optimizer: a torch optimiser over the parameters (default ``Adam(params, lr)``).
        lr: Adam's learning rate when no ``optimizer`` is given.
        params: the tensors to fit (default ``smoother.ssm.parameters()``).
        on_nonconvergence: what a step does when EP stopped at ``max_iter`` without reaching
            ``tol`` on some sequence, so that its result is not a fixed point and has no implicit
            gradient: ``"raise"`` (a ``RuntimeError`` naming the step and the sequence) or
            ``"unroll"`` (that sequence is rerun with ``gradient="unroll"``: the step follows
            the gradient of the evidence of the sweeps as run, and a warning at the end counts
            such steps). Skipping the step would not help: EP is deterministic, so the same
            parameters would fail again at every later step.
        callback: called as ``callback(step, loss)`` after every step.
        warm_start: start each step's EP run on a sequence from where the previous step's
            stopped (``smooth(y, init=previous)``): the parameters moved a little, so EP needs
            few iterations and no first sweep. Off: every step starts from the first sweep.
        progress_bar: a tqdm bar over the steps (its postfix the loss): ``None`` (default) in
            interactive use only, ``True`` always, ``False`` never (:mod:`pyro_smc.progress`);
            the smoother's own bar is off meanwhile. Each step's loss is also logged at
            ``DEBUG`` to the ``pyro_smc`` logger.

    Returns:
        The loss ``-sum log_evidence / total number of time steps`` at every step, as floats.

    Raises:
        ValueError: ``num_steps < 0``, an unknown ``on_nonconvergence``, or no parameters; a
            smoother error (a non-finite evidence or marginal, a failed factorisation: naming the
            optimiser step, the sequence and the time step); or a non-finite gradient (naming the
            step and the parameters; that step is not taken).
        RuntimeError: a non-converged EP run with ``on_nonconvergence="raise"``.

    A ``PyroModule`` keeps its parameters in Pyro's global parameter store, by name, once it has
    been called (building a ``NonlinearGaussianSSM`` calls its maps): a second instance of the
    same class then silently takes over the first one's parameter tensors, so its fit starts from
    (and updates) their values, not its own initial ones. Build the model to fit after
    ``pyro.clear_param_store()``, or set ``pyro.settings.set(module_local_params=True)`` before
    creating any module.

    Example:
        Learning the drift coefficient ``b`` of ``x_{t+1} = 0.8 x_t + b sin(x_t) + w_t``:

        >>> import torch
        >>> from pyro.nn import PyroModule, PyroParam
        >>> from pyro_smc import EPSmoother
        >>> from pyro_smc.infer import fit_evidence
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> class Drift(PyroModule):
        ...     def __init__(self, b):
        ...         super().__init__()
        ...         self.b = PyroParam(torch.tensor(b))
        ...     def forward(self, x):
        ...         return 0.8 * x + self.b * torch.sin(x)
        >>> one = torch.eye(1)
        >>> truth = NonlinearGaussianSSM(
        ...     lambda x: 0.8 * x + torch.sin(x),
        ...     0.5 * one,
        ...     lambda x: x,
        ...     0.3 * one,
        ...     torch.zeros(1),
        ...     one,
        ... )
        >>> _, ys = truth.simulate(30, generator=torch.Generator().manual_seed(0))
        >>> ssm = NonlinearGaussianSSM(
        ...     Drift(0.0), 0.5 * one, lambda x: x, 0.3 * one, torch.zeros(1), one
        ... )
        >>> losses = fit_evidence(
        ...     EPSmoother(ssm, projection="unscented", tol=1e-4), ys, num_steps=10, lr=0.1
        ... )
        >>> len(losses), losses[-1] < losses[0], 0.5 < ssm.transition.b.item() < 1.5
        (10, True, True)
    """
    if int(num_steps) < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps!r}")
    if on_nonconvergence not in ("raise", "unroll"):
        raise ValueError(f"on_nonconvergence must be 'raise' or 'unroll', got {on_nonconvergence!r}")
    sequences = _as_sequences(observations)
    length = sum(len(y) for y in sequences)
    if optimizer is None:
        optimizer = torch.optim.Adam(_parameters_to_fit(smoother, params), lr=lr)
    fitted = [p for group in optimizer.param_groups for p in group["params"]]
    names = _parameter_names(smoother, fitted)
    needs_fixed_point = _needs_fixed_point(smoother)
    losses: list[float] = []
    unrolled = 0
    previous: list = [None] * len(sequences)
    # This loop has its own policy for runs that stopped at max_iter (on_nonconvergence, and one
    # warning at the end), so the smoother's per-run EPConvergenceWarning would only repeat it.
    bar = progress(desc="fit_evidence", total=int(num_steps), enabled=progress_enabled(progress_bar))
    with torch.enable_grad(), warnings.catch_warnings(), bar, _inner_bar_off(smoother):
        warnings.simplefilter("ignore", EPConvergenceWarning)
        for step in range(int(num_steps)):
            optimizer.zero_grad()
            results, fell_back = _smooth_sequences(smoother, sequences, previous, step, needs_fixed_point, on_nonconvergence)
            unrolled += fell_back
            if warm_start:
                previous = _warm_starts(results)
            loss = -sum(r.log_evidence for r in results) / length
            loss.backward()
            _check_gradients(fitted, names, step)
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.5g}", refresh=False)
            logger.debug("fit_evidence: step %d, loss %.6g", step, losses[-1])
            if callback is not None:
                callback(step, losses[-1])
    if unrolled:
        warnings.warn(
            f"fit_evidence: in {unrolled} of {num_steps} steps EP did not converge and the step followed the unrolled gradient of its sweeps",
            RuntimeWarning, stacklevel=2,
        )
    return losses


@contextlib.contextmanager
def _inner_bar_off(smoother):
    """The smoother's own progress bar off for the fit (one bar per EP run would be noise)."""
    if not hasattr(smoother, "progress_bar"):
        yield
        return
    old, smoother.progress_bar = smoother.progress_bar, False
    try:
        yield
    finally:
        smoother.progress_bar = old


def _as_sequences(observations) -> list:
    """One sequence ``(T, e)`` or a list of them, as a non-empty list."""
    sequences = [observations] if isinstance(observations, Tensor) else list(observations)
    if not sequences:
        raise ValueError("fit_evidence: observations is an empty list; give one sequence (T, e) or a list of them")
    return sequences


def _parameters_to_fit(smoother, params) -> list:
    """``params``, or by default the model's parameters; an error if there are none that says how
    to make the model learnable (Adam's own error on an empty list would not)."""
    params = list(smoother.ssm.parameters() if params is None else params)
    if not params:
        raise ValueError("fit_evidence: the model has no parameters; make the learnable parts PyroParams or nn.Parameters")
    return params


def _needs_fixed_point(smoother) -> bool:
    """Whether the smoother's gradient is only valid at a converged EP run."""
    # Only a fixed point is differentiated implicitly; one sweep (max_iter=1) or unrolled sweeps
    # have an exact gradient whether or not EP has converged.
    return getattr(smoother, "gradient", "implicit") == "implicit" and getattr(smoother, "max_iter", 2) > 1


def _smooth_sequences(smoother, sequences: list, previous: list, step: int, needs_fixed_point: bool, on_nonconvergence: str) -> tuple[list, bool]:
    """One smoother run per sequence (from ``previous``, its warm start or ``None``), with the
    ``on_nonconvergence`` policy applied to the runs that stopped at ``max_iter``.

    Returns the results and whether some sequence was rerun with the unrolled gradient.
    """
    results = [_smooth(smoother, y, p, step, i) for i, (y, p) in enumerate(zip(sequences, previous))]
    stuck = [i for i, r in enumerate(results) if needs_fixed_point and not r.converged]
    if stuck and on_nonconvergence == "raise":
        raise RuntimeError(
            f"fit_evidence: at step {step}, EP did not converge on sequence {stuck[0]} (last change "
            f"{results[stuck[0]].history[-1].change:.3g} > tol); raise max_iter, damp the smoother (damping < 1, "
            'power < 1), or pass on_nonconvergence="unroll"'
        )
    if stuck:
        # A run that did not converge has no implicit gradient: rerun it from scratch with unrolled sweeps.
        fallback = copy.copy(smoother)
        fallback.gradient = "unroll"
        for i in stuck:
            results[i] = _smooth(fallback, sequences[i], None, step, i)
    return results, bool(stuck)


def _warm_starts(results: list) -> list:
    """Where the next step's run on each sequence starts: a converged result that carries its EP
    state, else ``None`` (the first sweep)."""
    return [r if r.converged and getattr(r, "ep_state", None) is not None else None for r in results]


def _smooth(smoother, observations, init, step: int, index: int):
    """``smoother.smooth``, its errors (a non-finite evidence, a failed factorisation) naming the
    optimiser step and the sequence as well."""
    try:
        return smoother.smooth(observations) if init is None else smoother.smooth(observations, init=init)
    except ValueError as error:
        raise ValueError(f"fit_evidence: at optimiser step {step}, sequence {index}: {error}") from error


def _parameter_names(smoother, params: list) -> list[str]:
    named = {id(p): name for name, p in getattr(smoother.ssm, "named_parameters", lambda: [])()}
    return [named.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


def _check_gradients(params: list, names: list[str], step: int) -> None:
    """Refuses to step on a non-finite gradient (one host sync), which would make the parameter
    non-finite and every later step meaningless."""
    grads = [(name, p.grad) for name, p in zip(names, params) if p.grad is not None]
    if not grads or bool(torch.stack([torch.isfinite(g).all() for _, g in grads]).all()):
        return
    bad = [name for name, g in grads if not bool(torch.isfinite(g).all())]
    raise ValueError(
        f"fit_evidence: at optimiser step {step} the gradient of the evidence is not finite in {', '.join(bad)} (the "
        "parameters sit where the model is not differentiable, e.g. at the edge of a constraint); the step was not taken"
    )

