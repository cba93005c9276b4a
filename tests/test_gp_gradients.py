"""Gradients of ``MultiOutputGP`` predictions with respect to its hyperparameters and data.

The posterior is built with its autograd graph when gradients are enabled and one of its inputs
(the constrained ``lengthscale``, ``variance``, ``noise``, or ``X``, ``Y``) requires grad; it is
cached only without a graph; ``pinned_posterior`` shares one posterior between many predictions;
and the log-evidence of the GP-ADF filter / GP-RTSS smoother is differentiable in the
hyperparameters (checked against central finite differences).
"""

from __future__ import annotations

import pytest
import torch
from pyro.nn import PyroParam
from torch import nn
from torch.func import functional_call

from pyro_smc.gp import MultiOutputGP, pinned_posteriors
from pyro_smc.infer import gp_adf, gp_rtss
from pyro_smc.models import NonlinearGaussianSSM

SEEDS = [0, 1, 2]
HYPER = ("lengthscale_unconstrained", "variance_unconstrained", "noise_unconstrained")
F64 = torch.float64


def _gp(seed: int, n: int = 12, D: int = 2, E: int = 2) -> MultiOutputGP:
    g = torch.Generator().manual_seed(seed)
    X = 2 * torch.rand(n, D, generator=g, dtype=F64) - 1
    Y = torch.stack([X.sin().sum(-1) * (a + 1) for a in range(E)], -1) + 0.05 * torch.randn(n, E, generator=g, dtype=F64)
    lengthscale = 0.6 + torch.rand(E, D, generator=g, dtype=F64)
    variance = 0.5 + torch.rand(E, generator=g, dtype=F64)
    noise = 0.05 + 0.1 * torch.rand(E, generator=g, dtype=F64)
    return MultiOutputGP(X, Y, lengthscale=lengthscale, variance=variance, noise=noise)


def _gaussian_input(seed: int, D: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    A = 0.4 * torch.randn(D, D, generator=g, dtype=F64)
    return 0.3 * torch.randn(D, generator=g, dtype=F64), A @ A.T + 0.05 * torch.eye(D, dtype=F64)


class _Call(nn.Module):
    """Calls a method of the GP, so that ``functional_call`` can substitute its parameters and buffers."""

    def __init__(self, gp: MultiOutputGP):
        super().__init__()
        self.gp = gp

    def forward(self, method: str, *args, **kwargs):
        return getattr(self.gp, method)(*args, **kwargs)


def _method_args(method: str, seed: int) -> tuple:
    mean, cov = _gaussian_input(seed)
    if method == "predict_moments":
        return (mean, cov)
    g = torch.Generator().manual_seed(200 + seed)
    return (torch.randn(3, 2, generator=g, dtype=F64),)


# -------------------------------------------------------------------------------------------------
# gradcheck of the predictions
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["predict", "linearize", "predict_moments"])
def test_predictions_gradcheck_in_unconstrained_hyperparameters(method, seed):
    gp = _gp(seed)
    call = _Call(gp)
    args = _method_args(method, seed)
    names = [f"gp.{name}" for name in HYPER]
    values = tuple(getattr(gp, name).detach().clone().requires_grad_() for name in HYPER)

    def f(*params):
        return functional_call(call, dict(zip(names, params)), (method, *args), {"noisy": True})

    assert torch.autograd.gradcheck(f, values)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["predict", "linearize", "predict_moments"])
def test_predictions_gradcheck_in_X_and_Y(method, seed):
    gp = _gp(seed, n=8)
    call = _Call(gp)
    args = _method_args(method, seed)
    # X and Y made parameters, as a user fitting inducing inputs and targets would.
    gp.X = nn.Parameter(gp.X.clone())
    gp.Y = nn.Parameter(gp.Y.clone())
    values = (gp.X.detach().clone().requires_grad_(), gp.Y.detach().clone().requires_grad_())

    def f(X, Y):
        return functional_call(call, {"gp.X": X, "gp.Y": Y}, (method, *args))

    assert torch.autograd.gradcheck(f, values)


def test_gradients_reach_parameters_X_and_Y_and_every_hyperparameter():
    gp = _gp(0)
    gp.X = nn.Parameter(gp.X.clone())
    gp.Y = PyroParam(gp.Y.clone())  # unconstrained: Y_unconstrained is the parameter
    mean, cov = _gaussian_input(0)
    M, V, C = gp.predict_moments(mean, cov)
    (M.sum() + V.sum() + C.sum()).backward()
    grads = {name: p.grad for name, p in gp.named_parameters()}
    assert set(grads) == {*HYPER, "X", "Y_unconstrained"}
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name


def test_each_call_outside_a_pin_has_its_own_graph():
    # Nothing is cached with a graph: two backward passes through two predictions both work.
    gp = _gp(1)
    x = torch.zeros(1, 2, dtype=F64)
    gp.predict(x)[0].sum().backward()
    first = gp.lengthscale_unconstrained.grad.clone()
    gp.predict(x)[0].sum().backward()
    torch.testing.assert_close(gp.lengthscale_unconstrained.grad, 2 * first)
    assert gp._cache is None


# -------------------------------------------------------------------------------------------------
# pinned_posterior, pinned_posteriors, the no-grad cache
# -------------------------------------------------------------------------------------------------
def _count_choleskies(gp: MultiOutputGP, monkeypatch) -> list[int]:
    calls = [0]
    original = gp._gram_cholesky

    def counting(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(gp, "_gram_cholesky", counting)
    return calls


def _all_predictions(gp: MultiOutputGP, seed: int) -> list[torch.Tensor]:
    mean, cov = _gaussian_input(seed)
    x = _method_args("predict", seed)[0]
    out = [*gp.predict(x), *gp.predict(x, noisy=True), *gp.linearize(x), *gp.predict_moments(mean, cov)]
    return out + [*gp.predict_moments(mean + 0.1, cov, noisy=True)]


@pytest.mark.parametrize("seed", SEEDS)
def test_pinned_posterior_computes_the_cholesky_once(seed, monkeypatch):
    gp = _gp(seed)
    calls = _count_choleskies(gp, monkeypatch)
    unpinned = _all_predictions(gp, seed)
    assert calls[0] == 5  # one per call: with the graph nothing is cached
    calls[0] = 0
    with gp.pinned_posterior() as pinned:
        assert pinned is gp
        with gp.pinned_posterior():  # re-entrant: reuses the outer pin
            inner = _all_predictions(gp, seed)
        assert gp._pinned is not None  # the inner exit did not drop the outer pin
        outer = _all_predictions(gp, seed)
    assert calls[0] == 1
    assert gp._pinned is None
    for a, b, c in zip(unpinned, inner, outer):
        assert torch.equal(a, b) and torch.equal(a, c)
    # One graph shared by all pinned predictions: one backward reaches every hyperparameter.
    sum(t.sum() for t in outer).backward()
    assert all(getattr(gp, name).grad.abs().sum() > 0 for name in HYPER)
    _all_predictions(gp, seed)  # dropped on exit: computed again
    assert calls[0] == 6  # one more pass of 5 unpinned calls


def test_pinned_posterior_is_dropped_on_an_exception(monkeypatch):
    gp = _gp(0)
    calls = _count_choleskies(gp, monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), gp.pinned_posterior():
        raise RuntimeError("boom")
    assert gp._pinned is None and calls[0] == 1


def test_pinned_posteriors_pins_the_gps_and_skips_the_rest(monkeypatch):
    gp_a, gp_b = _gp(0), _gp(1)
    calls_a, calls_b = _count_choleskies(gp_a, monkeypatch), _count_choleskies(gp_b, monkeypatch)

    class DuckGP:  # a GP posterior by duck typing, without a pinned_posterior method
        def predict(self, x):
            return x, x

        predict_moments = linearize = predict

    with pinned_posteriors(gp_a, torch.sin, None, DuckGP(), gp_b, gp_a):
        for _ in range(3):
            _all_predictions(gp_a, 0)
            _all_predictions(gp_b, 1)
    assert calls_a[0] == calls_b[0] == 1
    assert gp_a._pinned is None and gp_b._pinned is None
    with pinned_posteriors(torch.cos, lambda x: x):  # nothing to pin
        pass
    container = torch.nn.ModuleDict({"f": gp_a, "g": torch.nn.Linear(1, 1)})  # a model holding a GP
    with pinned_posteriors(container):
        for _ in range(3):
            _all_predictions(gp_a, 0)
        assert gp_a._pinned is not None
    assert calls_a[0] == 2 and gp_a._pinned is None


@pytest.mark.parametrize("seed", SEEDS)
def test_no_grad_predictions_carry_no_graph_and_use_the_cache(seed, monkeypatch):
    gp = _gp(seed)
    calls = _count_choleskies(gp, monkeypatch)
    with torch.no_grad():
        first = _all_predictions(gp, seed)
        assert calls[0] == 1
        second = _all_predictions(gp, seed)
        assert calls[0] == 1  # the second pass hits the cache
        post = gp._posterior()
        assert gp._cache is not None and gp._cache[1] is post
    assert not any(t.requires_grad for t in first + second)
    assert not any(t.requires_grad for t in post)
    # Nothing requires grad (frozen hyperparameters): no graph, and cached even with grad enabled.
    for p in gp.parameters():
        p.requires_grad_(False)
    third = _all_predictions(gp, seed)
    assert calls[0] == 1 and not any(t.requires_grad for t in third)
    for a, b in zip(first, third):
        assert torch.equal(a, b)
    # A pin taken under no_grad holds the cached posterior.
    with torch.no_grad(), gp.pinned_posterior():
        assert gp._posterior() is post


# -------------------------------------------------------------------------------------------------
# The GP-ADF / GP-RTSS log-evidence is differentiable in the hyperparameters
# -------------------------------------------------------------------------------------------------
def _gp_ssm(seed: int, T: int = 10) -> tuple[NonlinearGaussianSSM, torch.Tensor]:
    """A 1-D GP dynamical model (20 training points) with a GP observation map to 2-D, and T
    observations simulated from the true functions."""
    g = torch.Generator().manual_seed(seed)

    def f(x):
        return 0.8 * x + 0.6 * torch.sin(2 * x)

    def h(x):
        return torch.cat([x, torch.cos(x)], -1)

    X = torch.linspace(-3, 3, 20, dtype=F64).unsqueeze(-1)
    gp_f = MultiOutputGP(X, f(X) + 0.05 * torch.randn(20, 1, generator=g, dtype=F64), lengthscale=1.0, variance=1.5, noise=0.01)
    gp_h = MultiOutputGP(X, h(X) + 0.05 * torch.randn(20, 2, generator=g, dtype=F64), lengthscale=[[1.2], [0.8]], variance=1.0, noise=0.02)
    Q, R = 0.05 * torch.eye(1, dtype=F64), 0.1 * torch.eye(2, dtype=F64)
    x = 0.5 * torch.randn(1, generator=g, dtype=F64)
    ys = []
    for _ in range(T):
        ys.append(h(x) + R.diagonal().sqrt() * torch.randn(2, generator=g, dtype=F64))
        x = f(x) + Q.diagonal().sqrt() * torch.randn(1, generator=g, dtype=F64)
    ssm = NonlinearGaussianSSM(gp_f, Q, gp_h, R, torch.zeros(1, dtype=F64), torch.eye(1, dtype=F64))
    return ssm, torch.stack(ys)


def _hyperparameters(ssm: NonlinearGaussianSSM) -> list[torch.Tensor]:
    return [getattr(gp, name) for gp in (ssm.transition, ssm.observation) for name in HYPER]


def _evidence_gradient(engine, ssm, ys) -> list[torch.Tensor]:
    """d log_evidence / d (unconstrained hyperparameters); zero where no gradient flows."""
    params = _hyperparameters(ssm)
    log_evidence = engine(ssm, ys).log_evidence
    if not log_evidence.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(log_evidence, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", [gp_adf, gp_rtss], ids=["gp_adf", "gp_rtss"])
def test_log_evidence_gradient_matches_central_finite_differences(engine, seed):
    ssm, ys = _gp_ssm(seed)
    grads = _evidence_gradient(engine, ssm, ys)
    step = 1e-5
    with torch.no_grad():
        for param, grad in zip(_hyperparameters(ssm), grads):
            fd = torch.zeros_like(param)
            for i in range(param.numel()):
                flat = param.view(-1)
                value = flat[i].item()
                flat[i] = value + step
                up = engine(ssm, ys).log_evidence
                flat[i] = value - step
                down = engine(ssm, ys).log_evidence
                flat[i] = value
                fd.view(-1)[i] = (up - down) / (2 * step)
            torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-6 * max(1.0, fd.abs().max().item()))


@pytest.mark.parametrize("seed", SEEDS)
def test_log_evidence_gradient_is_not_zero(seed, monkeypatch):
    # The old detached posterior gave log_evidence no dependence on the hyperparameters: a zero
    # (or missing) gradient. Every hyperparameter of both GPs must get a gradient here.
    ssm, ys = _gp_ssm(seed)
    calls = [_count_choleskies(gp, monkeypatch) for gp in (ssm.transition, ssm.observation)]
    grads = _evidence_gradient(gp_rtss, ssm, ys)
    assert [c[0] for c in calls] == [1, 1]  # one posterior per GP for the whole pass (pinned)
    assert ssm.transition._pinned is None and ssm.observation._pinned is None
    for name, grad in zip([f"{gp}.{h}" for gp in ("transition", "observation") for h in HYPER], grads):
        assert torch.isfinite(grad).all() and grad.abs().min() > 1e-8, (name, grad)
