"""The first stage of the auxiliary and SQMC filters: which filters resample, and the weights and
evidence term it leaves, checked against the formulas written out by hand."""

import math

import torch

from pyro_smc.infer.smc.first_stage import resample_first, resample_qmc
from pyro_smc.infer.smc.importance import ParticleLayout
from pyro_smc.infer.smc.state import ParticleWeights, SMCState
from pyro_smc.ops.qmc import sobol_points
from pyro_smc.resamplers import MultinomialResampler, SystematicResampler

B, N = 3, 8


def _setup(seed=0):
    torch.manual_seed(seed)
    layout = ParticleLayout(num_filters=B, num_particles=N, max_plate_nesting=0)
    state = SMCState()
    state.replace({"x": torch.randn(B, N, 2)})
    log_w = torch.randn(B, N).log_softmax(-1)
    return layout, state, ParticleWeights(log_w, torch.zeros(B)), torch.randn(B, N)


def test_no_filter_below_the_threshold_keeps_everything():
    layout, state, weights, log_eta = _setup()
    before = state["x"].clone()
    out = resample_first(state, weights, log_eta, layout, SystematicResampler(), 1e-9, set(), "step")
    assert out.resampling is None and not bool(out.need.any())
    assert out.weights is weights and torch.equal(state["x"], before)


def test_resampled_weights_and_evidence_term_follow_the_formula():
    layout, state, weights, log_eta = _setup()
    x = state["x"].clone()
    out = resample_first(state, weights, log_eta, layout, MultinomialResampler(), 1.0, set(), "step")
    assert bool(out.need.all())
    a = out.resampling.ancestors  # (B, N)
    assert torch.equal(state["x"], x.gather(1, a.unsqueeze(-1).expand(B, N, 2)))
    # Second-stage weights proportional to 1 / eta(ancestor); evidence L1 + log mean(1 / eta(A)).
    inv = -log_eta.gather(1, a)
    assert torch.allclose(out.weights.log_weights, inv.log_softmax(-1))
    l1 = torch.logsumexp(weights.log_weights + log_eta, -1)
    expected = l1 + torch.logsumexp(inv, -1) - math.log(N)
    assert torch.allclose(out.weights.unreported, expected)
    assert torch.allclose(out.weights.log_evidence, expected)


def test_without_a_look_ahead_the_resampled_weights_are_equal_and_nothing_is_gained():
    layout, state, weights, _ = _setup()
    out = resample_first(state, weights, None, layout, SystematicResampler(), 1.0, set(), "step")
    assert torch.allclose(out.weights.log_weights, torch.full((B, N), -math.log(N)))
    assert out.weights.unreported is None


def test_only_the_filters_below_the_threshold_resample():
    layout, state, weights, log_eta = _setup()
    log_w = weights.log_weights.clone()
    log_w[1] = torch.full((N,), -math.log(N))  # filter 1: equal weights
    log_eta[1] = 0.0  # and a flat look-ahead: ESS = N
    weights = weights._replace(log_weights=log_w)
    x = state["x"].clone()
    out = resample_first(state, weights, log_eta, layout, SystematicResampler(), 0.99, set(), "step")
    assert out.need.tolist() == [True, False, True]
    assert torch.equal(state["x"][1], x[1]) and torch.equal(out.weights.log_weights[1], log_w[1])
    assert float(out.weights.unreported[1]) == 0.0


def test_inactive_filters_gain_exactly_zero():
    layout, state, weights, log_eta = _setup()
    log_eta[0] = 0.0
    active = torch.tensor([False, True, True])
    out = resample_first(state, weights, log_eta, layout, SystematicResampler(), 1.0, set(), "step", active=active)
    assert float(out.weights.unreported[0]) == 0.0


def test_qmc_stage_resamples_every_filter_by_the_same_formula():
    layout, state, weights, log_eta = _setup()
    x = state["x"].clone()
    points = sobol_points(N, 3, B, weights.log_weights)
    out = resample_qmc(state, weights, log_eta, layout, points, stop_gradient=False)
    a = out.resampling.ancestors
    assert bool(out.need.all()) and out.moves.shape == (B, N, 2)
    assert torch.equal(state["x"], x.gather(1, a.unsqueeze(-1).expand(B, N, 2)))
    inv = -log_eta.gather(1, a)
    assert torch.allclose(out.weights.log_weights, inv.log_softmax(-1))
    l1 = torch.logsumexp(weights.log_weights + log_eta, -1)
    assert torch.allclose(out.weights.unreported, l1 + torch.logsumexp(inv, -1) - math.log(N))


def test_stop_gradient_stage_keeps_the_ancestors_weight_gradient():
    layout, state, weights, log_eta = _setup()
    log_w = weights.log_weights.clone().requires_grad_()
    points = sobol_points(N, 3, B, log_w)
    out = resample_qmc(state, weights._replace(log_weights=log_w), None, layout, points, stop_gradient=True)
    assert torch.allclose(out.weights.log_weights, torch.full((B, N), -math.log(N)))
    grad = torch.autograd.grad(out.weights.log_weights.sum(), log_w)[0]
    counts = torch.nn.functional.one_hot(out.resampling.ancestors, N).sum(1)
    assert torch.equal(grad, counts.to(grad.dtype))
