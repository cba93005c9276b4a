"""The docs pages' claims about what is saved, what is differentiable and what is approximate, where
no other test checks them: one test per claim, each quoting its page.

Every claim of these kinds on ``docs/engines/*.md``, ``docs/ecosystem.md``, ``docs/advice.md``,
``docs/design.md``, ``docs/getting_started.md`` and ``README.md`` that has no test elsewhere is
checked here. Monte Carlo checks use fixed seeds and a bound of five standard errors; exact checks
compare with the Kalman filter / RTS smoother in float64.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC, EPSmoother, OnlineVariationalFilter, SMCELBO
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.infer import unscented_rts_smoother
from pyro_smc.models import DiagonalLinearGaussianSSM, LinearGaussianSSM, NonlinearGaussianSSM
from pyro_smc.resamplers import MultinomialResampler, OTResampler, ResidualResampler, SoftResampler, StratifiedResampler, SystematicResampler

from .cases import ar1_ssm


def _ar1_data(T=5, seed=0):
    ssm = ar1_ssm()
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(seed))
    return ssm, ys


def _evidence_ratios(ssm, ys, resampler, num_filters=4000, seed=0):
    """``Z_hat / Z`` of ``num_filters`` independent filters of 8 particles resampling at every step."""
    torch.manual_seed(seed)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=8, num_filters=num_filters, resampler=resampler, ess_threshold=1.0).run(ys)
    return (smc.log_evidence - ssm.log_evidence(ys)).exp()


@pytest.mark.parametrize(
    "resampler",
    [SystematicResampler(), StratifiedResampler(), MultinomialResampler(), ResidualResampler()],
    ids=["systematic", "stratified", "multinomial", "residual"],
)
def test_index_resampling_evidence_estimate_is_unbiased(resampler):
    """docs/engines/smc.md, resampler table: ``SystematicResampler()`` (default),
    ``StratifiedResampler()``, ``MultinomialResampler()`` -- "unbiased ``Z_hat``".
    ``E[Z_hat / Z] = 1`` within five standard errors (Kalman ``Z``; 8 particles, 5 steps)."""
    ratio = _evidence_ratios(*_ar1_data(), resampler)
    se = ratio.std() / len(ratio) ** 0.5
    assert abs(ratio.mean() - 1) < 5 * se


def test_ot_resampling_evidence_estimate_is_biased_and_less_so_at_smaller_epsilon():
    """docs/engines/smc.md: ``OTResampler`` -- "biased but smooth ``Z_hat``"; ``epsilon`` "(smaller
    is less biased and stiffer)". ``E[Z_hat / Z]`` differs from 1 by more than five standard errors
    at ``epsilon = 1``, and by more at ``epsilon = 10`` (paired runs, five standard errors of the
    difference)."""
    ssm, ys = _ar1_data()
    small = _evidence_ratios(ssm, ys, OTResampler(epsilon=1.0))
    large = _evidence_ratios(ssm, ys, OTResampler(epsilon=10.0))
    assert abs(small.mean() - 1) > 5 * small.std() / len(small) ** 0.5
    bias_gap = (large - 1).abs() - (small - 1).abs()  # paired: the same seed, the same first proposals
    assert (large.mean() - 1).abs() - (small.mean() - 1).abs() > 5 * bias_gap.std() / len(bias_gap) ** 0.5


def test_soft_resampling_with_alpha_one_is_multinomial():
    """docs/engines/smc.md, resampler table: ``SoftResampler(alpha)`` -- "``alpha = 1`` is
    multinomial". The new weights are uniform (so no weight gradient flows), and each particle's
    number of offspring has mean ``N w_i`` (within five standard errors over 4000 draws)."""
    N, R = 6, 4000
    log_w = torch.tensor([0.4, 0.1, 0.2, 0.05, 0.05, 0.2]).log().requires_grad_()
    x = torch.arange(N, dtype=torch.float64)
    torch.manual_seed(0)
    new, new_log_w = SoftResampler(alpha=1.0)({"x": x.expand(R, N)}, log_w.expand(R, N))
    torch.testing.assert_close(new_log_w, torch.full((R, N), -torch.log(torch.tensor(float(N)))))
    (grad,) = torch.autograd.grad(new_log_w.sum(), log_w, allow_unused=True)
    assert grad is None or bool((grad.abs() < 1e-12).all())
    counts = (new["x"].unsqueeze(-1) == x).sum(1).double()  # (R, N): offspring of each particle
    se = counts.std(0) / R**0.5
    assert bool(((counts.mean(0) - N * log_w.detach().exp()).abs() < 5 * se).all())


class _ShiftProposal:
    """A Gaussian proposal around the model's transition, shifted by a learnable ``qloc``."""

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = pyro.param("qloc", torch.tensor([0.1]))
        prev = 0.9 * state["x"] if "x" in state else torch.zeros(1)
        pyro.sample(f"x_{self.t}", dist.Normal(prev + loc, 0.8).to_event(1))
        self.t += 1


def test_stop_gradient_gives_the_proposal_no_gradient():
    """docs/advice.md, "Stop-gradient or OT": ``gradient="stop_gradient"`` "gives proposal
    parameters no gradient" (also docs/engines/smc.md, deep state-space models: "it gives the
    proposal no gradient"). The proposal's parameter gets exactly zero gradient; with detached
    resampling it gets a nonzero pathwise one."""
    ssm, ys = _ar1_data()
    grads = {}
    for mode in ["detach", "stop_gradient"]:
        pyro.clear_param_store()
        torch.manual_seed(0)
        smc = SMC(ssm, _ShiftProposal(), num_particles=16, num_filters=4, resampler=SystematicResampler(gradient=mode), ess_threshold=1.0).run(ys)
        (grads[mode],) = torch.autograd.grad(smc.log_evidence.sum(), pyro.param("qloc").unconstrained())
    assert bool((grads["stop_gradient"] == 0).all())
    assert bool((grads["detach"] != 0).all())


def test_smcelbo_is_minus_the_mean_log_evidence_not_divided_by_T():
    """docs/design.md: "``SMCELBO`` is ``-mean_b log Z_hat_b``, not divided by ``T``; its
    ``num_particles`` is the number of SMC particles." Same seed, same filters: the loss is minus
    the mean of ``SMC``'s log-evidence estimates."""
    ssm, ys = _ar1_data(T=8)
    pyro.set_rng_seed(3)
    loss = SMCELBO(num_particles=20, num_filters=4).differentiable_loss(ssm, None, ys)
    pyro.set_rng_seed(3)
    log_z = SMC(ssm, num_particles=20, num_filters=4).run(ys).log_evidence
    torch.testing.assert_close(loss, -log_z.mean(), rtol=0, atol=1e-12)


def test_filtering_means_are_differentiable():
    """README.md, item 1: with OT resampling "the log-evidence estimate and the filtering means are
    differentiable" (docs/engines/smc.md: "Everything keeps its autograd graph"). Every filtering
    mean, after resampling steps included, has a finite nonzero gradient in the model's parameter."""
    theta = torch.tensor(0.9, requires_grad=True)
    one = torch.eye(1)
    ssm = LinearGaussianSSM(theta * one, 0.19 * one, one, one, torch.zeros(1), one)
    _, ys = ar1_ssm().simulate(6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    smc = SMC(ssm, num_particles=16, num_filters=2, resampler=OTResampler(epsilon=0.5), ess_threshold=1.0).run(ys)
    assert bool(smc.resampled.all())
    means = smc.filtering_means["x"]  # (T, B, 1)
    for t in range(1, len(ys)):
        (grad,) = torch.autograd.grad(means[t].sum(), theta, retain_graph=True)
        assert torch.isfinite(grad) and grad != 0, t


def test_filtering_means_are_recorded_before_resampling():
    """docs/design.md: "**Filtering means** are recorded at every ``step`` (not ``init``), after
    reweighting and before resampling". Two runs from one seed that differ only in whether they
    resample record the same first filtering mean, the weighted mean of the proposed particles."""
    ssm, ys = _ar1_data(T=1)
    out = {}
    for threshold in [1e-9, 1.0]:  # never (the ESS is at least 1) and always
        torch.manual_seed(0)
        out[threshold] = SMC(ssm, num_particles=16, num_filters=3, ess_threshold=threshold).run(ys)
    assert bool(out[1.0].resampled.all()) and not bool(out[1e-9].resampled.any())
    weighted = (out[1e-9].log_weights.exp().unsqueeze(-1) * out[1e-9].state["x"]).sum(-2)
    torch.testing.assert_close(out[1e-9].filtering_means["x"][0], weighted)
    assert torch.equal(out[1.0].filtering_means["x"][0], out[1e-9].filtering_means["x"][0])
    assert out[1e-9].filtering_means["x"].shape[0] == len(ys)  # one per step, none for init


def _linear_model_and_data(T=15):
    A = torch.tensor([[0.9, 0.2], [-0.1, 0.8]])
    ssm = LinearGaussianSSM(A, 0.3 * torch.eye(2), torch.tensor([[1.0, 0.5]]), torch.eye(1), torch.zeros(2), torch.eye(2))
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))
    return ssm, ys


def _nonlinear_model_and_data(T=15):
    one = torch.eye(1, dtype=torch.float64)
    ssm = NonlinearGaussianSSM(lambda x: 0.8 * x + torch.sin(x), 0.5 * one, lambda x: x**2 / 4, 0.3 * one, torch.ones(1, dtype=torch.float64), one)
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))
    return ssm, ys


@pytest.mark.filterwarnings("ignore::pyro_smc.infer.EPConvergenceWarning")  # 3 sweeps: only the first is checked
def test_ep_first_sweep_ignores_damping_and_not_power():
    """docs/design.md: "**EP's first sweep** runs without damping ..., so with ``power=1``
    ``result.first_sweep`` is the plain Gaussian smoother (EKS/URTSS/GP-RTSS) whatever ``damping``
    is. ``power`` applies from the first sweep on: with ``power < 1`` the first sweep is the
    smoother with scaled linearisation errors, not the plain one". On a nonlinear model (where the
    power matters), with damping 0.5: power 1's first sweep is the URTSS, power 0.5's is not."""
    ssm, ys = _nonlinear_model_and_data()
    urts = unscented_rts_smoother(ssm, ys)
    plain = EPSmoother(ssm, projection="unscented", max_iter=3, damping=0.5).smooth(ys).first_sweep
    torch.testing.assert_close((plain.means, plain.covariances), (urts.means, urts.covariances), rtol=0, atol=1e-10)
    undamped = EPSmoother(ssm, projection="unscented", max_iter=3, power=0.5).smooth(ys).first_sweep
    damped = EPSmoother(ssm, projection="unscented", max_iter=3, power=0.5, damping=0.5).smooth(ys).first_sweep
    torch.testing.assert_close((damped.means, damped.covariances), (undamped.means, undamped.covariances), rtol=0, atol=1e-12)
    assert (damped.covariances - urts.covariances).abs().max() > 1e-3


def test_power_ep_is_exact_on_a_linear_model():
    """docs/design.md: "Power EP powers the one-step factors of each state, so it is exact on a
    linear-Gaussian model for every power (the Kalman smoother from the first sweep on); on a
    nonlinear model it changes the fixed point". Power 0.5: the first sweep and the converged
    marginals are the RTS smoother's (rounding); on a nonlinear model the fixed point moves."""
    ssm, ys = _linear_model_and_data()
    rts = ssm.rts_smoother(ys)
    power = EPSmoother(ssm, projection="linearization", max_iter=20, power=0.5).smooth(ys)
    assert power.converged
    for result in (power.first_sweep, power):
        torch.testing.assert_close((result.means, result.covariances), (rts.means, rts.covariances), rtol=1e-8, atol=1e-8)
    nonlinear, data = _nonlinear_model_and_data()
    plain = EPSmoother(nonlinear, projection="unscented", max_iter=100, tol=1e-10).smooth(data)
    powered = EPSmoother(nonlinear, projection="unscented", max_iter=100, tol=1e-10, power=0.5).smooth(data)
    assert plain.converged and powered.converged
    assert (plain.means - powered.means).abs().max() > 1e-4


def test_online_checkpoint_holds_the_learned_parameters():
    """docs/ecosystem.md, checkpoints: the online filter's ``state_dict`` holds its guide's weights
    and, with ``learn_parameters=True``, the model parameters it learns; ``load_state_dict`` writes
    them back into Pyro's param store. Parameters changed after the checkpoint return to their
    checkpointed values, and so does the next step."""
    truth = DiagonalLinearGaussianSSM(torch.tensor([0.8, 0.8]), torch.tensor([1.0, 1.0]), 0.5, 0.3)
    _, ys = truth.as_linear_gaussian().simulate(4, generator=torch.Generator().manual_seed(0))
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = DiagonalLinearGaussianSSM(torch.tensor([0.4, 0.4]), torch.tensor([0.5, 0.5]), 0.5, 0.3)
    guide = StreamingFilterGuide(2)
    vf = OnlineVariationalFilter(model, guide, num_iterations=1, num_samples=4, num_regression_samples=16, learn_parameters=True, parameter_lr=0.05)
    for y in ys[:2]:
        vf.step(y)
    checkpoint = vf.state_dict()
    saved = {k: v.clone() for k, v in vf.parameters().items()}
    saved_guide = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    vf.step(ys[2])
    after = {k: v.clone() for k, v in vf.parameters().items()}
    assert any(not torch.equal(after[k], saved[k]) for k in saved)
    vf.load_state_dict(checkpoint)
    for k, v in vf.parameters().items():
        assert torch.equal(v, saved[k]), k
        assert torch.equal(pyro.param(k).detach(), saved[k]), k
    for k, v in guide.state_dict().items():
        assert torch.equal(v, saved_guide[k]), k
    vf.step(ys[2])
    for k, v in vf.parameters().items():
        assert torch.equal(v, after[k]), k


@pytest.mark.parametrize("stop_sigmas", [3.0, None], ids=["defaults", "every-iteration"])
def test_online_running_elbo_is_a_lower_bound(stop_sigmas):
    """docs/engines/streaming.md: "The running ELBO ``log_evidence`` is a Monte Carlo lower bound on
    ``log p(y_{1:t})``." On a linear-Gaussian model the mean of three runs' ELBOs stays below the
    Kalman log-evidence, within five standard errors of that mean (plus float rounding: at the
    defaults each step starts at the exact Kalman update and stops there, so the bound is met
    with equality; with every iteration run, Adam's noisy steps move off the optimum)."""
    truth = DiagonalLinearGaussianSSM(torch.tensor([0.8, 0.8]), torch.tensor([1.0, 1.0]), 0.5, 0.3)
    linear = truth.as_linear_gaussian()
    _, ys = linear.simulate(8, generator=torch.Generator().manual_seed(1))
    elbos = []
    for seed in range(3):
        pyro.clear_param_store()
        torch.manual_seed(seed)
        vf = OnlineVariationalFilter(
            truth, StreamingFilterGuide(2), num_iterations=3, num_samples=16, num_regression_samples=32, stop_sigmas=stop_sigmas
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            elbos.append(vf.run(ys).log_evidence)
    elbos = torch.stack(elbos)
    exact = linear.log_evidence(ys)
    rounding = 1e-5 * (1 + abs(float(exact)))  # float32
    assert elbos.mean() <= exact + 5 * elbos.std() / len(elbos) ** 0.5 + rounding


def _matrix_and_vector_model():
    pyro.sample("fc1.weight", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
def test_trace_mean_field_kl_is_closed_form_except_for_nonlinear(kind):
    """docs/engines/kronecker.md: "``TraceMeanField_ELBO`` uses the closed-form KL for
    ``"diag"``/``"linear"`` matrices and falls back to a Monte Carlo KL for ``"nonlinear"`` ones".
    Without observations the loss is the KL: the same number from two seeds for ``"diag"`` and
    ``"linear"``, and it equals the sum of the exact KLs of the guide's distributions; two different
    numbers for ``"nonlinear"``."""
    from torch.distributions import kl_divergence

    from pyro_smc.guides import AutoKroneckerFlow

    guide = AutoKroneckerFlow(_matrix_and_vector_model, kind=kind)
    losses = []
    for seed in range(2):
        torch.manual_seed(seed)
        losses.append(pyro.infer.TraceMeanField_ELBO().loss(_matrix_and_vector_model, guide))
    if kind == "nonlinear":
        assert losses[0] != losses[1]
        return
    assert losses[0] == losses[1]
    trace = pyro.poutine.trace(guide).get_trace()
    priors = {"fc1.weight": dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2), "b": dist.Normal(0.0, 1.0).expand([2]).to_event(1)}
    kl = sum(float(kl_divergence(trace.nodes[name]["fn"], prior).detach()) for name, prior in priors.items())
    assert losses[0] == pytest.approx(kl, rel=1e-10)


def test_kronecker_state_dicts_of_version_0_1_0_do_not_load():
    """docs/engines/kronecker.md: "**Parameter names** follow ``AutoNormal``: ``locs.<site>``,
    ``scales.<site>`` (diagonal sites), ``row_factors.<site>``, ``col_factors.<site>`` ... (dotted
    site names nest ...). State dicts saved by pyro_smc 0.1.0 (``locs.fc1__weight``,
    ``scales.w_row``) do not load into this version." """
    from pyro_smc.guides import AutoKroneckerFlow

    guide = AutoKroneckerFlow(_matrix_and_vector_model, kind="linear")
    guide()
    state = guide.state_dict()
    assert {k.removesuffix("_unconstrained") for k in state} == {"locs.fc1.weight", "row_factors.fc1.weight", "col_factors.fc1.weight", "locs.b", "scales.b"}
    assert guide.locs.fc1.weight.shape == (3, 2)
    old = {k.replace("fc1.weight", "fc1__weight"): v for k, v in state.items()}
    with pytest.raises(RuntimeError, match="fc1__weight"):
        guide.load_state_dict(old)
    guide.load_state_dict(state)


def test_ot_log_evidence_estimate_can_lie_above_the_log_evidence():
    """docs/advice.md, "What the gradient is": with ``OTResampler``, ``log Z_hat`` "is an estimate:
    ``E[log Z_hat]`` is not ``log p(y)`` (on long series it lies below; OT's bias can also put it
    above, on short ones)". At the default ``epsilon = 0.5``, 32 particles and 5 steps,
    ``E[log Z_hat] - log p(y)`` is positive by more than five standard errors (for an unbiased
    ``Z_hat`` Jensen's inequality would put it below)."""
    ssm, ys = _ar1_data()
    torch.manual_seed(0)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=32, num_filters=1000, resampler=OTResampler(epsilon=0.5, max_iter=1000), ess_threshold=1.0).run(ys)
    gap = smc.log_evidence - ssm.log_evidence(ys)
    assert gap.mean() > 5 * gap.std() / len(gap) ** 0.5


class _MixedState:
    """A 2-d float state ``x``, a float scalar ``v`` derived from it and an integer label ``z``."""

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = 0.9 * state["x"] if "x" in state else torch.zeros(2)
        x = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0).to_event(1))
        z = pyro.sample(f"z_{self.t}", dist.Bernoulli(torch.tensor(0.3)))
        state["x"], state["v"], state["z"] = x, 2.0 * x[..., 0], z.long()
        pyro.sample(f"y_{self.t}", dist.Normal(x, 1.0).to_event(1), obs=y)
        self.t += 1


@pytest.mark.parametrize("method", ["ffbs", "rejection", "genealogy"])
def test_smooth_returns_every_state_key(method):
    """docs/engines/smc.md, trajectories: "``smc.smooth(num_samples, method)`` then returns, for every
    state key, smoothed trajectories of shape ``(num_samples, T, num_filters, *event)``". A state
    with two float keys and an integer one gives all three, the integer one in its dtype."""
    ys = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        smc = SMC(_MixedState(), num_particles=20, num_filters=3, store_history=True).run(ys)
        paths = smc.smooth(7, method=method)
    assert {k: tuple(v.shape) for k, v in paths.items()} == {"x": (7, 6, 3, 2), "v": (7, 6, 3), "z": (7, 6, 3)}
    assert paths["x"].is_floating_point() and paths["v"].is_floating_point() and paths["z"].dtype == torch.long
