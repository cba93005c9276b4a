"""The compiled step and the Python state its program reads (``pyro_smc.infer.smc.python_state``).

Each model below kept its clock, or changed what it reads, somewhere a recording cannot see, and
each gave a silently different answer from the handler path before the walk of the program's
Python state: a changepoint missed by 150 nats of log-evidence (a counter in a closure, a global,
a dict entry, a helper object, an ``itertools.count``), a control input set between calls of
``SMC.step`` ignored, a counter buffer advanced twice at the verifying step, a ``torch.no_grad()``
block differentiated through, particles written in place moved twice. Now each runs on the
handler path (or, for the control input, from the step it changed) with the handler path's
numbers exactly, and says why.
"""

import functools
import itertools
import math
import random

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, pyro_method

from pyro_smc import SMC
from pyro_smc.infer.smc.python_state import GradModeWatch, first_change, snapshot, stale
from tests.infer.smc import _control_module

T, CHANGE = 16, 6


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, ys = 0.0, []
    for t in range(T):
        x = 0.5 * x + (3.0 if t >= CHANGE else 0.0) + torch.randn((), generator=g).item()
        ys.append(x + 0.5 * torch.randn((), generator=g).item())
    return torch.tensor(ys)


class _Shifted:
    """``x_t = 0.5 x_{t-1} + 3 [t >= CHANGE] + N(0, 1)``, ``y_t = x_t + N(0, 0.5^2)``, the time
    index ``t`` supplied by the subclass."""

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def transition(self, state, y, t):
        shift = 3.0 if t >= CHANGE else 0.0
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + shift, 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


class DictClock(_Shifted):
    def __init__(self):
        self.ctx = {"t": 0}

    def init(self, state):
        self.ctx["t"] = 0
        super().init(state)

    def step(self, state, y):
        self.transition(state, y, self.ctx["t"])
        self.ctx["t"] += 1


class _Clock:
    def __init__(self):
        self.t = 0


class HelperClock(_Shifted):
    def __init__(self):
        self.clock = _Clock()

    def init(self, state):
        self.clock.t = 0
        super().init(state)

    def step(self, state, y):
        self.transition(state, y, self.clock.t)
        self.clock.t += 1


class CountClock(_Shifted):
    def init(self, state):
        self.clock = itertools.count()
        super().init(state)

    def step(self, state, y):
        self.transition(state, y, next(self.clock))


TICKS = 0


class GlobalClock(_Shifted):
    def init(self, state):
        global TICKS
        TICKS = 0
        super().init(state)

    def step(self, state, y):
        global TICKS
        self.transition(state, y, TICKS)
        TICKS += 1


class DecoratedClock(PyroModule):
    """The global clock behind Pyro's ``pyro_method`` decorator (a wrapper of Pyro's own code)."""

    @pyro_method
    def init(self, state):
        global TICKS
        TICKS = 0
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    @pyro_method
    def step(self, state, y):
        global TICKS
        _Shifted.transition(self, state, y, TICKS)
        TICKS += 1


def closure_clock():
    ticks = [0]

    class ClosureClock(_Shifted):
        def init(self, state):
            ticks[0] = 0
            super().init(state)

        def step(self, state, y):
            self.transition(state, y, ticks[0])
            ticks[0] += 1

    return ClosureClock()


class BufferClock(torch.nn.Module, _Shifted):
    """A counter tensor advanced in place and read through ``torch.where`` only: a trace records
    it, and the verifying step, which runs the recording and the handler path, advanced it twice."""

    def __init__(self):
        super().__init__()
        self.register_buffer("t", torch.zeros(()))

    def init(self, state):
        self.t.zero_()
        _Shifted.init(self, state)

    def step(self, state, y):
        shift = torch.where(self.t >= CHANGE, 3.0, 0.0)
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + shift, 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)
        self.t.add_(1)


class InPlaceState(_Shifted):
    """``state["x"] += ...``: the particles handed to the step are written in place."""

    def step(self, state, y):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        state["x"] *= 0.5
        state["x"] += x
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


class PythonRandom(_Shifted):
    """A shift drawn from Python's random module: a recording would bake one draw in."""

    def step(self, state, y):
        shift = random.gauss(0.0, 1.0)
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + shift, 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


def _run(model, compile, seed=0, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    random.seed(seed)
    return SMC(model, num_particles=64, num_filters=4, compile=compile, **kwargs).run(_data())


@pytest.mark.filterwarnings("ignore:the weights collapsed")  # the wrong answer degenerated; the right one need not
@pytest.mark.parametrize(
    "make, culprit",
    [
        (DictClock, "self.ctx['t']"),
        (HelperClock, "self.clock.t"),
        (CountClock, "self.clock"),
        (GlobalClock, "global 'TICKS'"),
        (DecoratedClock, "global 'TICKS'"),
        (closure_clock, "closure variable 'ticks'"),
        (BufferClock, "self.t, written in place"),
        (InPlaceState, "state['x'], written in place (assign a new tensor instead)"),
        (PythonRandom, "Python's random module"),
    ],
    ids=["dict", "helper", "itertools", "global", "decorated-global", "closure", "buffer", "in-place-state", "random"],
)
def test_a_step_that_changes_python_state_runs_on_the_handler_path(make, culprit):
    plain, fast = _run(make(), False), _run(make(), None)
    assert torch.equal(fast.log_evidence, plain.log_evidence)
    assert torch.equal(fast.filtering_means["x"], plain.filtering_means["x"])
    assert fast.compile_status is not None and culprit in fast.compile_status, fast.compile_status
    assert fast._compiled.compiled_steps == 0
    if make is BufferClock:
        assert int(fast.model.t) == int(plain.model.t) == T


class Controlled(_Shifted):
    """An input the user sets on the model between calls of ``SMC.step``."""

    control = 0.0

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + self.control, 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


@pytest.mark.filterwarnings("ignore:the weights collapsed")
def test_a_constant_set_between_steps_is_not_baked_in():
    """A float attribute set between calls of ``SMC.step`` was frozen at its recorded value (the
    replay ignored a control switched on at step 6: 145 nats of log-evidence); a tensor
    attribute is an input of the recording and stays compiled."""
    ys, runs = _data(), {}
    for kind in ("float", "tensor"):
        for compile in (False, None):
            pyro.set_rng_seed(0)
            model = Controlled()
            smc = SMC(model, num_particles=64, num_filters=4, compile=compile).init()
            for t, y in enumerate(ys):
                control = 3.0 if t >= CHANGE else 0.0
                model.control = control if kind == "float" else torch.tensor(control)
                smc.step(y)
            runs[kind, compile] = smc
        plain, fast = runs[kind, False], runs[kind, None]
        assert torch.equal(fast.log_evidence, plain.log_evidence), kind
    assert "self.control changed between steps" in runs["float", None].compile_status
    assert runs["tensor", None].compile_status is None and runs["tensor", None]._compiled.compiled_steps > 0


class Frozen(_Shifted):
    """A drift computed under ``torch.no_grad()``: it carries no gradient on the handler path."""

    def __init__(self, theta):
        self.theta = theta

    def step(self, state, y):
        with torch.no_grad():
            drift = self.theta * 2.0
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + drift - drift.detach() + self.theta, 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


def test_no_grad_inside_the_step_is_not_differentiated_through():
    grads = {}
    for compile in (False, None):
        theta = torch.tensor(0.3, requires_grad=True)
        smc = _run(Frozen(theta), compile)
        (grads[compile],) = torch.autograd.grad(smc.log_evidence.sum(), theta)
        if compile is None:
            assert "switches autograd off or on" in smc.compile_status
    assert torch.equal(grads[None], grads[False])


def test_distributions_sampling_under_no_grad_stays_compiled():
    """torch's ``Distribution.sample`` draws under ``no_grad``; that is no switch of the program's."""

    class Switching(_Shifted):
        def init(self, state):
            state["z"] = pyro.sample("z_init", dist.Bernoulli(0.5))
            super().init(state)

        def step(self, state, y):
            state["z"] = pyro.sample("z", dist.Bernoulli(0.2 + 0.6 * state["z"]))
            state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + 3.0 * state["z"], 1.0))
            pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)

    plain, fast = _run(Switching(), False), _run(Switching(), None)
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    assert torch.allclose(fast.log_evidence, plain.log_evidence, rtol=0, atol=1e-12)


def test_snapshot_paths_and_stale():
    class Helper:
        def __init__(self):
            self.values = [1.0, 2.0]
            self.table = {"a": torch.zeros(2)}

    class Model:
        def __init__(self):
            self.helper, self.rate, self.nan = Helper(), 0.5, math.nan

    model = Model()
    before = snapshot((model, None), rng=False)
    assert stale(before) is None and first_change(before, snapshot((model, None), rng=False)) is None  # NaN equals itself here
    model.helper.values[1] = 3.0
    assert stale(before) == "the model's self.helper.values"
    model.helper.values[1] = 2.0
    model.helper.table["a"].add_(1)
    assert stale(before) == "the model's self.helper.table['a']"
    assert first_change(before, snapshot((model, None), rng=False)) == "the model's self.helper.table['a'], written in place"
    model.helper = Helper()
    assert stale(before) == "the model's self.helper"
    # A generator's position cannot be read: a model holding one is not compiled.
    model.source = (i for i in range(3))
    assert "is an iterator" in snapshot((model, None)).problem


def test_grad_mode_watch():
    watch = GradModeWatch()
    with watch:
        dist.Bernoulli(0.3).sample()  # under no_grad inside torch: not the program's switch
        torch.ones(2) * 2
    assert not watch.switched
    with watch:
        with torch.no_grad():
            torch.ones(2) * 2
    assert watch.switched


class _Driven(_Shifted):
    """The shift read through ``self.control()``, set between calls of ``SMC.step``."""

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"] + self.control(), 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


class ArrayDriven(_Driven):
    def __init__(self):
        self.u = np.zeros(1)

    def control(self):
        return float(self.u[0])

    def set(self, value):
        self.u[0] = value  # in place: the array keeps its identity


_BOX = [0.0]


class PartialDriven(_Driven):
    def __init__(self):
        self.control = functools.partial(lambda box: box[0], _BOX)

    def set(self, value):
        _BOX[0] = value


class ModuleDriven(_Driven):
    def control(self):
        return _control_module.control()

    def set(self, value):
        _control_module.CONTROL = value


class DefaultDriven(_Driven):
    def control(self, box=[0.0]):  # noqa: B006 - the mutable default is the point
        return box[0]

    def set(self, value):
        type(self).control.__defaults__[0][0] = value


@pytest.mark.filterwarnings("ignore:the weights collapsed")
@pytest.mark.parametrize(
    "make, culprit",
    [(ArrayDriven, "self.u"), (PartialDriven, "self.control.args[0]"), (ModuleDriven, "'CONTROL'"), (DefaultDriven, "default 0")],
    ids=["numpy-array", "partial", "user-module", "default-argument"],
)
def test_an_input_changed_after_the_verifying_step_is_not_baked_in(make, culprit):
    """A control switched on at step 6 (after the recording was verified) and read through a
    NumPy array written in place, a functools.partial, a user module's global or a mutable default
    argument was frozen at its recorded value: log Z 900 nats off. Now the step falls back."""
    ys, runs = _data(), {}
    for compile in (False, None):
        pyro.set_rng_seed(0)
        model = make()
        model.set(0.0)
        smc = SMC(model, num_particles=64, num_filters=4, compile=compile).init()
        for t, y in enumerate(ys):
            model.set(3.0 if t >= CHANGE else 0.0)
            smc.step(y)
        runs[compile] = smc
        model.set(0.0)
    assert torch.equal(runs[None].log_evidence, runs[False].log_evidence)
    status = runs[None].compile_status
    assert status is not None and culprit in status and "changed between steps" in status, status


class _Switched(_Shifted):
    """Observation noise chosen by a Python test of the observation's flag column."""

    def step(self, state, y):
        noisy = self.noisy(y[1])
        state["x"] = pyro.sample("x", dist.Normal(0.5 * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 2.0 if noisy else 0.5), obs=y[0])


@pytest.mark.parametrize(
    "test",
    [
        lambda flag: not torch.equal(flag, torch.zeros(())),
        lambda flag: not torch.allclose(flag, torch.zeros(())),
        lambda flag: not flag.equal(torch.zeros(())),
        lambda flag: torch.is_nonzero(flag),
    ],
    ids=["torch.equal", "torch.allclose", "Tensor.equal", "torch.is_nonzero"],
)
def test_a_branch_on_a_silent_value_read_runs_on_the_handler_path(test):
    """torch.equal and friends return Python bools without the tracer's warning: a recording
    froze the branch (the noise switch at step 6 was ignored: 23 nats). Now it is refused."""
    flags = (torch.arange(T) >= CHANGE).to(torch.get_default_dtype())
    ys = torch.stack([_data(), flags], -1)
    model = _Switched()
    model.noisy = staticmethod(test)
    runs = {}
    for compile in (False, None):
        pyro.set_rng_seed(0)
        runs[compile] = SMC(model, num_particles=64, num_filters=4, compile=compile).run(ys)
    assert torch.equal(runs[None].log_evidence, runs[False].log_evidence)
    assert "reads a tensor as a Python value" in runs[None].compile_status
