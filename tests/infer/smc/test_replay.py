"""The simplification and the executors of a recorded step: the same values, draws and
gradients as the traced graph, with the work that changes nothing removed."""

import pyro.distributions as dist
import pytest
import torch

from pyro_smc.infer.smc import replay
from pyro_smc.infer.smc.replay import execute, simplified


def _ops(function) -> list[str]:
    return [node.kind() for node in function.graph.nodes() if node.kind().startswith("aten::")]


def _trace(fn, *example):
    return torch.jit.trace(fn, example, check_trace=False)


def _normal_step(x, y):
    # What a Pyro step records: Normal(0.9 x, 1) sampled, then Normal(0, exp(x / 2)) scored at y.
    new = dist.Normal(0.9 * x, 1.0, validate_args=False).rsample()
    return new, dist.Normal(0.0, torch.exp(new / 2), validate_args=False).log_prob(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_simplified_step_draws_and_computes_the_same_with_fewer_ops(dtype):
    x, y = torch.randn(50, dtype=dtype), torch.tensor(0.3, dtype=dtype)
    traced = _trace(_normal_step, x, y)
    fast = simplified(traced)
    assert len(_ops(fast)) <= len(_ops(traced)) - 3
    assert not {"aten::broadcast_tensors", "aten::expand"} & set(_ops(fast))
    torch.manual_seed(0)
    want = traced(x, y)
    after = torch.rand(())
    torch.manual_seed(0)
    got = fast(x, y)
    assert torch.equal(torch.rand(()), after)  # the same draws consumed
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_gradients_through_a_simplified_step_are_the_traced_ones():
    x = torch.randn(20, dtype=torch.float64, requires_grad=True)
    y = torch.tensor(0.3, dtype=torch.float64)
    traced = _trace(_normal_step, x, y)
    fast = simplified(traced)
    grads = []
    for function in (traced, fast):
        torch.manual_seed(1)
        new, log_p = function(x, y)
        grads.append(torch.autograd.grad((new.sum() + log_p.sum()), x)[0])
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_a_broadcast_that_promotes_differently_keeps_its_dtype():
    # float32 times a float64 scalar broadcast to (3,) is float64; times the 0-dim scalar it would
    # be float32: that use must not get the scalar back.
    def fn(x):
        a, b = torch.broadcast_tensors(x, torch.full((), 2.0, dtype=torch.float64))
        return a * b

    x = torch.randn(3, dtype=torch.float32)
    traced = _trace(fn, x)
    fast = simplified(traced)
    out, want = fast(x), traced(x)
    assert out.dtype == want.dtype == torch.float64 and torch.equal(out, want)


def test_views_that_change_something_stay():
    def fn(x):
        return x.reshape(2, 3) * 2, x.to(torch.float64), x.to(torch.float32, copy=True), x.expand(4, 6), x.to(torch.float32)

    x = torch.randn(6, dtype=torch.float32)
    fast = simplified(_trace(fn, x))
    kinds = _ops(fast)
    assert "aten::reshape" in kinds and "aten::expand" in kinds and kinds.count("aten::to") == 2  # the third is x itself
    out = fast(x)
    assert out[2].data_ptr() != x.data_ptr()  # copy=True still copies
    assert all(torch.equal(a, b) for a, b in zip(out, fn(x)))


def test_execute_moves_to_the_static_runtime_after_checking_it_and_only_without_gradients(monkeypatch):
    monkeypatch.setattr(replay, "_STATIC_AFTER", 3)
    x, y = torch.randn(30, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    fast = simplified(_trace(_normal_step, x, y))
    executors: dict = {}
    outs = []
    for call in range(4):
        torch.manual_seed(2)
        outs.append(execute(fast, executors, (x, y)))
        after = torch.rand(())
        torch.manual_seed(2)
        fast(x, y)
        assert torch.equal(torch.rand(()), after)  # each call draws as the interpreter does
        assert ("static" in executors) == (call >= 2)  # tried at the third call, beside the interpreter
    assert isinstance(executors["static"], torch.StaticModule)
    assert all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))
    xg = x.clone().requires_grad_()
    new, _ = execute(fast, executors, (xg, y))
    assert new.requires_grad  # the interpreter, whose autograd a gradient needs


def test_a_static_runtime_that_differs_is_not_used(monkeypatch):
    monkeypatch.setattr(replay, "_STATIC_AFTER", 1)

    original = torch._C._jit_to_static_module

    class Off:
        """A static runtime whose first output is off by one."""

        def __init__(self, graph):
            self.module = original(graph)

        def __call__(self, *inputs):
            out = self.module(*inputs)
            return (out[0] + 1,) + tuple(out[1:])

    monkeypatch.setattr(torch._C, "_jit_to_static_module", Off)
    x, y = torch.randn(30, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    fast = simplified(_trace(_normal_step, x, y))
    executors: dict = {}
    torch.manual_seed(2)
    got = execute(fast, executors, (x, y))
    torch.manual_seed(2)
    want = fast(x, y)
    assert executors["static"] is False and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [5, 100])
def test_the_standard_normal_of_a_trace_becomes_randn_like_with_the_same_bits(dtype, n):
    # torch.distributions draws normal(zeros, ones) under a trace; eagerly normal_(): the same
    # generator call, which randn_like makes without the scale and shift.
    def fn(x):
        return x + torch.normal(torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)) * 2

    x = torch.randn(n, dtype=dtype)
    traced = _trace(fn, x)
    fast = simplified(traced)
    assert "aten::randn_like" in _ops(fast) and "aten::normal" not in _ops(fast)
    torch.manual_seed(5)
    want, after = traced(x), torch.rand(())
    torch.manual_seed(5)
    assert torch.equal(fast(x), want) and torch.equal(torch.rand(()), after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_integer_constants_of_float_arithmetic_become_float_constants_with_the_same_bits(dtype):
    def fn(x):
        return x / 2, x * 3 - 7, (x * 1) + 0.5

    x = torch.randn(8, dtype=dtype)
    traced, fast = _trace(fn, x), None
    fast = simplified(traced)
    assert "Long" not in str(fast.graph) and len(_ops(fast)) == len(_ops(traced)) - 1  # the * 1 gone
    for a, b in zip(fast(x), traced(x)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
