"""SMC against exact answers (Kalman) on the paper's linear-Gaussian model, and its contract."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SMCFilter

from pyro_smc import SMC
from pyro_smc.infer.smc import SMCFailedError
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import MultinomialResampler, OTResampler, ResidualResampler, SoftResampler, StratifiedResampler, SystematicResampler
from tests.cases import isotropic_lgssm
from tests.infer.paper_model import DiagLinearGaussian, kalman_log_evidence, simulate
from tests.tolerances import MC_SIGMAS

T = 150


def _lgssm(theta=0.5, d=2):
    eye = torch.eye(d)
    return LinearGaussianSSM(theta * eye, eye, eye, 0.1 * eye, torch.zeros(d), eye)


@pytest.fixture(scope="module")
def paper_data():
    # Module-scoped fixtures run before conftest's per-test dtype fixture, so restore the dtype
    # here: leaving float64 set would leak into every later test module and doctest.
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return simulate([0.5, 0.5], T, seed=0)
    finally:
        torch.set_default_dtype(old)


# --- accuracy against Kalman --------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_log_evidence_gap_at_paper_scale_and_ot_matches_multinomial(paper_data, seed):
    """Table 1 of Corenflos et al.: with N = 25 the gap (log Z_hat - log p) / T is about -1 nat;
    the OT filter is within 0.03 nats/step of the multinomial one (tested as a statistical claim:
    |difference| < 0.03 + 3 standard errors)."""
    _, ys = paper_data
    ssm = _lgssm(0.5)
    exact = ssm.log_evidence(ys)
    gaps = {}
    for name, resampler in [("multinomial", MultinomialResampler()), ("ot", OTResampler(0.5))]:
        pyro.set_rng_seed(seed)
        with torch.no_grad():
            smc = SMC(ssm, num_particles=25, num_filters=300, resampler=resampler).run(ys)
        gaps[name] = (smc.log_evidence - exact) / T
    for gap in gaps.values():
        assert -1.5 < gap.mean() < -0.8
    se = math.sqrt(sum(g.var() / g.numel() for g in gaps.values()))
    assert abs(gaps["ot"].mean() - gaps["multinomial"].mean()) < 0.03 + 3 * se


def test_log_evidence_gap_shrinks_with_particles(paper_data):
    _, ys = paper_data
    ssm = _lgssm(0.5)
    exact = ssm.log_evidence(ys)
    means = []
    for n in (25, 100, 400):
        with torch.no_grad():
            smc = SMC(ssm, num_particles=n, num_filters=50).run(ys)
        gap = (smc.log_evidence - exact) / T
        means.append((gap.mean(), gap.std() / math.sqrt(gap.numel())))
    for (m_small, s_small), (m_big, s_big) in zip(means, means[1:]):
        assert m_big - m_small > MC_SIGMAS * math.hypot(s_small, s_big)
    assert means[-1][0] < 0  # Jensen: E[log Z_hat] < log p for an unbiased Z_hat


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.25)], ids=["systematic", "ot"])
def test_filtering_means_match_kalman(resampler):
    """Filtering means averaged over independent filters agree with Kalman within Monte Carlo
    error (5 sigma over the filters' spread, every time step and coordinate)."""
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(20)
    kalman = ssm.kalman_filter(ys).means
    pyro.set_rng_seed(1)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=300, num_filters=20, resampler=resampler).run(ys)
    means = smc.filtering_means["x"]  # (T, B, d)
    est, se = means.mean(1), means.std(1) / math.sqrt(means.shape[1])
    # A floor for time steps where the filters agree to rounding.
    assert ((est - kalman).abs() < MC_SIGMAS * se + 1e-3).all()


def test_ot_gradient_is_far_closer_to_kalman_score(paper_data):
    """At theta = (0.75, 0.75) the OT filter's gradient of mean log Z_hat is far closer to the
    exact score than that of systematic resampling, which drops the resampling terms."""
    _, ys = paper_data
    theta = torch.tensor([0.75, 0.75], requires_grad=True)
    (score,) = torch.autograd.grad(kalman_log_evidence(theta, ys), theta)
    errors = {}
    for name, resampler in [("systematic", SystematicResampler()), ("ot", OTResampler(0.5))]:
        pyro.set_rng_seed(0)
        theta = torch.tensor([0.75, 0.75], requires_grad=True)
        smc = SMC(DiagLinearGaussian(theta, learnable=False), num_particles=200, num_filters=8, resampler=resampler).run(ys)
        (grad,) = torch.autograd.grad(smc.log_evidence.mean(), theta)
        errors[name] = (grad - score).norm().item()
    print(f"|grad - score|: OT {errors['ot']:.1f}, systematic {errors['systematic']:.1f}, |score| {score.norm():.1f}")
    assert errors["ot"] < 0.5 * errors["systematic"]


# 80 s (the paper's model names its sites by step, so every step runs through Pyro's handlers):
# the full run's. The default run checks the same claim, SVI with SMCELBO and OT resampling
# landing on the exact (Kalman) maximum-likelihood estimate, on the README's and the
# getting-started page's examples (tests/test_docs.py).
@pytest.mark.slow
def test_svi_with_smcelbo_lands_near_kalman_mle(paper_data):
    from pyro.infer import SVI

    from pyro_smc import SMCELBO
    from tests.infer.paper_model import kalman_mle

    _, ys = paper_data
    mle = kalman_mle(ys)
    model = DiagLinearGaussian([0.25, 0.25])
    svi = SVI(model, None, pyro.optim.Adam({"lr": 0.1}), loss=SMCELBO(num_particles=25, num_filters=8, resampler=OTResampler(0.5)))
    path = []
    for _ in range(60):
        svi.step(ys)
        path.append(model.theta.detach().clone())
    estimate = torch.stack(path[30:]).mean(0)  # Polyak average of the second half
    assert (estimate - mle).abs().max() < 0.1, (estimate, mle)
    assert "theta" in pyro.get_param_store()


# --- Pyro compatibility -------------------------------------------------------------------------
class HarmonicModel:
    """Pyro's SMCFilter test model (simple harmonic oscillator), written for SMCFilter."""

    def __init__(self):
        self.A = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
        self.B = torch.tensor([3.0, 3.0])
        self.sigma_z = torch.tensor(1.0)
        self.sigma_y = torch.tensor(1.0)

    def init(self, state, initial):
        self.t = 0
        state["z"] = pyro.sample("z_init", dist.Delta(initial, event_dim=1))

    def step(self, state, y=None):
        self.t += 1
        state["z"] = pyro.sample(f"z_{self.t}", dist.Normal(state["z"].matmul(self.A), self.B * self.sigma_z).to_event(1))
        y = pyro.sample(f"y_{self.t}", dist.Normal(state["z"][..., 0], self.sigma_y), obs=y)
        return state["z"], y


class HarmonicGuide:
    def __init__(self, model):
        self.model = model

    def init(self, state, initial):
        self.t = 0
        pyro.sample("z_init", dist.Delta(initial, event_dim=1))

    def step(self, state, y=None):
        self.t += 1
        # Proposal biased toward the observation.
        h = state["z"].matmul(self.model.A)
        s = self.model.B * self.model.sigma_z
        mean = h.clone()
        mean[..., 0] = (h[..., 0] / s[0] ** 2 + y / self.model.sigma_y**2) / (1 / s[0] ** 2 + 1 / self.model.sigma_y**2)
        scale = s.clone()
        scale[0] = (1 / s[0] ** 2 + 1 / self.model.sigma_y**2) ** -0.5
        pyro.sample(f"z_{self.t}", dist.Normal(mean, scale).to_event(1))


@pytest.mark.parametrize("use_guide", [False, True])
def test_smcfilter_model_runs_unchanged_and_matches_kalman(use_guide):
    model = HarmonicModel()
    guide = HarmonicGuide(model) if use_guide else None
    initial = torch.tensor([1.0, 0.0])
    pyro.set_rng_seed(2)
    ys = torch.randn(20) * 3
    smc = SMC(model, guide, num_particles=2000, num_filters=10)
    smc.init(initial=initial)
    for y in ys:
        smc.step(y)
    # Exact answer: the same model as a Kalman filter (x_0 known, so prior of x_1 is N(A^T x0, Q)).
    A = model.A.T
    Q = torch.diag((model.B * model.sigma_z) ** 2)
    C = torch.tensor([[1.0, 0.0]])
    R = torch.eye(1)
    from pyro_smc.ops.kalman import kalman_filter

    kf = kalman_filter(ys.unsqueeze(-1), A, Q, C, R, A @ initial, Q)
    means = smc.filtering_means["z"]  # (T, B, 2)
    est, se = means.mean(1), means.std(1) / math.sqrt(means.shape[1])
    assert ((est - kf.means).abs() < MC_SIGMAS * se + 2e-2).all()
    lz = smc.log_evidence
    assert abs(lz.mean() - kf.log_evidence) < MC_SIGMAS * lz.std() / math.sqrt(lz.numel()) + 0.05
    # And Pyro's own SMCFilter runs the same objects.
    if use_guide:
        ref = SMCFilter(model, guide, num_particles=100, max_plate_nesting=0)
        ref.init(initial=initial)
        for y in ys[:3]:
            ref.step(y)


def test_get_empirical_and_shapes():
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(5)
    one = SMC(ssm, num_particles=7).run(ys)
    assert one.state["x"].shape == (7, 2)  # SMCFilter layout with one filter
    assert one.log_evidence.shape == (1,)
    emp = one.get_empirical()["x"]
    assert emp.batch_shape == () and emp.event_shape == (2,)
    many = SMC(ssm, num_particles=7, num_filters=3).run(ys)
    assert many.state["x"].shape == (3, 7, 2)
    assert many.log_evidence.shape == (3,)
    assert many.ess.shape == (3,)
    assert many.filtering_means["x"].shape == (5, 3, 2)
    assert many.ess_history.shape == (5, 3) and many.resampled.shape == (5, 3)
    assert many.get_empirical()["x"].batch_shape == (3,)


def test_resampling_happens_only_in_filters_below_threshold():
    class TwoRegimes:
        """Filter 0 observes nothing informative, filter 1 a sharp observation."""

        def init(self, state):
            self.t = 0

        def step(self, state, y):
            x = pyro.sample(f"x_{self.t}", dist.Normal(0.0, 1.0))
            state["x"] = x
            scale = torch.tensor([[3.0], [0.1]])
            pyro.sample(f"y_{self.t}", dist.Normal(x, scale), obs=y)
            self.t += 1

    pyro.set_rng_seed(0)
    smc = SMC(TwoRegimes(), num_particles=50, num_filters=2, ess_threshold=0.5)
    smc.init()
    smc.step(torch.tensor(0.5))
    resampled = smc.resampled[0]
    assert resampled.tolist() == [False, True]
    assert torch.allclose(smc.log_weights[1], torch.full((50,), -math.log(50)))
    assert not torch.allclose(smc.log_weights[0], torch.full((50,), -math.log(50)))


@pytest.mark.parametrize(
    "resampler",
    [MultinomialResampler(), ResidualResampler(), StratifiedResampler(), SystematicResampler(), SoftResampler(0.5), OTResampler(0.5)],
    ids=lambda r: type(r).__name__,
)
def test_every_resampler_runs_and_keeps_gradients(resampler):
    theta = torch.tensor([0.5, 0.5], requires_grad=True)
    _, ys = simulate([0.5, 0.5], 10, seed=3)
    smc = SMC(DiagLinearGaussian(theta, learnable=False), num_particles=20, num_filters=2, resampler=resampler, ess_threshold=1.0).run(ys)
    assert smc.resampled.any()
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), theta)
    assert torch.isfinite(grad).all() and (grad != 0).all()


def test_float32_runs():
    torch.set_default_dtype(torch.float32)
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(20)
    smc = SMC(ssm, num_particles=50, num_filters=2, resampler=OTResampler(0.5)).run(ys)
    assert smc.log_evidence.dtype == torch.float32
    assert torch.isfinite(smc.log_evidence).all()


def test_device(device):
    eye = torch.eye(2, device=device)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2, device=device), eye)
    _, ys = ssm.simulate(5)
    smc = SMC(ssm, num_particles=10, num_filters=2, resampler=OTResampler(0.5)).run(ys)
    assert smc.log_evidence.device.type == device.type


# --- bad input ----------------------------------------------------------------------------------
def test_nan_and_inf_observations_name_the_step():
    """inf is an error; a partly-NaN observation of a site that does not factorise over its
    entries (a MultivariateNormal: R not diagonal) too, naming the step."""
    ssm = _lgssm(0.5)
    eye = torch.eye(2)
    full_r = LinearGaussianSSM(0.5 * eye, eye, eye, torch.tensor([[0.2, 0.05], [0.05, 0.2]]), torch.zeros(2), eye)
    _, ys = ssm.simulate(6)
    for model, bad, match in ((ssm, math.inf, "inf"), (full_r, math.nan, "factorise")):
        ys_bad = ys.clone()
        ys_bad[4, 1] = bad
        with pytest.raises(ValueError, match=f"time step 4.*{match}|{match}.*time step 4"):
            SMC(model, num_particles=5).run(ys_bad)
        smc = SMC(model, num_particles=5)
        smc.init()
        smc.step(ys[0])
        with pytest.raises(ValueError, match="time step 1"):
            smc.step(ys_bad[4])
    smc = SMC(ssm, num_particles=5).init()
    with pytest.raises(ValueError, match="^argument 1 of the step at time step 0 contains NaN"):  # not the observation
        smc.step(ys[0], torch.tensor([math.nan, 1.0]))


def test_a_non_finite_covariate_is_named_as_such():
    """An infinite covariate was reported as "observation at init contains inf" (the observation
    being fine): the message now names the argument and where it was passed."""
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(3)
    inf, nan = torch.tensor([math.inf, 0.0]), torch.tensor([math.nan, 0.0])
    with pytest.raises(ValueError, match=r"^argument 0 of init contains inf"):
        SMC(ssm, num_particles=5).run(ys, inf)
    with pytest.raises(ValueError, match=r"^keyword argument 'u' of init contains NaN"):
        SMC(ssm, num_particles=5).init(u=nan)
    with pytest.raises(ValueError, match=r"^argument 1 of the step at time step 0 contains inf"):
        SMC(ssm, num_particles=5).init().step(ys[0], inf)
    with pytest.raises(ValueError, match=r"^keyword argument 'u' of the step at time step 0 contains inf"):
        SMC(ssm, num_particles=5).init().step(ys[0], u=inf)


def test_smc_rejects_observations_of_the_wrong_shape():
    ssm = isotropic_lgssm(torch.float64)
    with pytest.raises(ValueError, match="observations"):
        SMC(ssm, num_particles=4).run(torch.tensor(1.0))
    with pytest.raises(ValueError, match="observations"):
        SMC(ssm, num_particles=4).run([[0.0, 0.0]])
    with pytest.raises(ValueError):  # Pyro's own validation of the observed site's event shape
        SMC(ssm, num_particles=4).run(torch.zeros(3, 5))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_particles=0), "num_particles"),
        (dict(num_particles=2.5), "num_particles"),
        (dict(num_particles=5, ess_threshold=0.0), "ess_threshold"),
        (dict(num_particles=5, ess_threshold=1.5), "ess_threshold"),
        (dict(num_particles=5, num_filters=0), "num_filters"),
        (dict(num_particles=5, max_plate_nesting=-1), "max_plate_nesting"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMC(_lgssm(), **kwargs)


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan])
def test_invalid_epsilon(eps):
    with pytest.raises(ValueError, match="epsilon"):
        OTResampler(epsilon=eps)


@pytest.mark.parametrize("alpha", [0.0, 1.5, -0.1])
def test_invalid_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        SoftResampler(alpha)


def test_all_zero_weights_name_step_and_site():
    class Impossible:
        def init(self, state):
            self.t = 0

        def step(self, state, y):
            x = pyro.sample(f"x_{self.t}", dist.Uniform(0.0, 1.0))
            state["x"] = x
            pyro.sample(f"y_{self.t}", dist.Uniform(x - 0.5, x + 0.5, validate_args=False), obs=y)
            self.t += 1

    smc = SMC(Impossible(), num_particles=10)
    smc.init()
    smc.step(torch.tensor(0.5))
    with pytest.raises(SMCFailedError, match=r"time step 1.*'y_1'"):
        smc.step(torch.tensor(5.0))
    assert issubclass(SMCFailedError, ValueError)


def test_wrong_particle_shape_in_state_is_an_error():
    class Bad:
        def init(self, state):
            state["t"] = torch.tensor(0.0)  # no particle dim

        def step(self, state, y):
            pass

    with pytest.raises(ValueError, match=r"state\['t'\].*particle"):
        SMC(Bad(), num_particles=4).init()


def test_guide_may_not_write_state():
    class Writer:
        def init(self, state):
            state["x"] = torch.zeros(3)

        def step(self, state, y=None):
            pass

    class Model:
        def init(self, state):
            state["x"] = pyro.sample("x0", dist.Normal(0.0, 1.0))

        def step(self, state, y=None):
            pass

    with pytest.raises(RuntimeError, match="Guide cannot write"):
        SMC(Model(), Writer(), num_particles=3).init()


class IndependentSeries:
    """Three independent scalar AR(1) series inside a model plate (max_plate_nesting=1)."""

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        with pyro.plate("series", 3, dim=-1):
            loc = 0.7 * state["x"] if self.t else torch.zeros(())
            x = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
            state["x"] = x
            pyro.sample(f"y_{self.t}", dist.Normal(x, 0.5), obs=y)
        self.t += 1


@pytest.mark.parametrize("num_filters", [1, 4])
def test_model_plates_with_max_plate_nesting(num_filters):
    """log Z of three independent series = sum of three 1-d Kalman evidences (MC error bars)."""
    from pyro_smc.ops.kalman import kalman_filter

    g = torch.Generator().manual_seed(4)
    ys = torch.randn(15, 3, generator=g)
    one = torch.ones(1, 1)
    exact = sum(
        kalman_filter(ys[:, k : k + 1], 0.7 * one, one, one, 0.25 * one, torch.zeros(1), one).log_evidence for k in range(3)
    )
    pyro.set_rng_seed(0)
    runs = [SMC(IndependentSeries(), num_particles=2000, num_filters=num_filters, max_plate_nesting=1).run(ys) for _ in range(8 // num_filters)]
    lz = torch.cat([r.log_evidence for r in runs])
    shape = (num_filters, 2000, 3) if num_filters > 1 else (2000, 3)
    assert runs[0].state["x"].shape == shape
    assert abs(lz.mean() - exact) < MC_SIGMAS * lz.std() / math.sqrt(lz.numel()) + 0.05


def test_too_few_plate_dims_is_an_error():
    with pytest.raises(ValueError, match="max_plate_nesting"):
        SMC(IndependentSeries(), num_particles=5, num_filters=2, max_plate_nesting=0).run(torch.zeros(2, 3))


# --- missing observations -----------------------------------------------------------------------
def _kalman_with_missing(ssm, ys, missing):
    """Exact evidence and filtering means when the steps in ``missing`` are predict-only."""
    from pyro_smc.ops import kalman

    mean, cov = ssm.init_mean, ssm.init_cov
    log_z, means = ys.new_zeros(()), []
    for t, y in enumerate(ys):
        if t > 0:  # init_mean, init_cov are the prior of the first step's state
            mean, cov = kalman.predict(mean, cov, ssm.A, ssm.Q)
        if t not in missing:
            mean, cov, log_lik = kalman.update(mean, cov, y, ssm.C, ssm.R)
            log_z = log_z + log_lik
        means.append(mean)
    return log_z, torch.stack(means)


def test_all_nan_steps_are_predict_only_against_kalman():
    """Z_hat is unbiased for the evidence of the observed steps (tested in the exp domain, where it
    is exactly true) and the filtering mean at a missing step is the Kalman prediction."""
    torch.manual_seed(0)
    eye = torch.eye(2, dtype=torch.float64)
    # Unit observation noise keeps the ESS high, so the self-normalised means' O(1/ESS) bias stays
    # far below the Monte Carlo band.
    ssm = LinearGaussianSSM(0.8 * eye, eye, eye, eye, torch.zeros(2, dtype=torch.float64), eye)
    _, ys = ssm.simulate(10)
    missing = {0, 3, 4, 9}
    ys[list(missing)] = math.nan
    exact, kalman_means = _kalman_with_missing(ssm, ys, missing)
    pyro.set_rng_seed(1)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=1000, num_filters=200).run(ys)
    ratio = (smc.log_evidence - exact).exp()
    assert abs(ratio.mean() - 1) < MC_SIGMAS * ratio.std() / math.sqrt(ratio.numel())
    means = smc.filtering_means["x"]  # (T, B, d)
    err = (means.mean(1) - kalman_means).abs()
    assert bool((err < MC_SIGMAS * means.std(1) / math.sqrt(means.shape[1]) + 1e-12).all())


def _kalman_with_partly_missing(ssm, ys):
    """Exact evidence and filtering means, each step conditioned on its observed entries only."""
    from pyro_smc.ops import kalman

    mean, cov = ssm.init_mean, ssm.init_cov
    log_z, means = ys.new_zeros(()), []
    for t, y in enumerate(ys):
        if t > 0:
            mean, cov = kalman.predict(mean, cov, ssm.A, ssm.Q)
        observed = ~torch.isnan(y)
        if bool(observed.any()):
            mean, cov, log_lik = kalman.masked_update(mean, cov, y, ssm.C, ssm.R, observed)
            log_z = log_z + log_lik
        means.append(mean)
    return log_z, torch.stack(means)


@pytest.mark.parametrize("use_step", [False, True], ids=["run", "step"])
def test_partly_missing_observations_against_kalman(use_step):
    """Entries of an observation that are NaN are left out of its likelihood (the site factorises:
    diagonal R): Z_hat is unbiased for the evidence of the observed entries (exp domain, where it
    is exact) and the filtering means agree with the Kalman filter's masked updates."""
    torch.manual_seed(0)
    eye = torch.eye(3, dtype=torch.float64)
    ssm = LinearGaussianSSM(0.8 * eye, eye, eye, torch.diag(torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)), torch.zeros(3, dtype=torch.float64), eye)
    _, ys = ssm.simulate(10)
    ys[1, 0] = ys[4, 1] = ys[4, 2] = ys[7, 2] = math.nan
    ys[8] = math.nan  # wholly missing: predict-only
    exact, kalman_means = _kalman_with_partly_missing(ssm, ys)
    pyro.set_rng_seed(1)
    with torch.no_grad():
        smc = SMC(ssm, num_particles=1000, num_filters=200)
        if use_step:
            smc.init()
            for y in ys:
                smc.step(y)
        else:
            smc.run(ys)
    ratio = (smc.log_evidence - exact).exp()
    assert abs(ratio.mean() - 1) < MC_SIGMAS * ratio.std() / math.sqrt(ratio.numel())
    means = smc.filtering_means["x"]
    err = (means.mean(1) - kalman_means).abs()
    assert bool((err < MC_SIGMAS * means.std(1) / math.sqrt(means.shape[1]) + 1e-12).all())
    # The masked evidence differs from the full one: the test can tell the entries were left out.
    full_exact, _ = _kalman_with_partly_missing(ssm, torch.nan_to_num(ys.clone(), nan=0.0))
    assert abs(float(full_exact - exact)) > 1.0


class _RecordingGuide:
    """A guide that proposes nothing and records the observations it is called with."""

    def __init__(self):
        self.calls = []

    def init(self, state):
        pass

    def step(self, state, y):
        self.calls.append(y)


def test_partly_missing_observation_calls_the_guide_on_zeros_and_needs_one_observed_site():
    """The guide cannot propose from a partly missing observation; it is called with the missing
    entries set to zero (so its bookkeeping advances) and its draws are discarded."""
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(3)
    guide = _RecordingGuide()

    smc = SMC(ssm, guide, num_particles=5).init()
    smc.step(torch.tensor([math.nan, 0.3]))
    assert len(guide.calls) == 1 and guide.calls[0].tolist() == [0.0, 0.3] and torch.isfinite(smc.log_evidence).all()

    class TwoSites:
        def init(self, state):
            pass

        def step(self, state, y):
            x = pyro.sample("x", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            state["x"] = x
            pyro.sample("y1", dist.Normal(x, 1.0).to_event(1), obs=y)
            pyro.sample("y2", dist.Normal(x, 2.0).to_event(1), obs=y)

    with pytest.raises(ValueError, match="2 observed sites"):
        SMC(TwoSites(), num_particles=5).run(torch.tensor([[math.nan, 0.3]]))


def test_none_or_all_nan_observation_leaves_weights_and_evidence_unchanged():
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(3)
    guide = _RecordingGuide()

    for missing in (None, torch.full_like(ys[0], math.nan)):
        smc = SMC(ssm, num_particles=50, ess_threshold=1e-9).init()
        smc.step(ys[0])
        log_w, log_z = smc.log_weights.clone(), smc.log_evidence.clone()
        smc.step(missing)
        assert torch.equal(smc.log_weights, log_w) and torch.equal(smc.log_evidence, log_z)
        assert not torch.isnan(smc.state["x"]).any()
    # The guide, which may need the observation, does not propose at a predict-only step, but is
    # called (its draws discarded) so that its own bookkeeping advances.
    guided = SMC(ssm, guide, num_particles=5)
    guided.init()
    guided.step(None)
    guided.step(torch.full_like(ys[0], math.nan))
    assert guide.calls[0] is None and guide.calls[1].tolist() == [0.0, 0.0]


class _CountingGuide:
    """An SMCFilter-style guide that counts its own steps (``self.t``) and proposes from the
    observation: ``N((A x_{t-1} + y_t) / 2, 1)`` with missing entries read as given."""

    def __init__(self, ssm):
        self.ssm = ssm

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        prior = state["x"] @ self.ssm.A.T if self.t else self.ssm.init_mean
        pyro.sample(f"x_{self.t}", dist.Normal((prior + y @ self.ssm.C) / 2, 1.0).to_event(1))
        self.t += 1


@pytest.mark.parametrize("batched", [False, True])
def test_a_guide_that_counts_its_steps_stays_in_step_over_missing_observations(batched):
    """Before: the guide was skipped at a missing or partly missing step, its counter fell behind,
    and the next step failed with "guide samples site 'x_2' that the model does not have" (a
    property test found it). Now it is called there too, and Z_hat stays unbiased for the
    evidence of the observed entries (Kalman, masked updates)."""
    torch.manual_seed(0)
    eye = torch.eye(2, dtype=torch.float64)
    ssm = LinearGaussianSSM(0.8 * eye, eye, eye, torch.diag(torch.tensor([1.0, 0.5], dtype=torch.float64)), torch.zeros(2, dtype=torch.float64), eye)
    _, ys = ssm.simulate(8)
    ys[2] = math.nan  # predict-only
    ys[5, 0] = math.nan  # partly missing
    exact, _ = _kalman_with_partly_missing(ssm, ys)
    B = 100
    pyro.set_rng_seed(2)
    with torch.no_grad():
        smc = SMC(ssm, _CountingGuide(ssm), num_particles=100, num_filters=B)
        smc.run(ys.expand(B, -1, -1), batched=True) if batched else smc.run(ys)
    ratio = (smc.log_evidence - exact).exp()
    assert abs(ratio.mean() - 1) < MC_SIGMAS * ratio.std() / math.sqrt(B)


def test_result_snapshot_splits_the_evidence_into_per_step_increments():
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(8)
    ys[3] = math.nan
    out = SMC(ssm, num_particles=30, num_filters=3).run(ys).result
    assert out.log_evidence_increments.shape == out.ess.shape == out.resampled.shape == (8, 3)
    torch.testing.assert_close(out.log_evidence_increments.sum(0), out.log_evidence)
    assert bool((out.log_evidence_increments[3] == 0).all())  # predict-only step
    assert out.filtering_means["x"].shape == (8, 3, 2)
    with pytest.raises(RuntimeError, match="step"):
        _ = SMC(ssm, num_particles=3).result


def test_result_reports_whether_each_transport_converged():
    ssm = _lgssm(0.5)
    _, ys = ssm.simulate(6)
    assert SMC(ssm, num_particles=20).run(ys).result.resampler_converged is None  # nothing solved
    easy = SMC(ssm, num_particles=20, num_filters=3, resampler=OTResampler(0.5)).run(ys).result
    assert easy.resampler_converged.shape == (6, 3) and bool(easy.resampler_converged.all())
    with pytest.warns(SinkhornConvergenceWarning):
        hard = SMC(ssm, num_particles=20, num_filters=3, ess_threshold=1.0, resampler=OTResampler(0.5, max_iter=2)).run(ys).result
    # Every filter resampled at every step and no solve converged in two iterations.
    assert bool(hard.resampled.all()) and not bool(hard.resampler_converged.any())


def test_smcfilter_positional_form():
    """``SMC(model, guide, num_particles, max_plate_nesting)`` as for ``SMCFilter``; the same run as
    the keyword form, and a missing ``num_particles`` is named."""
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(5, generator=torch.Generator().manual_seed(0))
    runs = []
    for make in (lambda: SMC(ssm, None, 50, 0), lambda: SMC(ssm, num_particles=50, max_plate_nesting=0)):
        pyro.set_rng_seed(0)
        runs.append(make().run(ys))
    assert runs[0].num_particles == 50 and torch.equal(runs[0].log_evidence, runs[1].log_evidence)
    with pytest.raises(TypeError, match="num_particles"):
        SMC(ssm)
    with pytest.raises(TypeError):
        SMC(ssm, None, 50, 0, SystematicResampler())  # the rest is keyword-only


def test_a_nan_parameter_stops_the_run_naming_the_step():
    """docs/advice.md: a NaN parameter makes the run raise SMCFailedError naming the time step and a site."""
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(5, generator=torch.Generator().manual_seed(0))
    ssm.A = torch.full((2, 2), math.nan)
    with pytest.raises(SMCFailedError, match=r"time step 1.*site 'y_1'"):
        SMC(ssm, num_particles=10).run(ys)


def test_run_computes_a_gp_posterior_once_and_differentiates_its_hyperparameters(monkeypatch):
    # A GP transition: SMC.run pins its posterior, so one Gram Cholesky serves all T steps, and
    # log Z_hat carries gradients to the GP's hyperparameters (under a differentiable resampler).
    from pyro_smc.gp import MultiOutputGP
    from pyro_smc.models import NonlinearGaussianSSM
    from pyro_smc.resamplers import OTResampler

    g = torch.Generator().manual_seed(0)
    X = -2 + 4 * torch.rand(12, 1, generator=g)
    gp = MultiOutputGP(X, torch.sin(X), noise=0.01)
    one = torch.eye(1)
    ssm = NonlinearGaussianSSM(gp, 0.1 * one, lambda x: x, 0.2 * one, torch.zeros(1), one)
    _, ys = ssm.simulate(10, generator=g)
    calls = []
    original = MultiOutputGP._gram_cholesky
    monkeypatch.setattr(MultiOutputGP, "_gram_cholesky", lambda self, *a: calls.append(1) or original(self, *a))
    smc = SMC(ssm, num_particles=50, resampler=OTResampler(epsilon=0.5)).run(ys)
    assert len(calls) == 1 and gp._pinned is None  # pinned for the run, released after it
    smc.log_evidence.sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in gp.parameters())
