"""NeuralSSM and NeuralProposal: the equations, the untrained model against Kalman, learning with SMCELBO.

See ``docs/math/smc.md#a-neural-state-space-model``.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_smc import SMC, SMCELBO
from pyro_smc.models import LinearGaussianSSM, LocallyOptimalProposal, NeuralProposal, NeuralSSM
from pyro_smc.tracing import module_context
from tests.tolerances import MC_SIGMAS

torch.set_num_threads(1)


def _traced_step(program, state, y, t, x=None):
    program.init({})
    program._t = t
    fn = program.step if x is None else poutine.condition(program.step, data={f"x_{t}": x})
    with module_context(program):
        return poutine.trace(fn).get_trace(state, y)


def test_step_log_density_matches_the_equations():
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = NeuralSSM(2, obs_dim=3, hidden_dim=8)
    for p in model.transition_net.parameters():
        p.data.normal_()  # a non-zero network
    x_prev, x, y = torch.randn(2), torch.randn(2), torch.randn(3)
    trace = _traced_step(model, {"x": x_prev}, y, 4, x)
    net = model.transition_net
    hidden = torch.tanh(net[2](torch.tanh(net[0](x_prev))))
    mean = x_prev + net[4](hidden)
    log_f = dist.Normal(mean, 0.5).log_prob(x).sum()
    log_g = dist.Normal(x @ model.emission_weight.T + model.emission_bias, 0.5).log_prob(y).sum()
    torch.testing.assert_close(trace.log_prob_sum(), log_f + log_g)
    first = _traced_step(model, {}, y, 0, x)
    torch.testing.assert_close(first.nodes["x_0"]["fn"].log_prob(x), dist.Normal(0.0, 1.0).log_prob(x).sum())


def test_proposal_reads_the_previous_state_and_the_observation():
    pyro.clear_param_store()
    torch.manual_seed(1)
    model = NeuralSSM(2, obs_dim=3)
    guide = NeuralProposal(model, proposal_scale=0.3)
    x_prev, y = torch.randn(5, 2), torch.randn(3)
    fn = _traced_step(guide, {"x": x_prev}, y, 2).nodes["x_2"]["fn"].base_dist
    torch.testing.assert_close(fn.loc, x_prev)  # untrained: a random walk
    torch.testing.assert_close(fn.scale, torch.full((5, 2), 0.3 + 1e-4))
    for p in guide.proposal_net.parameters():
        p.data.normal_()
    a = _traced_step(guide, {"x": x_prev}, y, 2).nodes["x_2"]["fn"].base_dist.loc
    b = _traced_step(guide, {"x": x_prev}, y + 1, 2).nodes["x_2"]["fn"].base_dist.loc
    assert not torch.allclose(a, b)


def test_the_untrained_model_is_a_random_walk_with_kalman_evidence():
    """An untrained network outputs exactly 0, so the model is linear-Gaussian: SMC with the
    untrained proposal estimates the Kalman evidence without bias (MC_SIGMAS standard errors)."""
    pyro.clear_param_store()
    torch.manual_seed(2)
    model = NeuralSSM(2, obs_dim=3, init_scale=0.8, transition_scale=0.3, observation_scale=0.4)
    W, b = model.emission_weight.detach(), torch.tensor([0.5, -0.5, 1.0])
    model.emission_bias.data = b.clone()
    xs, ys = model.simulate(15, generator=torch.Generator().manual_seed(3))
    eye = torch.eye(2)
    kalman = LinearGaussianSSM(eye, 0.09 * eye, W, 0.16 * torch.eye(3), torch.zeros(2), 0.64 * eye)
    exact = kalman.log_evidence(ys - b)
    pyro.set_rng_seed(4)
    with torch.no_grad():
        smc = SMC(model, NeuralProposal(model, proposal_scale=0.4), num_particles=200, num_filters=400).run(ys)
    ratio = (smc.log_evidence - exact).exp()
    assert abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(ratio.numel())


def test_gradients_reach_every_parameter_on_a_padded_batch():
    pyro.clear_param_store()
    torch.manual_seed(5)
    model = NeuralSSM(2, obs_dim=3, hidden_dim=8)
    guide = NeuralProposal(model, hidden_dim=8)
    ys = torch.stack([model.simulate(6)[1] for _ in range(3)])
    with poutine.trace(param_only=True) as capture:
        SMCELBO(num_particles=10, num_sequences=30).loss_and_grads(model, guide, ys, lengths=torch.tensor([6, 4, 2]), batched=True)
    params = {name: site["value"] for name, site in capture.trace.nodes.items()}
    assert {"transition_net.0.weight", "proposal_net.0.weight"} <= set(params), sorted(params)
    # The last layers start at zero, so at the start only they (not the layers below) move.
    expected = {"transition_net.4.weight", "transition_net.4.bias", "transition_scale", "observation_scale", "emission_weight",
                "emission_bias", "proposal_net.4.weight", "proposal_net.4.bias"}
    assert expected <= set(params), sorted(params)
    for name in expected:
        grad = pyro.param(name).unconstrained().grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and bool((grad != 0).any()), name


def test_svi_learns_the_noise_scales_and_a_proposal():
    """From q = r = 0.5 the ELBO drives the scales towards the data's (q = 0.1, r = 0.2) and the
    proposal's spread towards the posterior's, on a data set of sequences in minibatches."""
    pyro.clear_param_store()
    torch.manual_seed(6)
    truth = NeuralSSM(2, emission="identity", transition_scale=0.1, observation_scale=0.2)
    generator = torch.Generator().manual_seed(7)
    data = torch.stack([truth.simulate(20, generator=generator)[1] for _ in range(40)])
    pyro.clear_param_store()
    pyro.set_rng_seed(8)
    model = NeuralSSM(2, emission="identity", hidden_dim=8)
    guide = NeuralProposal(model, hidden_dim=8)
    svi = SVI(model, guide, Adam({"lr": 0.02}), SMCELBO(num_particles=20, num_sequences=40))
    before = svi.evaluate_loss(data, batched=True)
    for _ in range(150):
        idx = torch.randperm(40)[:8]
        svi.step(data[idx], batched=True)
    after = svi.evaluate_loss(data, batched=True)
    q, r = model.transition_scale.detach(), model.observation_scale.detach()
    assert after < before - 40 * 20 * 0.5, (before, after)  # over half a nat per observation
    assert bool((q < 0.25).all()) and bool(((r - 0.2).abs() < 0.08).all()), (q, r)
    # The one-step posterior sd is (1 / 0.1^2 + 1 / 0.2^2)^(-1/2) = 0.09; the proposal started at 0.5.
    with torch.no_grad():
        spread = _traced_step(guide, {"x": data[:, 0]}, data[:, 1], 1).nodes["x_1"]["fn"].base_dist.scale
    assert float(spread.mean()) < 0.3, spread.mean()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"state_dim": 0}, "state_dim"),
        ({"state_dim": 2, "obs_dim": 3, "emission": "identity"}, "obs_dim == state_dim"),
        ({"state_dim": 2, "emission": "cubic"}, "emission"),
        ({"state_dim": 2, "transition_scale": 0.0}, "transition_scale"),
        ({"state_dim": 2, "hidden_dim": 1.5}, "hidden_dim"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NeuralSSM(**kwargs)


def test_wrong_observation_size_names_the_step():
    model = NeuralSSM(2, obs_dim=3)
    with pytest.raises(ValueError, match="y_0"):
        SMC(model, num_particles=5).run(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="proposal_scale"):
        NeuralProposal(model, proposal_scale=-1.0)


def test_locally_optimal_proposal_is_fully_adapted():
    """Its weight increment is p(y_t | x_{t-1}) whatever x_t is drawn: after the first step every
    weight is equal and log Z_hat is exactly log N(y_0; b, s_0^2 W W^T + R). Over the whole
    sequence (the network is zero, so the model is linear-Gaussian) Z_hat is unbiased for the
    Kalman evidence, with far less spread than with the random-walk proposal."""
    pyro.clear_param_store()
    torch.manual_seed(9)
    model = NeuralSSM(2, obs_dim=3, init_scale=0.8, transition_scale=0.3, observation_scale=0.4)
    model.emission_bias.data = torch.tensor([0.5, -0.5, 1.0])
    _, ys = model.simulate(12, generator=torch.Generator().manual_seed(10))
    W, b = model.emission_weight.detach(), model.emission_bias.detach()
    with torch.no_grad():
        first = SMC(model, LocallyOptimalProposal(model), num_particles=50).run(ys[:1])
    assert float(first.ess_history[0, 0]) == pytest.approx(50)
    exact_first = dist.MultivariateNormal(b, 0.64 * W @ W.T + 0.16 * torch.eye(3)).log_prob(ys[0])
    torch.testing.assert_close(first.log_evidence[0], exact_first, rtol=1e-5, atol=1e-5)

    eye = torch.eye(2)
    exact = LinearGaussianSSM(eye, 0.09 * eye, W, 0.16 * torch.eye(3), torch.zeros(2), 0.64 * eye).log_evidence(ys - b)
    spreads = []
    for guide in (LocallyOptimalProposal(model), NeuralProposal(model, proposal_scale=0.4)):
        pyro.set_rng_seed(11)
        with torch.no_grad():
            log_z = SMC(model, guide, num_particles=50, num_filters=400).run(ys).log_evidence
        ratio = (log_z - exact).exp()
        assert abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(ratio.numel())
        spreads.append(float(log_z.std()))
    assert spreads[0] < 0.5 * spreads[1], spreads


def test_locally_optimal_proposal_with_the_identity_emission_and_a_network():
    """With a non-zero network the fully adapted weights of step t are p(y_t | x_{t-1}) =
    N(y_t; mu(x_{t-1}), q^2 + r^2): checked particle by particle against the filter's weights."""
    pyro.clear_param_store()
    torch.manual_seed(12)
    model = NeuralSSM(2, emission="identity", hidden_dim=8, transition_scale=0.3, observation_scale=0.2)
    for p in model.transition_net.parameters():
        p.data.normal_(0, 0.5)
    _, ys = model.simulate(2, generator=torch.Generator().manual_seed(13))
    smc = SMC(model, LocallyOptimalProposal(model), num_particles=20, ess_threshold=1e-9)
    with torch.no_grad():
        smc.init()
        smc.step(ys[0])
        x_prev, log_w_prev = smc.state["x"].clone(), smc.log_weights.clone()
        smc.step(ys[1])
        mu = model.transition_mean(x_prev)
        log_pred = dist.Normal(mu, (0.09 + 0.04) ** 0.5).log_prob(ys[1]).sum(-1)
    expected = torch.log_softmax(log_w_prev[0] + log_pred, -1)
    torch.testing.assert_close(smc.log_weights[0], expected, rtol=1e-4, atol=1e-4)
