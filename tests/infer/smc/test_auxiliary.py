"""The auxiliary particle filter (``SMC(auxiliary=True)``) against Kalman on a linear-Gaussian model:
filtering means, the unbiasedness of the evidence on the natural scale, missing observations,
batches of sequences, the compiled step, checkpoints, records and the look-ahead's errors."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroParam

from pyro_smc import SMC
from pyro_smc.infer.smc.compiled import CompileFallbackWarning
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import OTResampler, SystematicResampler
from tests.tolerances import MC_SIGMAS


class LookAheadLGSSM(LinearGaussianSSM):
    """The linear-Gaussian model with a look-ahead: the exact predictive ``p(y_t | x_{t-1})``
    (``inflate=1``) or a crude one, its covariance inflated."""

    inflate = 1.0

    def look_ahead(self, state, y):
        mean = state["x"] @ (self.C @ self.A).T
        cov = self.inflate * (self.C @ self.Q @ self.C.T) + self.R
        return dist.MultivariateNormal(mean, cov).log_prob(y)


class CrudeLGSSM(LookAheadLGSSM):
    inflate = 4.0


class FullyAdapted:
    """The locally optimal proposal ``p(x_t | x_{t-1}, y_t)`` and the exact look-ahead: every
    second-stage weight is the same."""

    def __init__(self, ssm):
        self.ssm = ssm

    def init(self, state):
        self.t = 0

    def _posterior(self, mean, cov, y):
        C, R = self.ssm.C, self.ssm.R
        gain = cov @ C.T @ torch.linalg.inv(C @ cov @ C.T + R)
        return mean + (y - mean @ C.T) @ gain.T, cov - gain @ C @ cov

    def step(self, state, y):
        ssm = self.ssm
        if "x" in state:
            mean, cov = state["x"] @ ssm.A.T, ssm.Q
        else:
            mean, cov = ssm.init_mean, ssm.init_cov
        loc, cov = self._posterior(mean, cov, y)
        pyro.sample(f"x_{self.t}", dist.MultivariateNormal(loc, cov))
        self.t += 1

    def look_ahead(self, state, y):
        return LookAheadLGSSM.look_ahead(self.ssm, state, y)


def _ssm(cls=LookAheadLGSSM, d=2):
    eye = torch.eye(d)
    return cls(0.8 * eye, 0.5 * eye, eye, 0.5 * eye, torch.zeros(d), eye)


def _data(ssm, T, seed=0):
    torch.manual_seed(seed)
    return ssm.simulate(T)[1]


def _mean_within(values, truth, extra=0.0):
    """|mean - truth| < MC_SIGMAS sd / sqrt(n) (+ extra) entrywise, values ``(n, ...)``."""
    n = values.shape[0]
    bound = MC_SIGMAS * values.std(0) / math.sqrt(n) + extra
    return bool(((values.mean(0) - truth).abs() < bound).all())


CASES = {
    "exact": (LookAheadLGSSM, False),
    "crude": (CrudeLGSSM, False),
    "fully_adapted": (LookAheadLGSSM, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_filtering_means_match_kalman(case):
    cls, adapted = CASES[case]
    ssm = _ssm(cls)
    ys = _data(ssm, 12)
    guide = FullyAdapted(ssm) if adapted else None
    smc = SMC(ssm, guide, num_particles=400, num_filters=30, auxiliary=True).run(ys)
    means = smc.filtering_means["x"].transpose(0, 1)  # (B, T, d)
    # The particle filter's bias is O(1/N): a tenth of the posterior sd at N = 400 is generous.
    assert _mean_within(means, ssm.kalman_filter(ys).means, extra=0.02)


@pytest.mark.filterwarnings("ignore::pyro_smc.infer.smc.checks.ParticleDegeneracyWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_evidence_is_unbiased_on_the_natural_scale(case):
    cls, adapted = CASES[case]
    ssm = _ssm(cls)
    ys = _data(ssm, 8, seed=1)
    ys[3] = float("nan")  # predict-only: eta = 1
    ys[5, 0] = float("nan")  # partly missing: the model proposes, eta = 1
    guide = FullyAdapted(ssm) if adapted else None
    torch.manual_seed(2)
    smc = SMC(ssm, guide, num_particles=16, num_filters=3000, auxiliary=True).run(ys)
    ratio = (smc.log_evidence - ssm.log_evidence(ys)).exp()  # Z_hat / p(y), mean 1
    assert _mean_within(ratio.unsqueeze(-1), torch.ones(1))


def test_fully_adapted_second_stage_weights_are_equal():
    ssm = _ssm()
    ys = _data(ssm, 10)
    smc = SMC(ssm, FullyAdapted(ssm), num_particles=50, num_filters=2, auxiliary=True, ess_threshold=1.0).run(ys)
    # After a first-stage resampling every particle's weight is p(y_t | x_{t-1}) / eta = 1.
    resampled_before = smc.resampled[:-1]
    assert bool(resampled_before.all())
    assert torch.allclose(smc.ess_history[1:], torch.full_like(smc.ess_history[1:], 50.0))


def test_fully_adapted_evidence_has_lower_variance_than_bootstrap():
    ssm = _ssm()
    ys = _data(ssm, 10)
    boot = SMC(ssm, num_particles=32, num_filters=400).run(ys).log_evidence
    apf = SMC(ssm, FullyAdapted(ssm), num_particles=32, num_filters=400, auxiliary=True).run(ys).log_evidence
    # Variance ratio of two sample variances of 400 draws: a factor of 2 is ~7 standard errors.
    assert float(apf.var()) < 0.5 * float(boot.var())


def test_batches_of_sequences_with_lengths():
    ssm = _ssm()
    a, b = _data(ssm, 8, seed=3), _data(ssm, 8, seed=4)
    n = 1000
    ys = torch.cat([a.expand(n, 8, 2), b.expand(n, 8, 2)])
    lengths = torch.tensor([8] * n + [5] * n)
    torch.manual_seed(5)
    smc = SMC(ssm, num_particles=16, num_filters=2 * n, auxiliary=True).run(ys, lengths=lengths, batched=True)
    ratio_a = (smc.log_evidence[:n] - ssm.log_evidence(a)).exp()
    ratio_b = (smc.log_evidence[n:] - ssm.log_evidence(b[:5])).exp()
    assert _mean_within(ratio_a.unsqueeze(-1), torch.ones(1))
    assert _mean_within(ratio_b.unsqueeze(-1), torch.ones(1))


def test_records_history_and_smoothers():
    ssm = _ssm()
    ys = _data(ssm, 10)
    smc = SMC(ssm, num_particles=300, auxiliary=True, store_history=True, ess_threshold=1.0).run(ys)
    # A step's flag says whether the particles it weighed were resampled (by the next step).
    assert bool(smc.resampled[:-1].all()) and not bool(smc.resampled[-1].any())
    assert smc.records[0].ancestors.shape == (1, 300)
    truth = ssm.rts_smoother(ys).means
    draws = smc.smooth(200, method="ffbs")["x"][:, :, 0]  # (S, T, d)
    # The smoothing sd is about 0.4 and the draws' mean errs by about 0.1 (N = 300): 0.5 is wide.
    assert draws.shape == (200, 10, 2) and bool(((draws.mean(0) - truth).abs() < 0.5).all())
    # A genealogy draw is an ancestral line: each state is a stored particle of its step
    # (its mean is too degenerate at early steps for a tolerance).
    lines = smc.smooth(20, method="genealogy")["x"][:, :, 0]
    stored = [record["state"]["x"][0] for record in smc._history]
    for t in range(10):
        assert bool((lines[:, t].unsqueeze(1) == stored[t].unsqueeze(0)).all(-1).any(-1).all())
    total = smc.log_evidence_increments.sum(0)
    assert torch.allclose(total, smc.log_evidence)


def test_ot_resampler_recomputes_the_look_ahead():
    ssm = _ssm()
    ys = _data(ssm, 6)
    calls = []
    original = LookAheadLGSSM.look_ahead

    class Counting(LookAheadLGSSM):
        def look_ahead(self, state, y):
            calls.append(1)
            return original(self, state, y)

    counted = Counting(ssm.A, ssm.Q, ssm.C, ssm.R, ssm.init_mean, ssm.init_cov)
    smc = SMC(counted, num_particles=64, auxiliary=True, resampler=OTResampler(), ess_threshold=1.0).run(ys)
    assert len(calls) == 2 * 5  # before and after each transport (steps 1..5)
    assert abs(float(smc.log_evidence - ssm.log_evidence(ys))) < 3.0


def test_stop_gradient_estimator_close_to_kalman_gradient():
    eye = torch.eye(1)
    ys = _data(_ssm(d=1), 10, seed=6)
    a = torch.tensor(0.8, requires_grad=True)
    ssm = LookAheadLGSSM(0.8 * eye, 0.5 * eye, eye, 0.5 * eye, torch.zeros(1), eye)
    ssm.A = a * eye
    exact = torch.autograd.grad(ssm.log_evidence(ys), a)[0]
    ssm.A = a * eye
    smc = SMC(ssm, num_particles=200, num_filters=40, auxiliary=True, resampler=SystematicResampler(gradient="stop_gradient"))
    grads = torch.stack([torch.autograd.grad(z, a, retain_graph=True)[0] for z in smc.run(ys).log_evidence])
    # The Fisher-identity estimator's bias is O(T / N); 0.1 |exact| covers it at T = 10, N = 200.
    assert _mean_within(grads.unsqueeze(-1), exact.reshape(1), extra=0.1 * float(exact.abs()))


class AR(PyroModule):
    def __init__(self):
        super().__init__()
        self.theta = PyroParam(torch.tensor(0.7))

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.theta * state["x"], 1.0))
        pyro.sample("y", dist.Normal(state["x"], 0.5), obs=y)

    def look_ahead(self, state, y):
        return dist.Normal(self.theta * state["x"], math.sqrt(1.25)).log_prob(y)


def _ar_run(compile):
    pyro.clear_param_store()
    torch.manual_seed(1)
    ys = torch.randn(20)
    smc = SMC(AR(), num_particles=64, num_filters=3, auxiliary=True, compile=compile).run(ys)
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    return smc, torch.autograd.grad(smc.log_evidence.sum(), params)


def test_compiled_step_equals_handler_path():
    plain, g_plain = _ar_run(False)
    fast, g_fast = _ar_run(True)
    assert fast.compile_status is None and fast._compiled.compiled_steps > 0
    assert torch.allclose(fast.log_evidence, plain.log_evidence, rtol=0, atol=1e-12)
    assert torch.equal(fast.resampled, plain.resampled)
    assert torch.allclose(g_fast[0], g_plain[0], rtol=1e-10, atol=1e-12)


def test_checkpoint_continues_bit_identically():
    ssm = _ssm()
    ys = _data(ssm, 10)
    torch.manual_seed(7)
    a = SMC(ssm, num_particles=50, auxiliary=True).run(ys[:5])
    saved = a.state_dict()
    for y in ys[5:]:
        a.step(y)
    b = SMC(ssm, num_particles=50, auxiliary=True)
    b.load_state_dict(saved)
    for y in ys[5:]:
        b.step(y)
    assert torch.equal(a.log_evidence, b.log_evidence)


class BadLookAhead(LinearGaussianSSM):
    out = "shape"

    def look_ahead(self, state, y):
        x = state["x"]
        if self.out == "shape":
            return x  # (N, d): one value per coordinate
        if self.out == "nan":
            return torch.full(x.shape[:-1], float("nan"))
        if self.out == "list":
            return [0.0] * x.shape[0]
        if self.out == "samples":
            return pyro.sample("z", dist.Normal(torch.zeros(x.shape[:-1]), 1.0))
        return torch.full(x.shape[:-1], -float("inf"))


@pytest.mark.parametrize(
    "out, message",
    [("shape", "returned shape"), ("nan", "NaN"), ("list", "floating-point tensor"), ("samples", "sampled a site"), ("zero", "every particle")],
)
def test_bad_look_ahead_output_is_an_error(out, message):
    eye = torch.eye(2)
    ssm = BadLookAhead(0.8 * eye, eye, eye, eye, torch.zeros(2), eye)
    ssm.out = out
    with pytest.raises(ValueError, match=message):
        SMC(ssm, num_particles=10, auxiliary=True).run(torch.zeros(3, 2))


def test_options_are_checked():
    eye = torch.eye(2)
    plain = LinearGaussianSSM(eye, eye, eye, eye, torch.zeros(2), eye)
    with pytest.raises(ValueError, match="look_ahead"):
        SMC(plain, num_particles=10, auxiliary=True)
    with pytest.raises(ValueError, match="auxiliary"):
        SMC(plain, num_particles=10, auxiliary="yes")
    with pytest.raises(ValueError, match="marginal_stop_gradient"):
        SMC(_ssm(), num_particles=10, auxiliary=True, resampler=SystematicResampler(gradient="marginal_stop_gradient"))


def test_compile_true_falls_back_with_a_warning_for_a_model_that_reads_its_counter_as_a_number():
    class Numbered(LookAheadLGSSM):
        def step(self, state, y=None):
            if self._t > 10**6:  # the counter read as a number: a recording would freeze it
                raise RuntimeError("too long")
            return super().step(state, y)

    ssm = _ssm(Numbered)
    with pytest.warns(CompileFallbackWarning, match="self._t is read as a number"):
        smc = SMC(ssm, num_particles=10, auxiliary=True, compile=True).run(_data(ssm, 6))
    assert smc.compile_status is not None


def test_a_model_that_names_its_sites_by_a_step_counter_is_compiled_with_its_look_ahead():
    """``LinearGaussianSSM`` names its sites ``x_{t}`` by ``self._t``: each replayed step advances
    the counter itself, with the same numbers as the handler path."""
    runs = []
    for compile in (False, None):
        ssm = _ssm()
        ys = _data(ssm, 12)
        torch.manual_seed(3)
        runs.append(SMC(ssm, num_particles=32, num_filters=2, auxiliary=True, compile=compile).run(ys))
    plain, fast = runs
    assert fast.compile_status is None and fast._compiled.compiled_steps > 0
    assert torch.allclose(fast.log_evidence, plain.log_evidence, rtol=0, atol=1e-12)
    assert fast.model._t == plain.model._t == 12
