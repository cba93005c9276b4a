"""The compiled step (``SMC(compile=...)``) against the handler path: the same random stream, so
the same particles, log-evidence and gradients to rounding, and a fallback wherever a recording
would not be valid."""

import contextlib
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroParam

from pyro_smc import SMC
from pyro_smc.infer.smc.importance import SMCFailedError
from pyro_smc.infer.smc.compiled import CompileFallbackWarning
from pyro_smc.ops.resample import resample_where
from pyro_smc.infer.smc import advance, replay, replay_loop
from pyro_smc.infer.smc import engine as engine_module
from pyro_smc.infer.smc.replay_loop import run_replayed
from pyro_smc.resamplers import MultinomialResampler, OTResampler, ResidualResampler, StratifiedResampler, SystematicResampler

T = 30


class AR(PyroModule):
    """x_t = theta x_{t-1} + N(0, 1), y_t = x_t + N(0, 0.5^2), theta a PyroParam."""

    def __init__(self, theta=0.7):
        super().__init__()
        self.theta = PyroParam(torch.tensor(theta), constraint=dist.constraints.interval(-1.0, 1.0))

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


class Proposal(PyroModule):
    """A learnable proposal q(x_t | x_{t-1}, y_t) = N(a x_{t-1} + b y_t, s^2)."""

    def __init__(self):
        super().__init__()
        self.a = PyroParam(torch.tensor(0.5))
        self.b = PyroParam(torch.tensor(0.3))
        self.s = PyroParam(torch.tensor(0.9), constraint=dist.constraints.positive)

    def init(self, state):
        pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y):
        pyro.sample("x", dist.Normal(self.a * state["x"] + self.b * y, self.s))


def _data(seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    x, ys = 0.0, []
    for _ in range(T):
        x = 0.7 * x + torch.randn((), generator=g).item()
        ys.append(x + 0.5 * torch.randn((), generator=g).item())
    return torch.tensor(ys)


def _run(compile, seed=1, guide=None, model=None, ys=None, **kwargs):
    pyro.clear_param_store()
    model = AR() if model is None else model
    torch.manual_seed(seed)
    smc = SMC(model, guide, compile=compile, **kwargs)
    smc.run(_data() if ys is None else ys)
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    grads = torch.autograd.grad(smc.log_evidence.sum(), params, allow_unused=True) if params else []
    return smc, grads


def _assert_same(a, b, grads_a=(), grads_b=()):
    assert torch.allclose(a.log_evidence, b.log_evidence, rtol=0, atol=1e-12)
    for key in a.filtering_means:
        assert torch.allclose(a.filtering_means[key], b.filtering_means[key], rtol=0, atol=1e-12)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(epsilon=0.5)], ids=["systematic", "ot"])
@pytest.mark.parametrize("with_guide", [False, True], ids=["bootstrap", "guide"])
def test_compiled_equals_handler_path(resampler, with_guide):
    guide = Proposal() if with_guide else None
    plain, g_plain = _run(False, guide=guide, num_particles=64, num_filters=3, resampler=resampler)
    guide = Proposal() if with_guide else None
    fast, g_fast = _run(True, guide=guide, num_particles=64, num_filters=3, resampler=resampler)
    assert fast._compiled.reason is None and fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain, g_fast, g_plain)
    assert torch.equal(fast.resampled, plain.resampled)



class Mixed:
    """A 2-d state and a float-coded 0/1 label: an event dim and a discrete key to resample."""

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        state["z"] = pyro.sample("z_init", dist.Bernoulli(0.5))

    def step(self, state, y):
        state["z"] = pyro.sample("z", dist.Bernoulli(0.3 + 0.4 * state["z"]))
        state["x"] = pyro.sample("x", dist.Normal(0.7 * state["x"] + state["z"].unsqueeze(-1), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(state["x"].sum(-1), 0.5), obs=y)


@pytest.mark.parametrize(
    "model, resampler",
    [(model, resampler) for model in (AR, Mixed) for resampler in (SystematicResampler(), StratifiedResampler(), MultinomialResampler(), ResidualResampler())]
    # A discrete site's score terms read a tensor as a Python value: not compiled (a fallback).
    + [(AR, StratifiedResampler(gradient="stop_gradient"))],
    ids=lambda value: value.__name__.lower() if isinstance(value, type) else f"{type(value).__name__}-{value.gradient}",
)
@pytest.mark.parametrize("num_filters, num_particles", [(1, 64), (1, 500), (3, 200)], ids=["B1", "B1-counting", "B3"])
@pytest.mark.parametrize("loop", [True, False], ids=["loop", "step-by-step"])
def test_replayed_steps_resample_as_the_handler_path(resampler, num_filters, num_particles, model, loop, monkeypatch):
    """A replayed step resamples an index resampler's way in tensor operations alone
    (resample_where, or resample_every when every filter resamples; inside the compiled loop of
    replay_loop when the rest of the run is regular): the same draws, particles, log-weights and
    gradients as the resampler's call on the handler path, for every scheme, one filter or some
    of several, labels and event dims, and systematic resampling's search and counting paths."""
    calls, looped = [], []
    monkeypatch.setattr(advance, "resample_where", lambda *a: calls.append(1) or resample_where(*a))
    monkeypatch.setattr(advance, "resample_every", lambda *a: calls.append(1) or replay.resample_every(*a))
    if loop:
        monkeypatch.setattr(engine_module, "run_replayed", lambda *a: looped.append(run_replayed(*a)) or looped[-1])
    else:
        monkeypatch.setattr(engine_module.SMC, "_replay_rest", lambda *a: 0)
    runs = []
    for compile in (False, None):
        runs.append(_run(compile, model=model(), num_particles=num_particles, num_filters=num_filters, resampler=resampler))
    (plain, g_plain), (fast, g_fast) = runs
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    if loop:
        assert looped == [T - 3] and not calls  # after the verified step, the loop took the rest
    else:
        assert calls and fast.resampled.any(-1).sum() > len(calls) / 2  # the replayed steps resampled by it
    _assert_same(fast, plain, g_fast, g_plain)
    assert torch.equal(fast.resampled, plain.resampled)
    for key in plain.state:
        assert fast.state[key].dtype == plain.state[key].dtype and torch.equal(fast.state[key], plain.state[key])
    assert torch.equal(fast.log_weights, plain.log_weights)


@pytest.mark.parametrize("no_grad", [False, True], ids=["nothing-requires-grad", "no_grad"])
def test_the_loop_without_a_gradient_runs_in_inference_mode_and_hands_back_ordinary_tensors(no_grad, monkeypatch):
    """With nothing to differentiate the compiled loop runs in inference mode: the same numbers
    as the handler path, and nothing it hands back is an inference tensor, so later steps under
    autograd (a parameter that requires grad from then on) can save them."""
    looped, cloned = [], []
    monkeypatch.setattr(engine_module, "run_replayed", lambda *a: looped.append(run_replayed(*a)) or looped[-1])
    monkeypatch.setattr(replay_loop, "_cloned", lambda value, clone=replay_loop._cloned: cloned.append(1) or clone(value))
    theta = torch.tensor(0.7)  # a plain tensor: no parameter in the param store to require grad
    context = torch.no_grad if no_grad else contextlib.nullcontext
    runs = []
    for compile in (False, None):
        torch.manual_seed(3)
        smc = SMC(PlainAR(theta), compile=compile, num_particles=50)
        with context():
            smc.run(_data())
        runs.append(smc)
    plain, fast = runs
    assert looped == [T - 3] and cloned  # the loop ran, in inference mode
    _assert_same(fast, plain)
    tensors = [fast.log_evidence, fast.log_weights, *fast.state.values(), *fast.filtering_means.values()]
    assert not any(x.is_inference() for x in tensors)
    # Continued under autograd: the state enters the graph of a parameter that requires grad.
    smc.model.theta = torch.tensor(0.7, requires_grad=True)
    smc.step(torch.tensor(0.3))
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), smc.model.theta)
    assert torch.isfinite(grad) and grad != 0


class PlainAR:
    """Not a PyroModule: theta a tensor attribute that requires grad (``model.A = theta`` style)."""

    def __init__(self, theta):
        self.theta = theta

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


def test_tensor_attributes_are_inputs_of_the_recording():
    out = []
    for compile in (False, None):
        theta = torch.tensor(0.7, requires_grad=True)
        torch.manual_seed(4)
        smc = SMC(PlainAR(theta), num_particles=50, num_filters=2, compile=compile).run(_data())
        out.append((smc, torch.autograd.grad(smc.log_evidence.sum(), theta)))
    (plain, g_plain), (fast, g_fast) = out
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain, g_fast, g_plain)
    # A new tensor on the model between runs is what the next run reads.
    fast.model.theta = torch.tensor(0.2)
    torch.manual_seed(4)
    again = fast.run(_data())
    torch.manual_seed(4)
    reference = SMC(PlainAR(torch.tensor(0.2)), num_particles=50, num_filters=2, compile=False).run(_data())
    _assert_same(again, reference)


def test_compiled_float32_and_the_kalman_answer():
    """The compiled filter is still a particle filter: its log Z averages to the exact value."""
    torch.set_default_dtype(torch.float32)  # conftest restores the default after the test
    ys = _data(T=20)
    smc, _ = _run(True, ys=ys, num_particles=200, num_filters=50)
    assert smc.log_evidence.dtype == torch.float32
    assert smc._compiled.compiled_steps == 17
    # Kalman filter of the same scalar model.
    m, p, exact = 0.0, 1.0, 0.0
    for y in ys.tolist():
        m, p = 0.7 * m, 0.49 * p + 1.0
        s = p + 0.25
        exact += -0.5 * (math.log(2 * math.pi * s) + (y - m) ** 2 / s)
        m, p = m + p / s * (y - m), p - p * p / s
    lz = smc.log_evidence.detach().double()
    # exp(log Z_hat) is unbiased; log Z_hat sits below log Z by about var / 2.
    assert abs(lz.mean().item() - exact) < 5 * lz.std().item() / math.sqrt(50) + lz.var().item()


class Counting(AR):
    """A step counter read as a number (not only to name sites): a recording would freeze it."""

    def init(self, state):
        super().init(state)
        self.t = 0

    def step(self, state, y):
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(self.theta * state["x"] + (0.1 if self.t >= 20 else 0.0), 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.5), obs=y)
        self.t += 1


class Naming(AR):
    """A step counter that only names the sites, as ``pyro.infer.SMCFilter`` models keep one."""

    def init(self, state):
        super().init(state)
        self.t = 0

    def step(self, state, y):
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.5), obs=y)
        self.t += 1


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "step-by-step"])
def test_a_counter_that_names_sites_is_advanced_by_the_replays(loop, monkeypatch):
    if not loop:
        monkeypatch.setattr(engine_module.SMC, "_replay_rest", lambda *a: 0)
    plain, g_plain = _run(False, model=Naming(), num_particles=50, num_filters=2)
    fast, g_fast = _run(True, model=Naming(), num_particles=50, num_filters=2)
    assert fast.compile_status is None
    if not loop:
        assert fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain, g_fast, g_plain)
    assert fast.model.t == plain.model.t == T
    # A kept recording serves the next run of the same model, its counter reset by init().
    again, g_again = _run(None, model=fast.model, num_particles=50, num_filters=2)
    _assert_same(again, plain, g_again, g_plain)
    assert again.compile_status is None and again.model.t == T


class Branching(AR):
    def step(self, state, y):
        scale = 0.5 if y > 0 else 1.0  # a Python branch on the observation's value
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], scale), obs=y)


class Logging(AR):
    def __init__(self):
        super().__init__()
        self.seen = []

    def step(self, state, y):
        super().step(state, y)
        self.seen.append(y)


@pytest.mark.parametrize("model, expected", [(Counting, "self.t is read as a number"), (Branching, "Python value"), (Logging, "list, dict or set")])
def test_fallback_is_named_and_changes_nothing(model, expected):
    plain, g_plain = _run(False, model=model(), num_particles=50)
    with pytest.warns(CompileFallbackWarning, match="handlers"):
        fast, g_fast = _run(True, model=model(), num_particles=50)
    assert expected in fast.compile_status and fast._compiled.compiled_steps == 0
    if model is Logging:
        assert len(fast.model.seen) == len(plain.model.seen) == T
    _assert_same(fast, plain, g_fast, g_plain)
    quiet, _ = _run(None, model=model(), num_particles=50)  # compile=None: the same, no warning
    assert quiet._compiled.reason is not None


def test_missing_steps_and_batches_run_on_the_handler_path_between_replays():
    ys = _data()
    ys[10] = float("nan")
    plain, g_plain = _run(False, ys=ys, num_particles=50, num_filters=2)
    fast, g_fast = _run(True, ys=ys, num_particles=50, num_filters=2)
    assert fast._compiled.reason is None and fast._compiled.compiled_steps == T - 4
    _assert_same(fast, plain, g_fast, g_plain)
    batch = torch.stack([_data(1), _data(2)]).unsqueeze(-1).squeeze(-1)
    runs = []
    for compile in (False, True):
        pyro.clear_param_store()
        torch.manual_seed(3)
        runs.append(SMC(AR(), num_particles=40, num_filters=2, compile=compile).run(batch, lengths=torch.tensor([T, 20]), batched=True))
    _assert_same(runs[1], runs[0])


@pytest.mark.parametrize(
    "gradient, with_guide", [("stop_gradient", False), ("stop_gradient", True), ("marginal_stop_gradient", False)], ids=["sg", "sg-guide", "marginal"]
)
def test_stop_gradient_estimators(gradient, with_guide):
    """The stop-gradient estimator's score terms are recorded with the step (the same gradients,
    of the model's and the guide's parameters); the marginal one (bootstrap only) runs on the
    handler path."""
    runs = []
    for compile in (False, None):
        runs.append(_run(compile, guide=Proposal() if with_guide else None, num_particles=30, num_filters=2,
                         resampler=SystematicResampler(gradient=gradient)))
    (plain, g_plain), (fast, g_fast) = runs
    if gradient == "stop_gradient":
        assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    else:
        assert "marginal stop-gradient" in fast.compile_status
    assert any(g is not None and bool(g.abs().sum() > 0) for g in g_plain)  # theta's, at least
    _assert_same(fast, plain, g_fast, g_plain)


def test_store_history_is_not_compiled():
    smc, _ = _run(None, num_particles=20, store_history=True)
    assert "store_history" in smc._compiled.reason


def test_a_failing_replayed_step_reports_as_the_handler_path_does():
    class Exploding(AR):
        def step(self, state, y):
            state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
            pyro.sample("y", dist.Normal(state["x"], (0.5 - y.abs()).exp().log1p()), obs=y)  # fine while |y| small

    ys = _data()
    ys[20] = 1e6  # the scale underflows to 0: Pyro's validation rejects it
    errors = []
    for compile in (False, True):
        pyro.clear_param_store()
        torch.manual_seed(0)
        with pytest.raises(Exception) as info:
            SMC(Exploding(), num_particles=20, compile=compile).run(ys)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_a_later_run_of_the_same_model_reuses_its_recording():
    """SMCELBO builds an SMC per SVI step: the recording stays with the model and guide, is
    verified again at the next run's first regular step and replays from its second."""
    model, guide = AR(), Proposal()
    runs = []
    for compile in (None, None, False):
        torch.manual_seed(5)
        runs.append(SMC(model, guide, num_particles=40, num_filters=2, compile=compile).run(_data()))
    first, second, plain = runs
    # Step 0 of the second run is not like the recorded one (its particles, drawn from the
    # prior, need no grad yet); step 1 is verified, and the rest replayed.
    assert first._compiled.compiled_steps == T - 3 and second._compiled.compiled_steps == T - 2
    _assert_same(second, plain)
    # A new guide object of the same class and structure reuses it (verified first); a guide of
    # another class is another program: recorded afresh.
    torch.manual_seed(5)
    same = SMC(model, Proposal(), num_particles=40, num_filters=2).run(_data())
    torch.manual_seed(5)
    other = SMC(model, OtherProposal(), num_particles=40, num_filters=2).run(_data())
    assert same._compiled.compiled_steps == T - 2 and other._compiled.compiled_steps == T - 3
    _assert_same(same, plain)


class OtherProposal(Proposal):
    """The same program under another class."""


class Hidden(AR):
    """A tensor the recording cannot see as an input: inside a list attribute."""

    def __init__(self, scale, box=None):
        super().__init__()
        self.box = [torch.tensor(scale)] if box is None else box

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], self.box[0]), obs=y)


def _handler_and_compiled(make):
    out = []
    for compile in (False, None):
        torch.manual_seed(7)
        out.append(SMC(make(), num_particles=30, compile=compile).run(_data()))
    return out


def test_a_new_model_object_of_the_same_class_reuses_a_recording_only_where_it_fits():
    """A model object of the same class and structure reuses another's verified recording (the
    verifying step checks it against this object's handler path); a different scalar attribute or
    a different container (where a tensor hides from the recording's inputs) records afresh. Each
    answer equals the handler path's."""
    first = SMC(ScaledAR(0.5), num_particles=30).run(_data())
    assert first._compiled.compiled_steps == T - 3
    plain, fast = _handler_and_compiled(lambda: ScaledAR(0.5))  # same class, same constants
    assert fast._compiled.compiled_steps == T - 2
    _assert_same(fast, plain)
    plain, fast = _handler_and_compiled(lambda: ScaledAR(0.8))  # a constant differs
    assert fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain)
    SMC(Hidden(0.5), num_particles=30).run(_data())
    plain, fast = _handler_and_compiled(lambda: Hidden(0.9))  # another list: not shared
    assert fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain)
    # The same list object, its tensor changed in place: shared, found wrong at the verifying
    # step, recorded afresh (as for a kept recording whose global changed).
    box = [torch.tensor(0.5)]
    SMC(Hidden(0.5, box), num_particles=30).run(_data())
    box[0] = torch.tensor(1.7)
    plain, fast = _handler_and_compiled(lambda: Hidden(0.5, box))
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 5
    _assert_same(fast, plain)


NOISE = 0.5


class ScaledAR(AR):
    """The emission scale a float attribute (baked into a recording as a constant), the
    transition's a module global (which no attribute shows)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], NOISE))
        pyro.sample("y", dist.Normal(state["x"], self.scale), obs=y)


def test_a_changed_constant_between_runs_is_recorded_afresh(monkeypatch):
    model = ScaledAR(0.5)
    SMC(model, num_particles=30).run(_data())

    def both():
        out = []
        for compile in (None, False):
            torch.manual_seed(6)
            out.append(SMC(model, num_particles=30, compile=compile).run(_data()))
        return out

    model.scale = 0.8  # seen among the model's attributes: recorded afresh at once
    fast, plain = both()
    assert fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain)
    # Seen by no attribute: the next run's verifying step finds the replay wrong, and records afresh.
    monkeypatch.setitem(globals(), "NOISE", 1.5)
    fast, plain = both()
    # Step 0 on the handlers (its particles need no grad yet), step 1 verified and found wrong,
    # then as a first run: step 2 on the handlers, 3 recorded, 4 verified, the rest replayed.
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 5
    _assert_same(fast, plain)


class Huge(AR):
    """Two state entries near the float64 maximum: each filtering mean is finite, their sum is not."""

    def step(self, state, y):
        super().step(state, y)
        state["big"] = torch.full_like(state["x"], 1e308)
        state["bigger"] = torch.full_like(state["x"], 1.5e308)


def test_a_status_that_overflows_is_rerun_on_the_handler_path():
    """The replayed step's one-number check is a sum; finite means that overflow it send the step
    to the handler path, which finds nothing wrong: the same answer, the step just not replayed."""
    runs = []
    for compile in (False, None):
        torch.manual_seed(2)
        runs.append(SMC(Huge(), num_particles=20, compile=compile).run(_data()))
    plain, fast = runs
    assert fast.compile_status is None and fast._compiled.compiled_steps == 0
    assert bool(torch.isfinite(fast.filtering_means["big"]).all())
    _assert_same(fast, plain)


def _executors(model):
    from pyro_smc.infer.smc.compiled import _KEPT

    return _KEPT[model][1].executors


def test_steps_without_gradients_run_on_the_static_runtime_with_the_same_values(monkeypatch):
    """Where nothing needs a gradient the recording runs on TorchScript's static runtime (here
    from its second call): the same draws and values as the handler path (bit for bit here);
    with parameters that require grad it stays on the interpreter, whose autograd the
    gradients need."""
    # Step by step (as SMC.step replays): the loop of a run calls the recording inside TorchScript.
    monkeypatch.setattr(engine_module.SMC, "_replay_rest", lambda *a: 0)
    monkeypatch.setattr(replay, "_STATIC_AFTER", 2)
    model = Mixed()
    runs = []
    for compile in (False, None):
        pyro.clear_param_store()
        torch.manual_seed(3)
        runs.append(SMC(model if compile is None else Mixed(), num_particles=50, num_filters=2, compile=compile).run(_data()))
    plain, fast = runs
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    assert isinstance(_executors(model)["static"], torch.StaticModule)
    assert torch.equal(fast.log_evidence, plain.log_evidence) and torch.equal(fast.state["x"], plain.state["x"])
    ar = AR()
    _run(None, model=ar, num_particles=30)
    assert "static" not in _executors(ar)  # theta requires grad: never tried
    runs = []
    for compile, model in ((None, ar), (False, AR())):
        torch.manual_seed(4)
        with torch.no_grad():
            runs.append(SMC(model, num_particles=30, compile=compile).run(_data()))
    assert isinstance(_executors(ar)["static"], torch.StaticModule)
    assert runs[0]._compiled.compiled_steps == T - 3  # grad mode off: another recording
    _assert_same(*runs)


def test_a_static_runtime_that_fails_leaves_the_recording_on_the_interpreter(monkeypatch):
    # Step by step (as SMC.step replays): the loop of a run calls the recording inside TorchScript.
    monkeypatch.setattr(engine_module.SMC, "_replay_rest", lambda *a: 0)
    monkeypatch.setattr(replay, "_STATIC_AFTER", 2)

    def broken(graph):
        raise RuntimeError("no static runtime here")

    monkeypatch.setattr(torch._C, "_jit_to_static_module", broken)
    model = Mixed()
    runs = []
    for compile in (False, None):
        torch.manual_seed(3)
        runs.append(SMC(model if compile is None else Mixed(), num_particles=50, compile=compile).run(_data()))
    plain, fast = runs
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    assert _executors(model)["static"] is False
    assert torch.equal(fast.log_evidence, plain.log_evidence) and torch.equal(fast.state["x"], plain.state["x"])


def test_a_simplification_that_fails_replays_the_recording_as_traced(monkeypatch):
    from pyro_smc.infer.smc import compiled

    def broken(function):
        raise RuntimeError("no simplification here")

    monkeypatch.setattr(compiled, "simplified", broken)
    (plain, g_plain), (fast, g_fast) = _run(False, num_particles=40), _run(None, num_particles=40)
    assert fast.compile_status is None and fast._compiled.compiled_steps == T - 3
    _assert_same(fast, plain, g_fast, g_plain)


def test_a_step_that_fails_inside_the_loop_is_reported_as_on_the_handler_path(monkeypatch):
    """An observation no particle can explain (every weight zero) at a step the compiled loop
    would take stops the loop; the run is rewound to where the loop started, replays step by step
    and the handler path raises the uncompiled run's error, naming the same step."""
    looped = []
    monkeypatch.setattr(engine_module, "run_replayed", lambda *a: looped.append(run_replayed(*a)) or looped[-1])
    ys = _data()
    ys[20] = 1e200  # (y - x)^2 overflows: log-density -inf for every particle
    messages = []
    for compile in (False, None):
        torch.manual_seed(5)
        with pytest.raises(SMCFailedError) as info:
            SMC(AR(), num_particles=30, compile=compile).run(ys)
        messages.append(str(info.value))
    assert looped == [0] and "time step 20" in messages[0] and messages[0] == messages[1]
    # The same run without the bad step (a new AR object: the failed run's verified recording,
    # shared by class, is verified again at step 1): the loop takes every step after that.
    torch.manual_seed(5)
    fine = SMC(AR(), num_particles=30).run(_data())
    assert looped == [0, T - 2] and fine._compiled.compiled_steps == T - 2


def test_recording_and_replaying_raise_no_torch_jit_deprecation(monkeypatch):
    """Recent torch marks ``torch.jit.trace`` and ``torch.jit.script`` deprecated. How the step is
    recorded is internal: under warnings as errors (``pytest -W error``) a user's first compiled
    run raised torch's DeprecationWarning from inside the engine."""
    from collections import OrderedDict

    from pyro_smc.infer.smc import compiled

    monkeypatch.setattr(replay_loop, "_scripted_resample_where", None)  # scripted afresh
    monkeypatch.setattr(replay, "_RESAMPLINGS", {})
    monkeypatch.setattr(compiled, "_SHARED", OrderedDict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        smc, _ = _run(None, model=AR(), num_particles=50, num_filters=2)
    assert smc._compiled.reason is None and smc._compiled.compiled_steps > 0 and bool(smc.resampled.any())


class KeyedData(AR):
    """Observations held by the model and looked up by a key made from the step counter."""

    def __init__(self, ys, shared_name=False):
        super().__init__()
        self.data = {f"y_{t}": y for t, y in enumerate(ys)}
        self.shared_name = shared_name

    def init(self, state):
        super().init(state)
        self.t = 0

    def step(self, state):
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(self.theta * state["x"], 1.0))
        if self.shared_name:  # one string, the site's name and the key
            name = f"y_{self.t}"
            pyro.sample(name, dist.Normal(state["x"], 0.5), obs=self.data[name])
        else:
            pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.5), obs=self.data[f"y_{self.t}"])
        self.t += 1


@pytest.mark.parametrize("shared_name", [False, True], ids=["two-strings", "one-string"])
def test_a_counter_formatted_into_a_data_key_is_not_frozen(shared_name):
    """A key made from the counter is caught when the recording is made (more strings formatted
    than names carry the counter) or, made once and used both as a site name and a key, by the
    verifying step (the next step's data differ)."""
    ys = _data()
    runs = {}
    for compile in (False, None):
        pyro.clear_param_store()
        torch.manual_seed(1)
        smc = SMC(KeyedData(ys, shared_name), num_particles=50, compile=compile).init()
        for _ in range(T):
            smc.step()
        runs[compile] = smc
    assert torch.equal(runs[None].log_evidence, runs[False].log_evidence)
    expected = "the replayed" if shared_name else "formats its step counter into a string that is not a site name"
    assert expected in runs[None].compile_status


class _GammaDrift:
    """A positive state whose transition's rate turns negative once the argument ``c`` is large."""

    def init(self, state):
        state["x"] = pyro.sample("x0", dist.Gamma(2.0, 2.0))

    def step(self, state, y=None, c=None):
        x = pyro.sample("x", dist.Gamma(3.0, 3.0 / state["x"] - c))
        pyro.sample("y", dist.Normal(x, 1.0), obs=y)
        state["x"] = x


class _DirichletDrift:
    """A probability vector whose concentration turns negative once ``c`` is large."""

    def init(self, state):
        state["p"] = pyro.sample("p0", dist.Dirichlet(torch.ones(3)))

    def step(self, state, y=None, c=None):
        p = pyro.sample("p", dist.Dirichlet(20 * state["p"] + 0.1 - c))
        pyro.sample("y", dist.Categorical(p), obs=y)
        state["p"] = p


@pytest.mark.parametrize("model", [_GammaDrift, _DirichletDrift])
@pytest.mark.parametrize("compile", [None, True, False])
def test_a_replayed_step_whose_parameters_leave_their_support_raises_as_the_handlers_do(model, compile):
    """Before: a replay runs without Pyro's validation, so from step 6 on (a negative rate, a
    negative concentration) the compiled filter ran on to a finite log-evidence, reporting
    itself compiled, where ``compile=False`` raised. Each replay now checks the
    constraints; a step that breaks one is rerun on the handlers, which raise the same error, now
    naming the step."""
    pyro.set_rng_seed(0)
    T = 12
    ys = torch.randint(0, 3, (T,), generator=torch.Generator().manual_seed(0)).to(torch.get_default_dtype())
    shift = torch.zeros(T)
    shift[6:] = 3.0
    smc = SMC(model(), num_particles=100, num_filters=4, compile=compile).init()
    with pytest.raises(ValueError, match=r"^at time step 6: Expected parameter .* to satisfy the constraint"):
        for t in range(T):
            smc.step(ys[t], shift[t])
