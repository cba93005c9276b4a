"""StreamingFilterGuide as an offline Pyro guide: exact at the RTS smoother, and SVI finds it."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.util import torch_item

from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.models import LinearGaussianSSM


def _ssm():
    g = torch.Generator().manual_seed(0)
    d = 2
    A = torch.tensor([[0.9, 0.1], [-0.2, 0.8]], dtype=torch.float64)
    C = torch.randn(1, d, generator=g, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    return LinearGaussianSSM(A, 0.3 * eye, C, 0.2 * torch.eye(1, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), eye)


def _trajectory_model(ssm):
    def model(ys):
        state = {}
        ssm.init(state)
        for y in ys:
            ssm.step(state, y)

    return model


def _set_exact_smoother(guide, ssm, ys):
    """The exact posterior factorises backward: p(x_T | y) prod_k p(x_k | x_{k+1}, y_{1:k})."""
    kf = ssm.kalman_filter(ys)
    guide.set_marginal(kf.means[-1], kf.covariances[-1])
    for k in range(len(ys) - 1):
        pred = kf.predicted_covariances[k + 1]
        gain = kf.covariances[k] @ ssm.A.T @ torch.linalg.inv(pred)
        guide.set_kernel(gain, kf.means[k] - gain @ ssm.A @ kf.means[k], kf.covariances[k] - gain @ pred @ gain.T, index=k)


def test_exact_kernels_give_the_log_evidence_for_every_sample():
    ssm = _ssm()
    _, ys = ssm.simulate(5, generator=torch.Generator().manual_seed(1))
    model = _trajectory_model(ssm)
    guide = StreamingFilterGuide(2, model, num_steps=5, covariance="full").double()
    _set_exact_smoother(guide, ssm, ys)
    exact = float(ssm.log_evidence(ys))
    for _ in range(5):
        guide_trace = poutine.trace(guide).get_trace(ys)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(ys)
        assert abs(torch_item(model_trace.log_prob_sum() - guide_trace.log_prob_sum()) - exact) < 1e-9
    means, covs = guide.marginals()
    rts = ssm.rts_smoother(ys)
    torch.testing.assert_close(means, rts.means)
    torch.testing.assert_close(covs, rts.covariances)


def test_svi_recovers_the_rts_smoother():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    ssm = _ssm()
    _, ys = ssm.simulate(4, generator=torch.Generator().manual_seed(2))
    model = _trajectory_model(ssm)
    guide = StreamingFilterGuide(2, model, covariance="full", init_scale=0.5).double()
    # 16 samples per step, drawn in one vectorised pass: as close after 250 steps as 4 samples
    # after 600 (largest |mean - RTS| / sd over seeds 0-3: 0.107 against 0.086; largest
    # |log variance ratio|: 0.113 against 0.117) at a seventh of the time.
    elbo = Trace_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=0)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.99}), elbo)
    for _ in range(250):
        svi.step(ys)
    assert guide.num_steps == 4  # discovered by tracing the model
    means, covs = guide.marginals()
    rts = ssm.rts_smoother(ys)
    sd = rts.covariances.diagonal(dim1=-2, dim2=-1).sqrt()
    # Converged up to the optimiser's Monte Carlo noise: a small fraction of a posterior sd.
    assert ((means.detach() - rts.means).abs() < 0.15 * sd).all()
    assert ((covs.diagonal(dim1=-2, dim2=-1).detach() / sd.square()).log().abs() < 0.2).all()


def test_guide_errors():
    with pytest.raises(ValueError, match="covariance"):
        StreamingFilterGuide(2, covariance="dense")
    with pytest.raises(ValueError, match="backward"):
        StreamingFilterGuide(2, backward="gru")
    with pytest.raises(ValueError, match="state_dim"):
        StreamingFilterGuide(0)
    ssm = _ssm()
    ys = torch.zeros(3, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_steps=5 but the model has 3"):
        StreamingFilterGuide(2, _trajectory_model(ssm), num_steps=5).double()(ys)
    with pytest.raises(ValueError, match="shape"):
        StreamingFilterGuide(3, _trajectory_model(ssm)).double()(ys)
    with pytest.raises(ValueError, match="whole-trajectory model"):
        StreamingFilterGuide(2).double()(ys)


def test_mlp_kernel_starts_linear_and_samples():
    guide = StreamingFilterGuide(3, backward="mlp", hidden_dims=(8, 8))
    x = torch.randn(5, 3)
    d = guide.backward_distribution(x)
    assert d.batch_shape == (5,) and d.event_shape == (3,)
    torch.testing.assert_close(d.mean, torch.zeros(5, 3))
    with pytest.raises(NotImplementedError):
        guide.joint_distribution()


def test_the_two_roles_share_one_family():
    from pyro_smc.guides import StreamingFamily

    online = StreamingFilterGuide(2, covariance="full").double()
    assert isinstance(online, StreamingFamily) and online.online and online.num_kernels == 1
    ssm = _ssm()
    _, ys = ssm.simulate(4, generator=torch.Generator().manual_seed(3))
    offline = StreamingFilterGuide(2, _trajectory_model(ssm), covariance="full").double()
    assert offline.online
    offline(ys)  # the first call as a Pyro guide sizes the kernels from the model's trace
    assert not offline.online and offline.num_steps == 4 and offline.num_kernels == 3
    # The family alone is the per-step role: the same parameters, no Pyro-guide forward.
    family = StreamingFamily(2, covariance="full").double()
    assert [n for n, _ in family.named_parameters()] == [n for n, _ in online.named_parameters()]
    family.load_state_dict(online.state_dict())
    torch.testing.assert_close(family.filtering_distribution().mean, online.filtering_distribution().mean)
    with pytest.raises(ValueError, match="num_kernels"):
        StreamingFamily(2, num_kernels=-1)
