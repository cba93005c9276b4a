import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_smc import SMCELBO
from pyro_smc.resamplers import OTResampler, SystematicResampler
from tests.infer.paper_model import DiagLinearGaussian, simulate


class ShiftedProposal:
    """q(x_t | x_{t-1}, y_t) = N(theta x_{t-1} + phi * (y_t - theta x_{t-1}), sigma)."""

    def __init__(self, model):
        self.model = model

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        phi = pyro.param("phi", torch.tensor(0.3))
        sigma = pyro.param("sigma", torch.tensor(0.8), constraint=dist.constraints.positive)
        prior_mean = self.model.theta * state["x"] if self.t else torch.zeros(2)
        pyro.sample(f"x_{self.t}", dist.Normal(prior_mean + phi * (y - prior_mean), sigma).to_event(1))
        self.t += 1


@pytest.mark.parametrize("resampler", [OTResampler(0.5), SystematicResampler()], ids=["ot", "systematic"])
def test_gradients_reach_model_and_proposal_parameters(resampler):
    _, ys = simulate([0.5, 0.5], 20, seed=0)
    model = DiagLinearGaussian([0.4, 0.6])
    guide = ShiftedProposal(model)
    elbo = SMCELBO(num_particles=30, num_filters=2, resampler=resampler)
    with pyro.poutine.trace(param_only=True) as capture:
        loss = elbo.loss_and_grads(model, guide, ys)
    params = {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}
    assert set(params) == {"theta", "phi", "sigma"}
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).all(), name
    assert isinstance(loss, float) and loss == pytest.approx(-elbo.smc.log_evidence.mean().item())


def test_svi_learns_the_proposal():
    # The locally optimal proposal for y = x + N(0, 0.1) with x | x_prev ~ N(., 1) has
    # phi = 1 / (1 + 0.1) ~ 0.91 and sigma = sqrt(0.1 / 1.1) ~ 0.30; SVI moves toward it.
    _, ys = simulate([0.5, 0.5], 30, seed=1)
    model = DiagLinearGaussian([0.5, 0.5], learnable=False)
    guide = ShiftedProposal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss=SMCELBO(num_particles=20, num_filters=4, resampler=OTResampler(0.5)))
    for _ in range(40):
        svi.step(ys)
    assert pyro.param("phi").item() > 0.6
    assert pyro.param("sigma").item() < 0.6


def test_loss_and_differentiable_loss_agree_in_distribution():
    _, ys = simulate([0.5, 0.5], 10, seed=2)
    model = DiagLinearGaussian([0.5, 0.5])
    elbo = SMCELBO(num_particles=50, num_filters=4)
    pyro.set_rng_seed(3)
    a = elbo.loss(model, None, ys)
    pyro.set_rng_seed(3)
    b = elbo.differentiable_loss(model, None, ys)
    assert b.requires_grad and a == pytest.approx(b.item())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_particles"):
        SMCELBO(num_particles=0)
    with pytest.raises(ValueError, match="ess_threshold"):
        SMCELBO(num_particles=10, ess_threshold=2.0)


def test_compile_switch_and_the_kept_recording_across_svi_steps():
    """SMCELBO builds an SMC per loss; with the default the first records, the later ones reuse
    the recording (verified at their first regular step); compile=False gives the same losses."""
    from pyro.nn import PyroModule, PyroParam

    class AR(PyroModule):
        def __init__(self):
            super().__init__()
            self.theta = PyroParam(torch.tensor(0.3))

        def init(self, state):
            state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

        def step(self, state, y):
            state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
            pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)

    ys = torch.linspace(-1.0, 1.0, 12).sin()
    losses, runs = {}, {}
    for compile in (None, False):
        pyro.clear_param_store()
        torch.manual_seed(0)
        elbo = SMCELBO(num_particles=30, num_filters=2, compile=compile)
        svi = SVI(AR(), None, pyro.optim.Adam({"lr": 0.05}), elbo)
        losses[compile] = [svi.step(ys) for _ in range(3)]
        runs[compile] = elbo.smc
    # The third run: step 0 on the handlers (its particles, from the prior, need no grad yet,
    # unlike the recorded step's), step 1 verified, the rest replayed.
    assert runs[None].compile_status is None and runs[None]._compiled.compiled_steps == len(ys) - 2
    assert runs[False].compile_status == "compile=False"
    assert losses[None] == pytest.approx(losses[False], rel=1e-12)


class _Learned:
    def __init__(self):
        self.t = 0

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        rho = pyro.param("rho", torch.tensor(0.3))
        loc = rho * state["x"] if "x" in state else torch.zeros(())
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.5), obs=y)
        self.t += 1


def test_the_default_resamplers_biased_gradient_is_reported_once():
    """The default (systematic, gradient='detach') drops resampling from the gradient: SVI then
    settles near, not at, the MLE (0.630 against 0.567 on an AR(1) model), silently before. It
    says so once per loss object; a resampler passed explicitly is the user's choice."""
    import warnings

    from pyro_smc.resamplers import SystematicResampler

    pyro.clear_param_store()
    ys = torch.randn(6)
    elbo = SMCELBO(num_particles=10)
    with pytest.warns(UserWarning, match="biased.*maximum-likelihood"):
        elbo.differentiable_loss(_Learned(), None, ys)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SMCELBO's default resampler")
        elbo.differentiable_loss(_Learned(), None, ys)  # once only
        SMCELBO(num_particles=10, resampler=SystematicResampler()).differentiable_loss(_Learned(), None, ys)
        with torch.no_grad():
            SMCELBO(num_particles=10).differentiable_loss(_Learned(), None, ys)  # no gradient: nothing to say
