"""How :mod:`~pyro_smc.infer.smc.compiled` makes a recorded step cheap to replay
(``docs/engines/smc.md#the-compiled-step``): the traced graph simplified once, and each call
run by the fastest executor that gives the same values.

A traced Pyro step carries the work of building its distributions: ``torch.tensor`` of each
Python number, ``broadcast_tensors`` and ``expand`` of every parameter, ``zeros``/``ones`` for
the standard normal, a multiplication by a unit scale. :func:`simplified` removes what changes
no value (TorchScript's constant folding, common subexpressions and dead code, the views and
broadcasts that give back their input's own sizes, and the standard normal's scale and shift); :func:`execute` runs the result on
TorchScript's static runtime where no gradient is needed (once checked against the
interpreter), else on the plain interpreter. Both
keep the random draws where they were, so a replay consumes the generator as the handler path.

Example:
    >>> import torch
    >>> def step(x):
    ...     loc, scale = torch.broadcast_tensors(0.5 * x, torch.ones(()))
    ...     return loc + torch.randn(x.shape) * scale
    >>> traced = torch.jit.trace(step, (torch.zeros(3),), check_trace=False)
    >>> fast = simplified(traced)
    >>> _ = torch.manual_seed(0); a = traced(torch.ones(3))
    >>> _ = torch.manual_seed(0); b = fast(torch.ones(3))
    >>> torch.equal(a, b), "broadcast_tensors" in str(fast.graph)
    (True, False)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from pyro_smc.infer.model_state import rng_state, set_rng_state
from pyro_smc.ops.resample import resample_where

__all__ = ["execute", "ignore_jit_deprecation", "resample_every", "simplified"]

logger = logging.getLogger("pyro_smc")


# Views that change nothing when their input already has the output's sizes (and dtype):
# Pyro's distributions broadcast and expand every parameter, and a replay pays ~1.5 us per op.
_VIEWS = ("aten::expand", "aten::reshape", "aten::view", "aten::to")


def simplified(function: Callable) -> Callable:
    """The recording without the work a replay need not redo: constants folded (Pyro's
    ``torch.tensor`` of a Python number, ``zeros``/``ones`` of fixed shapes), common
    subexpressions merged, views to the input's own sizes dropped, dead nodes removed. The
    same values bit for bit; the random draws untouched (TorchScript never folds them)."""
    graph = function.graph.copy()
    for node in list(graph.nodes()):
        if node.kind() == "aten::size":
            _constant_size(graph, node)
    torch._C._jit_pass_constant_propagation(graph)
    torch._C._jit_pass_cse(graph)
    for node in list(graph.nodes()):
        if (node.kind() in _VIEWS and _same_tensor(node)) or (node.kind() == "aten::contiguous" and _contiguous(node.inputsAt(0))):
            node.output().replaceAllUsesWith(node.inputsAt(0))
    # After the views are gone, the broadcasts' uses are the arithmetic itself.
    for node in list(graph.nodes()):
        if node.kind() == "aten::broadcast_tensors":
            _unbroadcast(graph, node)
        elif node.kind() == "aten::mul":
            _drop_times_one(node)
        elif node.kind() == "aten::normal":
            _standard_normal(graph, node)
        if node.kind() in _ELEMENTWISE:
            _float_constant(graph, node)
    torch._C._jit_pass_dce(graph)
    return torch._C._create_function_from_graph("smc_step", graph)


def _constant_size(graph, node) -> None:
    """``x.size(d)`` of a value whose sizes the trace fixed, as a constant: a recording is
    replayed only on inputs of its recorded sizes (its signature), so the size is one number,
    and constant propagation then folds what was computed from it (``arange(n)``, ``n - 1``)."""
    inputs = list(node.inputs())
    sizes = _sizes(inputs[0])
    if len(inputs) != 2 or sizes is None or inputs[1].node().kind() != "prim::Constant":
        return
    dim = inputs[1].toIValue()
    if not isinstance(dim, int) or not -len(sizes[0]) <= dim < len(sizes[0]):
        return
    graph.setInsertPoint(node)
    node.output().replaceAllUsesWith(graph.insertConstant(int(sizes[0][dim])))


# Elementwise ops that broadcast their two tensor operands.
_ELEMENTWISE = ("aten::mul", "aten::add", "aten::sub", "aten::div")


def _sizes(value) -> tuple | None:
    """A value's complete sizes and dtype from the trace, or ``None``."""
    kind = value.type()
    if not isinstance(kind, torch._C.TensorType) or kind.sizes() is None or kind.dtype() is None:
        return None
    return tuple(kind.sizes()), kind.dtype()


def _unbroadcast(graph, node) -> None:
    """Feeds each use of a ``broadcast_tensors`` output its own input instead where that
    changes nothing: an input already of the broadcast sizes; an elementwise op that broadcasts
    it to the same result (same sizes, one dtype throughout: a 0-dim operand would otherwise
    promote differently); else, for a constant input, the constant broadcast. The list, unused
    after, is dead."""
    listed, uses = node.inputsAt(0).node(), node.output().uses()
    if listed.kind() != "prim::ListConstruct" or len(uses) != 1 or uses[0].user.kind() != "prim::ListUnpack":
        return
    for source, value in zip(listed.inputs(), uses[0].user.outputs()):
        have, want = _sizes(source), _sizes(value)
        if have is None or want is None:
            continue
        if have == want:
            value.replaceAllUsesWith(source)
            continue
        for use in list(value.uses()):
            user = use.user
            if user.kind() not in _ELEMENTWISE or use.offset > 1:
                continue
            other, out = _sizes(user.inputsAt(1 - use.offset)), _sizes(user.output())
            if other is not None and out is not None and have[1] == other[1] == out[1] and tuple(torch.broadcast_shapes(have[0], other[0])) == out[0]:
                user.replaceInput(use.offset, source)
        if value.uses() and source.node().kind() == "prim::Constant":
            # A stride-0 view of Pyro's scalar parameter, made once.
            graph.setInsertPoint(node)
            value.replaceAllUsesWith(graph.insertConstant(source.toIValue().expand(want[0])))


def _drop_times_one(node) -> None:
    """``x * 1`` is ``x`` bit for bit (``-0.0`` and NaN included) when the product keeps ``x``'s
    sizes and dtype: Pyro's ``Normal`` samples ``loc + eps * scale`` with ``scale = 1``."""
    for offset in (0, 1):
        constant, other = node.inputsAt(offset), node.inputsAt(1 - offset)
        value = _tensor_constant(constant)
        if value is not None and value.numel() == 1 and bool(value == 1) and _sizes(other) is not None and _sizes(other) == _sizes(node.output()):
            node.output().replaceAllUsesWith(other)
            return


def _float_constant(graph, node) -> None:
    """An integer 0-dim constant of float32/float64 arithmetic (``x / 2`` in Pyro's ``Normal``)
    as a constant of that dtype: the op casts it to that dtype anyway, exactly for an integer
    the dtype represents, and the cast costs as much as the op on a small tensor."""
    out = _sizes(node.output())
    if out is None or out[1] not in (torch.float32, torch.float64):
        return
    for offset in (0, 1):
        constant = node.inputsAt(offset)
        value = _tensor_constant(constant)
        if value is None or value.dim() != 0 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            continue
        if abs(int(value)) < 2**24:  # exact in float32 and float64
            graph.setInsertPoint(node)
            node.replaceInput(offset, graph.insertConstant(value.to(out[1])))


def _tensor_constant(value) -> torch.Tensor | None:
    """A tensor constant's value (TorchScript gives a 0-dim one of a trace as a Python number,
    its type saying it is a tensor), or ``None``."""
    kind = value.type()
    if value.node().kind() != "prim::Constant" or not isinstance(kind, torch._C.TensorType):
        return None
    ivalue = value.toIValue()
    if isinstance(ivalue, torch.Tensor):
        return ivalue
    if isinstance(ivalue, (bool, int, float)) and kind.dtype() is not None and kind.sizes() == []:
        return torch.tensor(ivalue, dtype=kind.dtype())
    return None


def _standard_normal(graph, node) -> None:
    """``normal(zeros, ones)``, what ``torch.distributions`` draws under a trace (eagerly it
    calls ``normal_()``), as ``randn_like(zeros)``: the same generator call and bits (checked for
    float32 and float64, below and above the vectorised size), at a third of the cost on a
    CPU, where the tensor-mean form scales and shifts the draws."""
    if len(list(node.inputs())) != 3 or node.inputsAt(2).type().kind() != "NoneType":
        return
    mean, std = (node.inputsAt(i) for i in (0, 1))
    values = [value.toIValue() if value.node().kind() == "prim::Constant" else None for value in (mean, std)]
    if not all(isinstance(value, torch.Tensor) for value in values) or _sizes(mean) != _sizes(node.output()):
        return
    zeros, ones = values
    if zeros.shape != ones.shape or zeros.dtype != ones.dtype or not (bool((zeros == 0).all()) and bool((ones == 1).all())):
        return
    graph.setInsertPoint(node)
    none = graph.insertConstant(None)
    draw = graph.create("aten::randn_like", [mean, none, none, none, none, none], 1)
    graph.insertNode(draw)
    draw.output().setType(node.output().type())
    node.output().replaceAllUsesWith(draw.output())


def _contiguous(value) -> bool:
    """Whether the trace saw ``value`` contiguous (its ``contiguous()`` is then itself).

    Only for recordings replayed on inputs laid out as recorded: a view input's strides are
    part of no signature, so this is used on values computed inside the recording."""
    kind = value.type()
    if value.node().kind() == "prim::Param" or not isinstance(kind, torch._C.TensorType):
        return False
    sizes, strides = kind.sizes(), kind.strides()
    if sizes is None or strides is None:
        return False
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _same_tensor(node) -> bool:
    """Whether a view or ``to`` node returns its input as it is (same sizes, dtype and device;
    ``to`` without ``copy=True``)."""
    source, out = node.inputsAt(0).type(), node.output().type()
    if not (isinstance(source, torch._C.TensorType) and isinstance(out, torch._C.TensorType)):
        return False
    sizes = source.sizes()  # None when the trace did not fix them
    if sizes is None or sizes != out.sizes() or source.dtype() is None or source.dtype() != out.dtype() or source.device() != out.device():
        return False
    if node.kind() != "aten::to":
        return True
    arguments = [argument.name for argument in torch._C.parse_schema(node.schema()).arguments]
    copy = node.inputsAt(arguments.index("copy")) if "copy" in arguments else None
    return copy is not None and copy.toIValue() is False


# The static runtime is tried once a recording has served this many calls without gradients:
# building it costs about as much as 100 replays save (a few ms), which a recording used for
# one short run would not earn back.
_STATIC_AFTER = 100


def execute(function: Callable, executors: dict | None, inputs: tuple) -> tuple:
    """Runs a recording ``function`` on ``inputs``; ``executors`` (kept with the recording)
    counts its calls and holds its static-runtime module once tried (``"static"``; ``False``
    when it did not give the interpreter's outputs).

    Where nothing needs a gradient (no input requires grad, or grad mode is off), from the
    ``_STATIC_AFTER``-th such call on, by TorchScript's static runtime: the same operations on
    the same generator, without the interpreter's autograd bookkeeping and with its memory
    planned once, measured about 1.3x faster on these graphs
    (``benchmarks/smc/bench_particles_speed.py``). Its first call runs beside the interpreter's
    from the same random state, and every output must be equal bit for bit, else the recording
    stays on the interpreter. Otherwise the plain interpreter: the optimising executor's
    profiling runs and guards measured no faster on these small graphs.
    """
    executors = executors if executors is not None else {}
    static = executors.get("static")
    if static is not False and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        if static is not None:
            return static(*inputs)
        executors["calls"] = executors.get("calls", 0) + 1
        if executors["calls"] >= _STATIC_AFTER:
            return _try_static(function, executors, inputs)
    return _interpret(function, inputs)


def _interpret(function: Callable, inputs: tuple) -> tuple:
    # Set and put back directly: the context manager costs as much as a tensor op here.
    optimize = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)
    try:
        return function(*inputs)
    finally:
        torch._C._set_graph_executor_optimize(optimize)


def _try_static(function: Callable, executors: dict, inputs: tuple) -> tuple:
    """The interpreter's outputs; and the static runtime's from the same random state, kept as
    the recording's executor if they are the same bit for bit."""
    before = rng_state()
    out = _interpret(function, inputs)
    after = rng_state()
    problem = None
    try:
        set_rng_state(before)
        static = torch._C._jit_to_static_module(function.graph)
        trial = static(*inputs)
        if not (isinstance(trial, tuple) and len(trial) == len(out) and all(_identical(a, b) for a, b in zip(trial, out))):
            problem = "its outputs differ from the interpreter's"
    except Exception as error:  # noqa: BLE001 - an internal runtime: any failure means not here
        problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    set_rng_state(after)
    executors["static"] = static if problem is None else False
    if problem is not None:
        logger.info("SMC's recording stays on the TorchScript interpreter: the static runtime failed (%s)", problem)
    return out


def _identical(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))


def ignore_jit_deprecation() -> None:
    """Inside a ``warnings.catch_warnings()`` block: drops torch's deprecation warning for
    ``torch.jit``, which recent torch emits on every trace and script. How a step is recorded is
    not the user's concern (under warnings as errors it stopped their first compiled run); every
    other warning still passes."""
    warnings.filterwarnings("ignore", r".*torch\.jit.*deprecated", DeprecationWarning)


# Recordings of the index resampling of every filter, by scheme and tensor layout: one model's
# run needs one, an SVI loop over a few shapes a few. Oldest dropped first beyond this many.
_RESAMPLINGS: dict[tuple, tuple[Callable, dict]] = {}
_MAX_RESAMPLINGS = 16


def resample_every(log_weights: torch.Tensor, particles: list[torch.Tensor], scheme: tuple[int, bool, int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`~pyro_smc.ops.resample.resample_where` of every filter, recorded once per
    ``scheme`` and layout and replayed by :func:`execute`: the same generator calls, ancestors
    and copies, at a third of the cost of the eager ops for a small filter (about a dozen ops
    of a few microseconds each, where the static runtime pays about one).

    Args:
        log_weights: normalised ``(B, N)``, finite normalisers (the caller checked them).
        particles: tensors ``(B, N, *event)``.
        scheme: ``(code, stop_gradient, search_below)`` of
            :func:`~pyro_smc.resamplers.index.index_scheme`.

    Returns:
        The particles and log-weights after resampling, as ``resample_where`` returns them.
    """
    code, stop_gradient, search_below = scheme
    key = (scheme,) + tuple((t.shape, t.dtype, t.device) for t in (log_weights, *particles))
    entry = _RESAMPLINGS.get(key)
    inputs = (log_weights, *particles)
    if entry is not None:
        out = execute(entry[0], entry[1], inputs)
        return list(out[:-1]), out[-1]
    made: list = []

    def resampling(lw: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new, new_lw = resample_where(lw, True, lw, list(values), code, stop_gradient, search_below)
        made[:] = new + [new_lw]
        return tuple(new) + (new_lw,)

    # The trace's own run is this call's resampling (the generator advanced once).
    with warnings.catch_warnings():
        # The sizes it reads are constants indeed: the recording is kept per layout.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        ignore_jit_deprecation()
        function = torch.jit.trace(resampling, inputs, check_trace=False)
    try:
        function = simplified(function)
    except Exception as error:  # noqa: BLE001 - left as traced: the same values
        logger.info("SMC's resampling recording is replayed as traced: its simplification failed (%s)", error)
    if len(_RESAMPLINGS) >= _MAX_RESAMPLINGS:
        _RESAMPLINGS.pop(next(iter(_RESAMPLINGS)))
    _RESAMPLINGS[key] = (function, {})
    return made[:-1], made[-1]
