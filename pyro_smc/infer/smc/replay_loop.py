"""The rest of an ``SMC.run`` replayed as one TorchScript loop
(``docs/engines/smc.md#the-compiled-step``).

Once a run's recording is verified, every later regular step is the same call of the recording
followed, where the ESS fell, by index resampling. Taken one at a time from Python, each step
pays the engine's bookkeeping around the call (its signature, the random-state snapshot, the
record, the evidence sum: about as much as the recorded computation itself on a small filter).
:func:`run_replayed` instead hands the remaining observations to a loop compiled by TorchScript
that calls the recording, sums the evidence, resamples and collects the step records, so that a
run of a small filter costs what its tensor operations cost.

The loop makes the same generator calls in the same order as the step-by-step replay (the
recording's draws, then the resampling's uniforms), so the particles, the log-evidence and its
gradient are those of the step-by-step run, which are those of the handler path. A step whose
normaliser or filtering means are not finite stops the loop; the run is then rewound to where
the loop started (particles, weights and random state) and continues step by step, which
replays the same steps and hands the failing one to the handler path to report.

When it runs: a run (not ``SMC.step``), an index resampler
(:func:`~pyro_smc.resamplers.index.index_scheme`), a verified recording whose signature the
next step matches, every remaining step regular (no missing data, no padding, no per-filter
activity), the state keys unchanged by the step, and no first stage (the auxiliary filter,
SQMC) before it.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, List, NamedTuple

import torch
from torch import Tensor

from pyro_smc.infer.model_state import rng_state, set_rng_state
from pyro_smc.infer.smc.replay import ignore_jit_deprecation
from pyro_smc.infer.smc.result import StepRecord
from pyro_smc.infer.smc.state import ParticleWeights
from pyro_smc.ops.resample import resample_where

__all__ = ["LoopPlan", "run_replayed"]

logger = logging.getLogger("pyro_smc")

_scripted_resample_where = None


def _resample_where():
    # Scripted on first use (a few hundred ms), not at import.
    global _scripted_resample_where
    if _scripted_resample_where is None:
        with warnings.catch_warnings():
            ignore_jit_deprecation()
            _scripted_resample_where = torch.jit.script(resample_where)
    return _scripted_resample_where


class LoopPlan(NamedTuple):
    """Where the loop's inputs sit among the recording's (from
    :meth:`~pyro_smc.infer.smc.compiled.CompiledStep.loop_inputs`).

    Attributes:
        function: the recording (a TorchScript function).
        executors: the recording's executor cache (the compiled loops are kept there).
        keys: the state keys, in the recording's input and output order.
        inputs: the recording's inputs at the next step (the particles, the observation, the
            other tensor arguments, the previous log-weights, the model's tensors and the
            parameters).
        observation: the observation's index in ``inputs``.
        weights: the previous log-weights' index in ``inputs``.
        num_terms: the recording's outputs between the particles and the log-weights (the
            log-weight terms and the score terms).
        checks: the status's leading check values.
        num_filters: ``B``.
        scheme: :func:`~pyro_smc.resamplers.index.index_scheme` of the run's resampler.
    """

    function: Any
    executors: dict
    keys: tuple[str, ...]
    inputs: tuple[Tensor, ...]
    observation: int
    weights: int
    num_terms: int
    checks: int
    num_filters: int
    scheme: tuple[int, bool, int]


def run_replayed(smc, plan: LoopPlan, observations: List[Tensor]) -> int:
    """Runs the steps of ``observations`` (regular, of the recorded shape) by the compiled loop
    and keeps what they made in ``smc`` as its step-by-step path would have.

    Returns:
        The number of steps taken: ``len(observations)``, or 0 when the loop did not run (it
        could not be compiled, or a step was not finite: the run is then as before the call).
    """
    loop = _loop(plan)
    if loop is None:
        return 0
    k = len(plan.keys)
    fixed = [value for i, value in enumerate(plan.inputs) if i >= k and i not in (plan.observation, plan.weights)]
    weights = smc._weights
    before = rng_state()
    optimize = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)  # the plain interpreter: no profiling runs
    # With nothing to differentiate, the loop runs in inference mode: its ops skip autograd's
    # dispatch and version counters (measured: ~10% of a step at N = 100); its results are
    # cloned out of it below, so that they are ordinary tensors that later steps may save.
    inference = not (torch.is_grad_enabled() and any(x.requires_grad for x in (*plan.inputs, weights.log_evidence)))
    try:
        with torch.inference_mode(inference):
            out = loop(torch.stack(observations), list(plan.inputs[:k]), fixed, plan.inputs[plan.weights], weights.log_evidence)
    except Exception as error:  # noqa: BLE001 - an internal runtime: the step-by-step path decides
        set_rng_state(before)
        plan.executors["loop"] = False
        logger.info("SMC replays step by step: the compiled loop failed (%s: %s)", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return 0
    finally:
        torch._C._set_graph_executor_optimize(optimize)
    if inference:
        out = _cloned(out)
    done, state, log_weights, log_evidence, weighted, weighted_log_weights, increments, ess, need, means = out
    if done < len(observations):
        # A step that was not finite: rewound, the step-by-step path replays up to it and
        # gives it to the handler path, which reports it.
        set_rng_state(before)
        return 0
    smc.state.replace(dict(zip(plan.keys, state)))
    smc._weights = ParticleWeights(log_weights, log_evidence, None)
    smc._weighted = (dict(zip(plan.keys, weighted)), weighted_log_weights)
    smc.ess = ess[-1]
    columns = [increments.unbind(0), ess.unbind(0), need.unbind(0)] + [mean.unbind(0) for mean in means]
    for increment, step_ess, step_need, *step_means in zip(*columns):
        smc._records.append(StepRecord(increment, dict(zip(plan.keys, step_means)), step_ess, step_need))
    smc._compiled.compiled_steps += done
    return done


def _cloned(value):
    """``value`` (the loop's nested tuple and lists of tensors) with every tensor cloned."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(x) for x in value)
    return value


def _loop(plan: LoopPlan):
    """The compiled loop for ``plan``'s layout, kept with the recording (``None``: not possible)."""
    loops = plan.executors.setdefault("loop", {})
    if loops is False:
        return None
    key = (len(plan.keys), len(plan.inputs), plan.observation, plan.weights, plan.num_terms, plan.checks, plan.num_filters, plan.scheme)
    if key not in loops:
        try:
            loops[key] = _compile(plan)
        except Exception as error:  # noqa: BLE001 - TorchScript could not compile it: step by step
            logger.info("SMC replays step by step: the loop could not be compiled (%s: %s)", type(error).__name__, error)
            plan.executors["loop"] = False
            return None
    return loops[key]


def _compile(plan: LoopPlan):
    """TorchScript source for ``plan``'s layout, compiled with the recording as ``step``.

    The recording's arity differs between models, and TorchScript has no ``*args``: the call is
    written out for this layout."""
    k, n = len(plan.keys), len(plan.inputs)
    names, fixed = [], 0
    for i in range(n):
        if i < k:
            names.append(f"state[{i}]")
        elif i == plan.observation:
            names.append("ys[t]")
        elif i == plan.weights:
            names.append("lw")
        else:
            names.append(f"fixed[{fixed}]")
            fixed += 1
    lw_at = k + plan.num_terms  # outputs: particles, terms, log-weights, increment, ESS, need, means, status
    squeeze = plan.num_filters == 1
    batched = "[x.unsqueeze(0) for x in state]" if squeeze else "state"
    unbatch = "[x.squeeze(0) for x in new]" if squeeze else "new"
    code, stop_gradient, search_below = plan.scheme
    means = "\n".join(f"        means[{i}].append(out[{lw_at + 4 + i}])" for i in range(k))
    source = f"""
def loop(ys: Tensor, state: List[Tensor], fixed: List[Tensor], lw: Tensor, le: Tensor):
    increments: List[Tensor] = []
    esss: List[Tensor] = []
    needs: List[Tensor] = []
    means: List[List[Tensor]] = [[] for _ in range({k})]
    weighted: List[Tensor] = state
    weighted_lw = lw
    done = 0
    for t in range(ys.shape[0]):
        out = step({", ".join(names)})
        status = out[{lw_at + 4 + k}]
        if not bool(torch.isfinite(status[:{plan.checks}].sum())):
            break
        state = [{", ".join(f"out[{i}]" for i in range(k))}]
        lw = out[{lw_at}]
        increment = out[{lw_at + 1}]
        need = out[{lw_at + 3}]
        le = le + increment
        increments.append(increment)
        esss.append(out[{lw_at + 2}])
        needs.append(need)
{means}
        weighted = state
        weighted_lw = lw
        if bool(need.any()):
            new, lw = resample_where(need, bool(need.all()), lw, {batched}, {code}, {stop_gradient}, {search_below})
            state = {unbatch}
        done = t + 1
    if done == 0:
        empty = lw.new_zeros([0])
        return done, state, lw, le, weighted, weighted_lw, empty, empty, empty.to(torch.bool), [empty for _ in range({k})]
    stacked = [torch.stack(m) for m in means]
    return done, state, lw, le, weighted, weighted_lw, torch.stack(increments), torch.stack(esss), torch.stack(needs), stacked
"""
    env = {"step": plan.function, "resample_where": _resample_where(), "List": List, "Tensor": Tensor, "torch": torch, "math": math}
    unit = torch.jit.CompilationUnit()
    unit.define(source, rcb=env.get)
    return unit.loop
