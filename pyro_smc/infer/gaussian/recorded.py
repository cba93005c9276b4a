r"""The Gaussian filter's forward pass on its fast path: lean steps, recorded once and replayed.

See ``docs/math/ep.md#gaussian-filter`` for the equations and ``docs/engines/ep.md#speed`` for
when this path is taken.

The filter's time steps depend on each other, so its cost is T times one step; on a small state
a step is ~60 tensor ops on 2x2 tensors, each 1-3 us of dispatch, not arithmetic (a
hand-written eager UKF + RTS pays ~170 us per step on the pendulum). For the built-in
projections (:class:`~pyro_smc.infer.gaussian.projections.Unscented`,
:class:`~pyro_smc.infer.gaussian.projections.Linearization`, and ``MomentMatching`` of a
callable, which is its fallback) with callable maps, this module

1. writes the step with the fewest ops the equations allow: the factorisations by
   ``cholesky_ex``, whose failures are checked once per run instead of once per op;
2. when both maps ignore the time index (``transition(x)``, ``observation(x)``, not marked
   ``time_dependent``), records the step once per run with :func:`torch.jit.trace` (the user's
   maps traced inside it), checks the record against the eager step at another input, and
   replays it from a TorchScript loop over time: no Python per step.

A replay runs the ops of the eager step in the same order, so it returns the same bits, and
autograd records it as it records the eager step (gradients in the noise covariances, the
initial moments and the observations are those of the eager path). It falls back to the eager
steps, with the same results, when a map takes the time index, when a step is partly observed,
when a map reads a tensor that requires grad (a parameter the trace would freeze), when tracing
meets a data-dependent Python branch (``TracerWarning``) or the record disagrees with the eager
step, for linearisation when a gradient is needed (its Jacobian is recorded as the backward
pass's ops, whose ``create_graph`` form the trace does not keep) or off the CPU, for fewer than
:data:`RECORD_MIN_STEPS` steps, and inside ``recording(False)``. Each run says which path it
took, and why, on the ``pyro_smc`` logger at ``DEBUG`` (``"forward pass recorded"`` or
``"forward pass eager: <why>"``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import List, NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.observed import ObservationStatus, observed_moments
from pyro_smc.infer.gaussian.projections import Linearization, MomentMatching, Projection, Unscented, _value_and_jacobian
from pyro_smc.models.nonlinear_gaussian import is_gp, is_time_invariant
from pyro_smc.ops.gaussian import symmetrize
from pyro_smc.ops.unscented import sigma_weights, unscented_transform

__all__ = ["RECORD_MIN_STEPS", "ForwardRun", "LeanFilter", "recording"]

logger = logging.getLogger("pyro_smc")

#: Fewer steps than this run eagerly: recording costs ~5 ms, replaying saves ~50 us per step.
RECORD_MIN_STEPS = 128
_ENABLED = True
_OBSERVED, _MISSING = int(ObservationStatus.OBSERVED), int(ObservationStatus.MISSING)


@contextlib.contextmanager
def recording(enabled: bool) -> Iterator[None]:
    """Turns the recorded forward pass on or off within the block (on by default).

    Example:
        >>> import torch
        >>> from pyro_smc.infer import unscented_kalman_filter
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, torch.cos, eye, 0 * eye[0], eye)
        >>> ys = torch.zeros(200, 1, dtype=torch.float64)
        >>> with recording(False):
        ...     eager = unscented_kalman_filter(ssm, ys)
        >>> torch.equal(eager.means, unscented_kalman_filter(ssm, ys).means)
        True
    """
    global _ENABLED
    before, _ENABLED = _ENABLED, bool(enabled)
    try:
        yield
    finally:
        _ENABLED = before


class ForwardRun(NamedTuple):
    """The raw forward pass: the filter's marginals and what its evidence and checks need.

    Attributes:
        means: ``(T, d)``; covariances: ``(T, d, d)``.
        predictions: ``(M (T-1, d), S (T-1, d, d), C (T-1, d, d))``, ``()`` when ``T = 1``.
        full: ``(steps, residuals (n, e), chols (n, e, e))`` of the fully observed steps.
        partial: ``[(t, residual, chol)]`` of the partly observed ones.
        info: ``(T,)`` the summed ``cholesky_ex`` infos of each step (0: every factorisation
            succeeded).
    """

    means: Tensor
    covariances: Tensor
    predictions: tuple
    full: tuple
    partial: list
    info: Tensor


def _lean_kind(projection: Projection, fn) -> tuple[str, dict] | None:
    # The lean form of ``projection`` applied to ``fn``, or None for a GP or a projection of the
    # user's (exact types: a subclass may override the moments).
    if is_gp(fn):
        return None
    if type(projection) is MomentMatching:
        projection = projection.fallback
    if type(projection) is Unscented:
        return "unscented", projection.settings
    if type(projection) is Linearization:
        return "linearization", {}
    return None


def _moments(kind: tuple, fn, m: Tensor, P: Tensor, t: int, noise: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    # (mu, S + noise, C, cholesky info or None): the bits of Projection.moments, fewer ops.
    name, weights = kind
    if name == "unscented":
        chol, info = torch.linalg.cholesky_ex(P)
        mu, S, C = unscented_transform(lambda x: fn(x, t), m, chol, weights, noise)
        return mu, S, C, info
    mu, J = _value_and_jacobian(fn, m, t) if isinstance(weights, str) else _value_and_jacobian_no_grad(fn, m, t, *weights)
    return mu, symmetrize(J @ P @ J.transpose(-1, -2) + noise), P @ J.transpose(-1, -2), None


def _value_and_jacobian_no_grad(fn, m: Tensor, t: int, shape: tuple[int, int], seed: Tensor) -> tuple[Tensor, Tensor]:
    # The recorded linearisation (nothing requires grad there): f(m) is the first of the e copies
    # of m that give J, not one more call of f, and the copies' shape (e, d) is fixed, not read
    # from tensors (which a trace records as ops). The copies are a view of m, and the backward
    # pass's seed is a constant made outside the trace: the ops that turn it into the identity
    # seed of the copies then have constant inputs only, and _simplify folds them into
    # constants (with the backward ops of the map's linear parts), leaving the forward ``sum``
    # and ``diagonal`` dead. Same values as the copies m + 0 and a seed ``ones_like``.
    with torch.enable_grad():
        copies_in = m.expand(shape).requires_grad_()
        copies = fn(copies_in, t)
        total = copies.diagonal().sum()
        (J,) = torch.autograd.grad(total, copies_in, grad_outputs=seed)
    return copies[0], J


def _update(m: Tensor, P: Tensor, y: Tensor, mu: Tensor, S_y: Tensor, C_y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # K = C_y S_y^{-1}: m + K (y - mu), P - K S_y K^T; also the residual and chol for the evidence.
    chol, info = torch.linalg.cholesky_ex(S_y)
    gain_t = torch.cholesky_solve(C_y.transpose(-1, -2), chol)  # K^T = S_y^{-1} C_y^T
    residual = y - mu
    return m + residual @ gain_t, symmetrize(P - C_y @ gain_t), residual, chol, info


def _total(*infos: Tensor | None) -> Tensor:
    # Infos are >= 0, so their sum is 0 exactly when every factorisation succeeded.
    infos = [i for i in infos if i is not None]
    total = infos[0]
    for info in infos[1:]:
        total = total + info
    return total


class LeanFilter:
    """The Gaussian filter's forward pass for a model and projection that have a lean form.

    Args:
        ssm: the model (callable maps).
        transition, observation: the projection's kinds for the two maps (:meth:`of`).

    Example:
        >>> import torch
        >>> from pyro_smc.models import NonlinearGaussianSSM
        >>> eye = torch.eye(1, dtype=torch.float64)
        >>> ssm = NonlinearGaussianSSM(torch.sin, eye, torch.cos, eye, 0 * eye[0], eye)
        >>> run = LeanFilter.of(ssm, Unscented()).run(torch.zeros(3, 1, dtype=torch.float64))
        >>> run.means.shape, run.predictions[0].shape                 # (T, d), (T-1, d)
        (torch.Size([3, 1]), torch.Size([2, 1]))
    """

    def __init__(self, ssm, transition: tuple[str, dict], observation: tuple[str, dict]):
        like = ssm.init_mean
        # The sigma-point constants are built here, outside any trace (a traced size is a tensor).
        self.kinds = tuple(
            (name, sigma_weights(like.shape[-1], **settings, dtype=like.dtype, device=like.device) if name == "unscented" else "autograd")
            for name, settings in (transition, observation)
        )
        self.ssm, self.f, self.g = ssm, ssm.transition_fn, ssm.observation_fn
        self._eager_kinds = self.kinds
        # Linearisation's kinds when the step is recorded (no gradient): the copies' shapes and
        # the backward pass's seed, built here so that the trace sees it as a constant.
        d, e = like.shape[-1], ssm.obs_dim
        seed = torch.ones((), dtype=like.dtype, device=like.device)
        self._recorded_kinds = tuple(
            (name, ((size, d), seed)) if name == "linearization" else (name, w) for (name, w), size in zip(self.kinds, (d, e))
        )

    @classmethod
    def of(cls, ssm, projection: Projection) -> LeanFilter | None:
        """The lean filter for ``ssm`` under ``projection``, or ``None`` (a GP map or a
        projection of the user's: the general loop)."""
        transition = _lean_kind(projection.for_factor("transition"), ssm.transition_fn)
        observation = _lean_kind(projection.for_factor("observation"), ssm.observation_fn)
        return None if transition is None or observation is None else cls(ssm, transition, observation)

    # One step, written once: run eagerly, or traced with t = 0 for maps that ignore it.
    def predict(self, m: Tensor, P: Tensor, Q: Tensor, t: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(M, S, C, info)`` of the transition out of ``t - 1``."""
        M, S, C, info = _moments(self.kinds[0], self.f, m, P, t - 1, Q)
        return M, S, C, torch.zeros((), dtype=torch.int32, device=m.device) if info is None else info

    def measure(self, m: Tensor, P: Tensor, y: Tensor, R: Tensor, t: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(m, P, residual, chol, info)`` after the fully observed measurement ``y`` at ``t``."""
        mu, S_y, C_y, info = _moments(self.kinds[1], self.g, m, P, t, R)
        m, P, residual, chol, gain_info = _update(m, P, y, mu, S_y, C_y)
        return m, P, residual, chol, _total(info, gain_info)

    def step(self, m: Tensor, P: Tensor, y: Tensor, Q: Tensor, R: Tensor, t: int = 1) -> tuple[Tensor, ...]:
        """Predict and measure: ``(m, P, M, S, C, residual, chol, info)``."""
        # A linearised prediction has no factorisation: the measurement's info alone (two ops
        # fewer per step than adding a zero).
        M, S, C, info = _moments(self.kinds[0], self.f, m, P, t - 1, Q)
        m, P, residual, chol, measured = self.measure(M, S, y, R, t)
        return m, P, M, S, C, residual, chol, _total(info, measured)

    def run(self, ys: Tensor, observed: Tensor | None = None, status: list | None = None) -> ForwardRun:
        """The forward pass over ``ys`` ``(T, e)`` (``observed``: its non-NaN mask; ``status``:
        each step's :class:`ObservationStatus`, all observed when ``None``)."""
        status = [_OBSERVED] * ys.shape[0] if status is None else [int(s) for s in status]
        out = _Outputs()
        m, P = self.ssm.init_mean, self.ssm.init_cov
        Q, R = self.ssm.transition_cov, self.ssm.observation_cov
        why = self._why_not_recorded(ys, status, (m, P, Q, R, ys))
        replay = None
        for t in range(ys.shape[0]):
            if replay is None and why is None and t == 2:
                replay, why = self._record(m, P, ys, Q, R, status)
                if replay is not None:
                    out.extend(replay(m, P, ys, Q, R, status, t), t, status)
                    break
            m, P = self._eager_step(out, t, m, P, ys, observed, status[t], Q, R)
        logger.debug("Gaussian filter: forward pass %s", "recorded" if replay is not None else f"eager: {why}")
        return out.finish(ys.shape[0])

    def _eager_step(self, out: _Outputs, t: int, m: Tensor, P: Tensor, ys: Tensor, observed, status: int, Q: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
        if t > 0:
            M, S, C, info = self.predict(m, P, Q, t)
            out.predictions.append((M, S, C))
            m, P = M, S
        else:
            info = torch.zeros((), dtype=torch.int32, device=m.device)
        if status != _MISSING:
            y, (mu, S_y, C_y, measured) = ys[t], _moments(self.kinds[1], self.g, m, P, t, R)
            if status != _OBSERVED:
                y, mu, S_y, C_y = observed_moments(y, observed[t], mu, S_y, C_y)
            m, P, residual, chol, gain_info = _update(m, P, y, mu, S_y, C_y)
            info = _total(info, measured, gain_info)
            (out.full if status == _OBSERVED else out.partial).append((t, residual, chol))
        out.means.append(m)
        out.covariances.append(P)
        out.info.append(info)
        return m, P

    def _why_not_recorded(self, ys: Tensor, status: list, inputs: tuple) -> str | None:
        if not _ENABLED:
            return "recording(False)"
        if ys.shape[0] < RECORD_MIN_STEPS:
            return f"T = {ys.shape[0]} < RECORD_MIN_STEPS = {RECORD_MIN_STEPS}"
        if not (is_time_invariant(self.f) and is_time_invariant(self.g)):
            return "a map takes the time index"
        if any(s not in (_OBSERVED, _MISSING) for s in status):
            return "a step is partly observed"
        if "linearization" in (self.kinds[0][0], self.kinds[1][0]):
            if ys.device.type != "cpu":
                return "linearisation off the CPU"
            if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
                return "linearisation with a gradient"
        return None

    def _record(self, m: Tensor, P: Tensor, ys: Tensor, Q: Tensor, R: Tensor, status: list):
        """``(replay, None)``, or ``(None, why)`` when the step cannot be recorded faithfully."""
        y = ys[status.index(_OBSERVED)] if _OBSERVED in status else torch.zeros_like(ys[0])
        self.kinds = self._recorded_kinds
        try:
            return self._trace(m, P, y, Q, R)
        finally:
            self.kinds = self._eager_kinds

    def _trace(self, m: Tensor, P: Tensor, y: Tensor, Q: Tensor, R: Tensor):
        try:
            with warnings.catch_warnings(record=True) as caught, torch.jit.optimized_execution(False):
                warnings.simplefilter("always")
                full = torch.jit.trace(self.step, (m, P, y, Q, R), check_trace=False)
                predict = torch.jit.trace(self.predict, (m, P, Q), check_trace=False)
                _simplify(full.graph)
                _simplify(predict.graph)
                loop = _script_loop(full, predict)
        except Exception as error:  # a tensor requiring grad frozen as a constant, an op TorchScript lacks, ...
            first = next((line for line in str(error).splitlines() if line.strip()), "")
            return None, f"the step could not be recorded ({type(error).__name__}: {first})"
        if any(issubclass(w.category, torch.jit.TracerWarning) for w in caught):
            return None, "tracing met a data-dependent branch (TracerWarning)"
        # The record must reproduce the eager step at an input it was not traced at.
        m2, P2 = P.diagonal().sqrt() + m, P + torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
        with torch.no_grad(), torch.jit.optimized_execution(False):
            same = all(map(torch.equal, full(m2, P2, y, Q, R), self.step(m2, P2, y, Q, R)))
            same = same and all(map(torch.equal, predict(m2, P2, Q), self.predict(m2, P2, Q)))
        if not same:
            return None, "the recorded step differs from the eager step"

        def replay(m: Tensor, P: Tensor, ys: Tensor, Q: Tensor, R: Tensor, status: list, start: int):
            # Without a gradient to record, the replay runs in inference mode: each op skips
            # autograd's dispatch (~20% of a step on a small state); its outputs are cloned out of
            # it, so that they are ordinary tensors (which autograd may save later).
            inference = not (torch.is_grad_enabled() and any(x.requires_grad for x in (m, P, ys, Q, R)))
            with torch.jit.optimized_execution(False), torch.inference_mode(inference):  # the plain interpreter: no profiling runs
                stacked = loop(m, P, ys, Q, R, status, start)
            return [x.clone() for x in stacked] if inference else stacked

        return replay, None


def _simplify(graph: torch.Graph) -> None:
    # Folds the ops whose inputs are all constants (the recorded linearisation's seed and the
    # backward ops of a map's linear parts: ~15 of its ~50 ops on the pendulum), merges repeated
    # ops (``J^T``) and drops dead ones. Each op left computes what it computed, on the same
    # inputs: the same bits; the record is checked against the eager step after this anyway.
    for name in ("_jit_pass_constant_propagation", "_jit_pass_cse", "_jit_pass_dce"):
        run = getattr(torch._C, name, None)  # TorchScript's own passes; skipped where a build lacks one
        if run is not None:
            run(graph)


def _script_loop(full, predict):
    # The loop over time as TorchScript, calling the two recorded steps: each step's outputs are
    # appended to lists (no tensor op), stacked once after the loop.
    def loop(m: Tensor, P: Tensor, ys: Tensor, Q: Tensor, R: Tensor, status: List[int], start: int) -> List[Tensor]:
        means: List[Tensor] = []
        covs: List[Tensor] = []
        Ms: List[Tensor] = []
        Ss: List[Tensor] = []
        Cs: List[Tensor] = []
        residuals: List[Tensor] = []
        chols: List[Tensor] = []
        infos: List[Tensor] = []
        for t in range(start, ys.shape[0]):
            if status[t] == 2:
                m, P, M, S, C, residual, chol, info = full(m, P, ys[t], Q, R)
                residuals.append(residual)
                chols.append(chol)
            else:
                M, S, C, info = predict(m, P, Q)
                m, P = M, S
            means.append(m)
            covs.append(P)
            Ms.append(M)
            Ss.append(S)
            Cs.append(C)
            infos.append(info)
        # Stacked here: handing 8 T tensors back to Python one by one cost ~10 us per step (and
        # the garbage collector's passes over them as much again).
        stacked = [torch.stack(means), torch.stack(covs), torch.stack(Ms), torch.stack(Ss), torch.stack(Cs), torch.stack(infos)]
        if len(residuals) > 0:
            stacked += [torch.stack(residuals), torch.stack(chols)]
        return stacked

    return torch.jit.script(loop)


class _Outputs:
    # The forward pass's outputs: per-step lists from the eager steps, then (maybe) one stacked
    # block from the replay; concatenated once at the end.
    def __init__(self):
        self.means, self.covariances, self.predictions, self.full, self.partial, self.info = [], [], [], [], [], []
        self.block, self.block_steps = None, []

    def extend(self, stacked: list, start: int, status: list) -> None:
        self.block = stacked
        self.block_steps = [t for t in range(start, len(status)) if status[t] == _OBSERVED]

    def finish(self, T: int) -> ForwardRun:
        block = self.block or []

        def column(values: list, index: int) -> Tensor:
            parts = ([torch.stack(values)] if values else []) + ([block[index]] if len(block) > index else [])
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        predictions = ()
        if self.predictions or block:
            predictions = tuple(column([p[i] for p in self.predictions], 2 + i) for i in range(3))
        full = ()
        if self.full or self.block_steps:
            steps = [t for t, _, _ in self.full] + self.block_steps
            full = (steps, column([r for _, r, _ in self.full], 6), column([c for _, _, c in self.full], 7))
        return ForwardRun(column(self.means, 0), column(self.covariances, 1), predictions, full, self.partial, column(self.info, 5))
