"""What ``SMC`` refuses and what it warns about: each case was once a silent wrong answer or an
obscure error. Each test names what happened before its check existed."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_smc import SMC, SMCELBO
from pyro_smc.infer.smc.checks import DegeneracyMonitor, ParticleDegeneracyWarning
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.resamplers import OTResampler, SystematicResampler
from tests.infer.paper_model import DiagLinearGaussian, kalman_log_evidence, simulate
from tests.tolerances import MC_SIGMAS


class AR1:
    """``x_0 ~ N(0, 1)``, ``x_t = 0.8 x_{t-1} + N(0, 1)``, ``y_t = x_t + N(0, obs_sd^2)``; the state in ``state``."""

    def __init__(self, obs_sd=0.5):
        self.obs_sd = obs_sd

    def init(self, state):
        self.t = 0

    def step(self, state, y=None):
        loc = 0.8 * state["x"] if self.t else torch.tensor(0.0)
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], self.obs_sd), obs=y)
        self.t += 1


class AR1OnSelf(AR1):
    """The same model with its latent kept on ``self``: ``state`` stays empty, so nothing is resampled."""

    def step(self, state, y=None):
        loc = 0.8 * self.x if self.t else torch.tensor(0.0)
        self.x = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(self.x, self.obs_sd), obs=y)
        self.t += 1


def _ar1_log_evidence(ys, obs_sd=0.5):
    from pyro_smc.ops.kalman import kalman_filter

    one = torch.ones(1, 1)
    return kalman_filter(ys.unsqueeze(-1), 0.8 * one, one, one, obs_sd**2 * one, torch.zeros(1), one).log_evidence


def _ys(T=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, ys = torch.randn((), generator=g), []
    for t in range(T):
        if t:
            x = 0.8 * x + torch.randn((), generator=g)
        ys.append(x + 0.5 * torch.randn((), generator=g))
    return torch.stack(ys)


def test_latent_kept_on_self_is_an_error_naming_the_site_and_attribute():
    """Before: the run went through, nothing was ever resampled and log Z was -230 against an
    exact -84 on a 50-step series, with no message. The model written with ``state`` matches
    Kalman."""
    ys = _ys()
    with pytest.raises(ValueError, match=r"time step 0: the model keeps latent site 'x_0' as self\.x, not in state"):
        SMC(AR1OnSelf(), num_particles=200).run(ys)
    smc = SMC(AR1(), num_particles=200, num_filters=20).run(ys)
    log_z = smc.log_evidence
    assert abs(float(log_z.mean() - _ar1_log_evidence(ys))) < MC_SIGMAS * float(log_z.std()) / math.sqrt(20) + 0.05


def test_stop_gradient_warns_that_the_guide_gets_no_gradient():
    """Before: no warning, and a guide trained with ``gradient="stop_gradient"`` stayed exactly
    where it started (its gradient is exactly zero, checked here, which is what the warning says)."""

    class Guide:
        def init(self, state):
            self.t = 0

        def step(self, state, y=None):
            scale = pyro.param("guide_scale", torch.tensor(0.7), constraint=dist.constraints.positive)
            pyro.sample(f"x_{self.t}", dist.Normal(y, scale))
            self.t += 1

    ys = _ys(10)
    with pytest.warns(UserWarning, match=r"gradient='stop_gradient' gives the guide's \(proposal's\) parameters exactly zero gradient"):
        smc = SMC(AR1(), Guide(), num_particles=50, resampler=SystematicResampler(gradient="stop_gradient")).run(ys)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), [pyro.param("guide_scale").unconstrained()], allow_unused=True)
    assert grad is None or float(grad.abs()) == 0.0
    # The default estimator does give the guide a gradient, and no such warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smc = SMC(AR1(), Guide(), num_particles=50).run(ys)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), [pyro.param("guide_scale").unconstrained()])
    assert float(grad.abs()) > 0
    # A bootstrap filter has no proposal parameters: nothing to warn about.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SMC(AR1(), num_particles=50, resampler=SystematicResampler(gradient="stop_gradient")).run(ys)


def test_no_time_steps_is_an_error_naming_observations():
    """Before: ``RuntimeError: cannot reshape tensor of 0 elements``."""
    for ys, batched in [(torch.zeros(0), False), (torch.zeros(0, 2), False), (torch.zeros(2, 0, 1), True)]:
        with pytest.raises(ValueError, match="observations has no time steps"):
            SMC(AR1(), num_particles=10, num_filters=2).run(ys, batched=batched)


def test_a_step_that_samples_nothing_is_an_error_naming_the_step():
    """Before: the run returned ``log_evidence=None`` (and ``SMCELBO`` then failed with
    ``'NoneType' object has no attribute ...``)."""

    class Nothing:
        def init(self, state):
            pass

        def step(self, state, y=None):
            pass

    with pytest.raises(ValueError, match="at time step 0: model.init and model.step sampled no site"):
        SMC(Nothing(), num_particles=10).run(torch.zeros(3))
    with pytest.raises(ValueError, match="sampled no site"):
        SMCELBO(num_particles=10).loss(Nothing(), None, torch.zeros(3))


def test_a_resampler_class_instead_of_an_instance_is_an_error():
    """Before: ``resampler=OTResampler`` ran until the first resampling, then failed with
    ``epsilon must be > 0, got {'x': tensor(...)}``."""
    with pytest.raises(ValueError, match=r"got the class OTResampler; did you mean resampler=OTResampler\(\)"):
        SMC(AR1(), num_particles=10, resampler=OTResampler)
    with pytest.raises(ValueError, match="got the class SystematicResampler"):
        SMCELBO(num_particles=10, resampler=SystematicResampler)
    with pytest.raises(ValueError, match="resampler must be callable"):
        SMC(AR1(), num_particles=10, resampler="ot")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_observations_are_an_error(dtype):
    """Before: accepted silently (and log-weights accumulated in half precision)."""
    with pytest.raises(ValueError, match=f"observations are {dtype}: half precision"):
        SMC(AR1(), num_particles=10).run(torch.zeros(3, dtype=dtype))


def test_observations_of_another_dtype_than_the_model_are_an_error():
    """Before: a float64 series into a float32 model (and the reverse) was silently promoted."""
    for model_dtype, data_dtype in [(torch.float32, torch.float64), (torch.float64, torch.float32)]:
        torch.set_default_dtype(model_dtype)  # the conftest fixture restores float64
        with pytest.raises(ValueError, match=f"observation at time step 0 is {data_dtype}, but site 'y_0' computes in {model_dtype}"):
            SMC(AR1(), num_particles=10).run(_ys(3).to(data_dtype))
        out = SMC(AR1(), num_particles=10).run(_ys(3).to(model_dtype)).log_evidence
        assert out.dtype == model_dtype


def test_a_guide_of_another_dtype_than_the_model_is_an_error_naming_the_guide():
    """Before: a float32 guide of a float64 model handed the model float32 particles, and the
    observation's check then blamed the model ("site 'y_0' computes in torch.float32 ... build the
    model in torch.float64"), which was float64 already. With or without the compiled step."""

    class Proposal:
        def __init__(self, dtype):
            self.dtype = dtype

        def init(self, state):
            self.t = 0

        def step(self, state, y=None):
            loc = (0.8 * state["x"] if self.t else torch.tensor(0.0)).to(self.dtype) + 0.3 * y.to(self.dtype)
            pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
            self.t += 1

    ys = _ys(4)  # float64, as the model (the conftest's default dtype)
    for compile in (None, False):
        with pytest.raises(ValueError, match=r"at time step 0: the guide draws site 'x_0' in torch.float32, but the model's site computes in torch.float64"):
            SMC(AR1(), Proposal(torch.float32), num_particles=10, compile=compile).run(ys)
        out = SMC(AR1(), Proposal(torch.float64), num_particles=10, compile=compile).run(ys).log_evidence
        assert out.dtype == torch.float64 and torch.isfinite(out).all()


def test_weight_collapse_warns_once_per_run():
    """Before: an observation sd of 1e-6 gave log Z = -8.3e9 with ESS 1 at every step and no
    warning. A healthy run does not warn."""
    ys = _ys(20)
    with pytest.warns(ParticleDegeneracyWarning, match=r"ESS < 2 of 100\) at 20 of 20 steps, first at time step 0") as record:
        SMC(AR1(obs_sd=1e-6), num_particles=100).run(ys)
    assert sum(issubclass(r.category, ParticleDegeneracyWarning) for r in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParticleDegeneracyWarning)
        SMC(AR1(), num_particles=100).run(ys)


def test_a_state_that_becomes_nan_is_an_error_naming_the_step_and_key():
    """A transition that writes NaN into the state (here a deterministic second key) left NaN
    filtering means beside a finite evidence; now the step and the key are named."""

    class Blowup(AR1):
        def step(self, state, y=None):
            super().step(state, y)
            state["v"] = state["x"] / (0.0 if self.t == 3 else 1.0) * 0.0  # 0/0 at step 2

    with pytest.raises(ValueError, match=r"at time step 2: the filtering mean of state\['v'\] is not finite"):
        SMC(Blowup(), num_particles=10).run(_ys(5))


def test_paper_model_with_guide_and_checks_still_matches_kalman():
    """The new checks leave a correct model's numbers alone: a ``PyroModule`` model (its
    ``theta`` a ``PyroParam`` attribute, its step counter a plain attribute) against Kalman."""
    theta = torch.tensor([0.5, 0.7])
    _, ys = simulate(theta, 20, seed=0)
    smc = SMC(DiagLinearGaussian(theta), num_particles=200, num_filters=20).run(ys)
    log_z = smc.log_evidence.detach()
    exact = kalman_log_evidence(theta, ys)
    assert abs(float(log_z.mean() - exact)) < MC_SIGMAS * float(log_z.std()) / math.sqrt(20) + 0.05


def test_smcelbo_reports_collapsed_weights_once():
    """An SVI loop whose weights collapse gets one warning, not one per step."""
    ys = _ys(20)
    elbo = SMCELBO(num_particles=100)
    with pytest.warns(ParticleDegeneracyWarning, match="SMCELBO reports this for its first SVI step only") as record:
        for _ in range(3):
            elbo.loss(AR1(obs_sd=1e-6), None, ys)
    assert sum(issubclass(r.category, ParticleDegeneracyWarning) for r in record) == 1


class _PriorInitGuide:
    """A guide whose ``init`` draws the first state from a fixed prior and whose ``step`` alone
    reads a trainable parameter (the shape of most hand-written proposals)."""

    def init(self, state):
        pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        gain = pyro.param("gain", torch.tensor(0.5))
        pyro.sample("x", dist.Normal(state["x"] + gain * (y - state["x"]), 1.0))


class _PriorInitModel:
    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)


def test_stop_gradient_warns_about_a_guide_whose_init_reads_no_parameter():
    """Before: the check was settled by the first step at which the guide sampled anything, its
    ``init``; that step read no parameter, so a guide trained with ``stop_gradient`` (exactly zero
    gradient) was never warned about."""
    ys = _ys(10)
    with pytest.warns(UserWarning, match="gives the guide's"):
        SMC(_PriorInitModel(), _PriorInitGuide(), num_particles=20, resampler=SystematicResampler(gradient="stop_gradient")).run(ys)


def test_smcelbo_reports_each_warning_once_over_an_svi_loop():
    """Before: SMCELBO re-emitted every run's warnings through ``warn_explicit``, which bypasses
    Python's once-per-location filter, so an SVI loop repeated the same warning at every step
    (tutorial 06: 400 copies of the stop-gradient guide warning in a 400-step fit). Now: one copy
    of each message, and the first run's Sinkhorn warning and summary only."""
    ys = _ys(20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        guided = SMCELBO(num_particles=20, resampler=SystematicResampler(gradient="stop_gradient"))
        sinkhorn = SMCELBO(num_particles=20, resampler=OTResampler(0.01, max_iter=3))
        for _ in range(4):
            guided.differentiable_loss(_PriorInitModel(), _PriorInitGuide(), ys)  # as SVI.step does
            sinkhorn.loss(_PriorInitModel(), None, ys)
    guide_warnings = [r for r in caught if "gives the guide's" in str(r.message)]
    solver_warnings = [r for r in caught if issubclass(r.category, SinkhornConvergenceWarning)]
    assert len(guide_warnings) == 1
    assert len(solver_warnings) == 2 and "SMCELBO reports this for its first SVI step only" in str(solver_warnings[-1].message)
    # an "error" filter still stops the loop at the first one
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        with pytest.raises(SinkhornConvergenceWarning):
            SMCELBO(num_particles=20, resampler=OTResampler(0.01, max_iter=3)).loss(_PriorInitModel(), None, ys)


@pytest.mark.parametrize("case", ["bigger_than_event", "scalar_into_event", "bigger_than_plate", "scalar_into_plate"])
def test_an_observation_that_does_not_fit_its_site_is_an_error(case):
    """Before (found by the property suite): Pyro broadcast the observation up, so a (2,) value
    of a one-coordinate site scored two observations of it, and a scalar of a 2-d site scored one
    number twice, both with a finite, wrong log Z. Observations that broadcast *down* against the
    particles (a (2,) value of an (N, 2) site) stay fine."""

    class Model:
        def __init__(self, dim, plate):
            self.dim, self.plate = dim, plate

        def init(self, state):
            self.t = 0

        def step(self, state, y=None):
            state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(torch.zeros(self.dim), 1.0).to_event(1))
            if self.plate:
                with pyro.plate("obs", self.dim, dim=-1):
                    pyro.sample(f"y_{self.t}", dist.Normal(state["x"].squeeze(-2), 1.0, validate_args=False), obs=y)
            else:
                pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 1.0, validate_args=False).to_event(1), obs=y)
            self.t += 1

    dim, ys, plate = {
        "bigger_than_event": (1, torch.zeros(3, 2), False),
        "scalar_into_event": (2, torch.zeros(3), False),
        "bigger_than_plate": (1, torch.zeros(3, 2), True),
        "scalar_into_plate": (2, torch.zeros(3), True),
    }[case]
    with pytest.raises(ValueError, match=r"the observation of site 'y_0' at time step 0 has shape .* which does not fit the site"):
        SMC(Model(dim, plate), num_particles=10, max_plate_nesting=int(plate)).run(ys)
    fitting = torch.zeros(3, 1) if dim == 1 else torch.zeros(3, 2)
    assert torch.isfinite(SMC(Model(dim, plate), num_particles=10, max_plate_nesting=int(plate)).run(fitting).log_evidence).all()


class _ScalarWalk:
    def init(self, state):
        pass

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state.get("x", torch.zeros(())), 1.0))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


@pytest.mark.parametrize("num_particles", [2, 3, 10])
def test_a_vector_series_on_a_scalar_model_is_refused_whatever_the_particle_count(num_particles):
    """A (T, 2) series on a scalar site was refused at N = 10 but passed at N = 2, where the
    observation lines up with the particle dim (one value per particle, silently; PMMH and SMC2
    with 2 particles too). A step's slice of a series carries no particle dim: now refused."""
    with pytest.raises(ValueError, match=r"shape \(2,\), which does not fit the site"):
        SMC(_ScalarWalk(), num_particles=num_particles).run(torch.randn(5, 2))
    # A batch of sequences passes (B, 1, ...) by design: one row per filter.
    SMC(_ScalarWalk(), num_particles=num_particles, num_filters=2).run(torch.randn(2, 5), batched=True)


def test_one_step_at_which_most_filters_collapse_is_warned_about():
    """An observation far in the tail of the prediction collapses every filter at that step: log Z
    then rests on one particle (82 nats low on a two-sensor model) and the run-level rule (a fifth
    of the steps) stayed silent. A clean run of the same model says nothing."""
    g = torch.Generator().manual_seed(0)
    ys = torch.randn(40, generator=g).cumsum(0)
    ys_outlier = ys.clone()
    ys_outlier[20] += 8.0
    with pytest.warns(ParticleDegeneracyWarning, match="at time step 20 the weights of 20 of 20 filters collapsed"):
        SMC(_ScalarWalkSharp(), num_particles=100, num_filters=20).run(ys_outlier)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParticleDegeneracyWarning)
        SMC(_ScalarWalkSharp(0.5), num_particles=100, num_filters=20).run(ys)


class _ScalarWalkSharp:
    def __init__(self, noise=0.3):
        self.noise = noise

    def init(self, state):
        pass

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state.get("x", torch.zeros(())), 1.0))
        pyro.sample("y", dist.Normal(state["x"], self.noise), obs=y)


def test_steps_taken_one_by_one_are_checked_when_the_evidence_is_read():
    """Before: a loop of ``step`` calls was never checked, so the collapsed filter of the test
    above gave its log Z (-8e9) in silence. Now reading ``log_evidence`` (or ``result``) checks
    the steps taken so far, and warns once per run however often it is read; ``init`` starts a
    new run. A healthy manual loop stays silent."""
    ys = _ys(20)
    for read_every_step in (False, True):
        smc = SMC(AR1(obs_sd=1e-6), num_particles=100)
        # Read after each step, the first step's collapse is reported at once (the one-step rule).
        expected = r"at time step 0 the weights of the filter" if read_every_step else r"ESS < 2 of 100\) at 20 of 20 steps"
        with pytest.warns(ParticleDegeneracyWarning, match=expected) as record:
            smc.init()
            for y in ys:
                smc.step(y)
                if read_every_step:
                    _ = smc.log_evidence
            _ = smc.log_evidence
            _ = smc.result
        assert sum(issubclass(r.category, ParticleDegeneracyWarning) for r in record) == 1
        # The warning points at the user's line, not into the engine.
        assert record[0].filename == __file__
    with pytest.warns(ParticleDegeneracyWarning):
        smc.init()
        for y in ys:
            smc.step(y)
        _ = smc.result
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParticleDegeneracyWarning)
        smc = SMC(AR1(), num_particles=100).init()
        for y in ys:
            smc.step(y)
            _ = smc.log_evidence
        # After run() (which checks at its end) a read adds no second warning.
        smc = SMC(AR1(), num_particles=100).run(ys)
        _ = smc.log_evidence


def test_degeneracy_monitor_fed_step_by_step_says_what_it_says_for_the_whole_history():
    """The tally of :class:`DegeneracyMonitor` gives the same verdict, counts and first steps
    whether the ESS history arrives at once or a step at a time."""
    g = torch.Generator().manual_seed(3)
    ess = 2 + 98 * torch.rand(30, 4, generator=g)
    ess[[3, 9, 11, 17, 25, 28], 2] = 1.5  # filter 2: 6 of 30 steps, first at step 3
    ess[[5, 6], 1] = 1.1
    whole, parts = DegeneracyMonitor(100), DegeneracyMonitor(100)
    whole.add(ess)
    for t in range(30):
        parts.add(ess[t : t + 1])
    assert whole.message() == parts.message()
    assert "at 6 of 30 steps in filter 2, first at time step 3" in whole.message()
    ess[:, :] = 50.0
    ess[12, :3] = 1.2  # three of four filters at one step
    whole, parts = DegeneracyMonitor(100), DegeneracyMonitor(100)
    whole.add(ess)
    for t in range(0, 30, 7):
        parts.add(ess[t : t + 7])
    assert whole.message() == parts.message()
    assert "at time step 12 the weights of 3 of 4 filters collapsed" in whole.message()
    assert DegeneracyMonitor(10).message() is None
