"""A latent site the model draws itself under ``poutine.scale``/``poutine.mask``/``Distribution.mask``.

Its density cancels in the importance weight only when the site is neither scaled nor masked;
otherwise the scaled, masked density less the one it was drawn from stays in the weight. The
oracle: a scale ``s`` on a Gaussian transition ``N(a x, q)`` is the transition ``N(a x, q / s)`` times
the constant ``(2 pi q / s)^(1/2) (2 pi q)^(-s/2)`` per step, so the evidence is a Kalman filter's.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import SystematicResampler
from tests.tolerances import MC_SIGMAS

A, Q, R = 0.8, 0.5, 0.3


class _ScaledTransition:
    def __init__(self, scale, a=A):
        self.scale, self.a = scale, a

    def init(self, state):
        state["x"] = pyro.sample("x0", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        with poutine.scale(scale=self.scale):
            x = pyro.sample("x", dist.Normal(self.a * state["x"], math.sqrt(Q)))
        pyro.sample("y", dist.Normal(x, math.sqrt(R)), obs=y)
        state["x"] = x


class _MaskedTransition(_ScaledTransition):
    def step(self, state, y=None):
        x = pyro.sample("x", dist.Normal(A * state["x"], math.sqrt(Q)).mask(False))
        pyro.sample("y", dist.Normal(x, math.sqrt(R)), obs=y)
        state["x"] = x


def _scaled_log_evidence(ys, s, a=A):
    """The scaled model's log-evidence, differentiable in ``a``."""
    one = torch.ones(1, 1)
    ssm = LinearGaussianSSM(a * one, Q / s * one, one, R * one, torch.zeros(1), (a**2 + Q / s) * one)
    return ssm.log_evidence(ys.unsqueeze(-1)) + len(ys) * ((1 - s) / 2 * math.log(2 * math.pi * Q) - 0.5 * math.log(s))


@pytest.mark.parametrize("compile", [None, False])
@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_a_scaled_transition_of_a_bootstrap_filter_targets_the_scaled_model(scale, compile):
    """Before: the bootstrap filter dropped the scale (log Z of the unscaled model, -29.5 where the
    scaled model's is -17.1 at s = 0.5). Now Z-hat is unbiased for the scaled model's evidence
    (ratio 1 within 5 Monte Carlo standard errors), on the handlers and compiled alike."""
    pyro.set_rng_seed(0)
    T, B = 10, 200
    ys = torch.randn(T, generator=torch.Generator().manual_seed(3)).cumsum(0) * 0.5
    exact = float(_scaled_log_evidence(ys, scale))
    with torch.no_grad():
        log_z = SMC(_ScaledTransition(scale), num_particles=500, num_filters=B, compile=compile).run(ys).log_evidence
    ratio = (log_z - exact).exp()
    assert abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(B)
    assert abs(float(log_z.mean()) - exact) < 1.0  # the unscaled model's evidence is 4-8 nats away


def test_a_masked_transition_is_left_out_of_the_target():
    """``Distribution.mask(False)`` on the transition leaves ``prod_t g(y_t | x_t)`` with a flat
    transition, whose evidence is 1 per step: Z-hat is unbiased for ``Z = 1``. Before, the mask was
    dropped and the filter returned the unmasked model's evidence (log Z -29.5)."""
    pyro.set_rng_seed(1)
    T, B = 5, 400
    ys = torch.randn(T, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        log_z = SMC(_MaskedTransition(1.0), num_particles=2000, num_filters=B).run(ys).log_evidence
    ratio = log_z.exp()
    assert abs(float(ratio.mean()) - 1) < MC_SIGMAS * float(ratio.std()) / math.sqrt(B)


def test_the_stop_gradient_score_of_a_scaled_transition_is_unbiased():
    """The Fisher-identity estimator draws the transition from its unscaled density, so its score
    term is that density's, not the scaled one: ``E[(Z_hat / Z) G]`` equals the scaled model's
    exact score ``d log Z / d a`` within 5 standard errors (one ``a`` per filter)."""
    pyro.set_rng_seed(2)
    T, B, s = 8, 400, 0.5
    ys = torch.randn(T, generator=torch.Generator().manual_seed(5)).cumsum(0) * 0.5
    a = torch.full((B, 1), A).requires_grad_()
    resampler = SystematicResampler(gradient="stop_gradient")
    log_z = SMC(_ScaledTransition(s, a), num_particles=300, num_filters=B, resampler=resampler).run(ys).log_evidence
    (grads,) = torch.autograd.grad(log_z.sum(), a)
    a0 = torch.tensor(A).requires_grad_()
    exact = _scaled_log_evidence(ys, s, a0)
    (score,) = torch.autograd.grad(exact, a0)
    samples = (log_z.detach() - exact.detach()).exp() * grads.reshape(-1)
    assert abs(float(samples.mean() - score)) < MC_SIGMAS * float(samples.std()) / math.sqrt(B)
