"""The gradient of the EP evidence (and of the EP marginals) by implicit differentiation at the
fixed point, against the Kalman score, the unrolled gradient and finite differences."""

import pyro
import pytest
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from pyro_smc import EPSmoother
from pyro_smc.gp import MultiOutputGP
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM


def _saved_bytes(fn):
    """``fn()`` and the bytes autograd saved for its backward pass (its graph's memory)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _directional_checks(f, params, grads, seed=0, num_directions=2, h=1e-5, rtol=1e-5):
    """Central differences of the scalar ``f()`` along random directions of all ``params`` at
    once, against ``grads``' directional derivatives (two evaluations per direction, not per entry)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_directions):
        v = [torch.randn(p.shape, generator=g) for p in params]
        with torch.no_grad():
            for p, d in zip(params, v):
                p.add_(h * d)
            up = float(f())
            for p, d in zip(params, v):
                p.sub_(2 * h * d)
            down = float(f())
            for p, d in zip(params, v):
                p.add_(h * d)
        fd = (up - down) / (2 * h)
        ours = float(sum((a * d).sum() for a, d in zip(grads, v)))
        assert abs(ours - fd) <= rtol * max(1.0, abs(fd)), (ours, fd)


# --- linear-Gaussian: the EP evidence is the Kalman evidence, and so is its gradient ----------
def _linear_parameters(seed, d=2, e=2):
    g = torch.Generator().manual_seed(seed)
    A = (0.3 * torch.randn(d, d, generator=g) + 0.6 * torch.eye(d)).requires_grad_()
    L = (0.5 * torch.eye(d) + 0.1 * torch.randn(d, d, generator=g).tril()).requires_grad_()
    C = torch.randn(e, d, generator=g).requires_grad_()
    r = torch.tensor(0.3).requires_grad_()
    m0 = torch.randn(d, generator=g).requires_grad_()
    return A, L, C, r, m0


def _linear(A, L, C, r, m0):
    d, e = A.shape[0], C.shape[0]
    return LinearGaussianSSM(A, L @ L.T + 0.1 * torch.eye(d), C, r * torch.eye(e), m0, torch.eye(d))


@pytest.mark.parametrize(
    "gradient, max_iter, power, damping",
    [("implicit", 30, 1.0, 1.0), ("implicit", 60, 0.7, 1.0), ("implicit", 60, 1.0, 0.5), ("implicit", 60, 0.5, 0.7),
     ("unroll", 1, 1.0, 1.0), ("unroll", 3, 0.7, 0.5), ("unroll", 10, 0.7, 1.0), ("implicit", 1, 1.0, 1.0)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_linear_gaussian_evidence_and_gradient_equal_kalman(gradient, max_iter, power, damping, seed):
    params = _linear_parameters(seed)
    with torch.no_grad():
        _, ys = _linear(*params).simulate(12, generator=torch.Generator().manual_seed(seed + 10))
    ys[4] = float("nan")  # a step without data
    ys[9, 0] = float("nan")  # a partly observed step
    out = EPSmoother(_linear(*params), projection="unscented", max_iter=max_iter, power=power, damping=damping, tol=1e-12, gradient=gradient).smooth(ys)
    assert out.converged or gradient == "unroll" or max_iter == 1
    exact = _linear(*params).log_evidence(ys)
    assert abs(float((out.log_evidence - exact).detach())) < 1e-8
    ours = torch.autograd.grad(out.log_evidence, params)
    score = torch.autograd.grad(exact, params)
    for a, b in zip(ours, score):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-8), (a, b)


def test_linear_gaussian_marginals_gradient_equals_rts():
    # Not only the evidence: the smoothed means and covariances carry the implicit gradient.
    params = _linear_parameters(2)
    with torch.no_grad():
        _, ys = _linear(*params).simulate(10, generator=torch.Generator().manual_seed(3))
    out = EPSmoother(_linear(*params), max_iter=50, damping=0.5, tol=1e-12).smooth(ys)
    rts = _linear(*params).rts_smoother(ys)
    w = torch.linspace(-1, 1, out.means.numel()).reshape(out.means.shape)
    ours = torch.autograd.grad((w * out.means).sum() + out.covariances.sum(), params)
    exact = torch.autograd.grad((w * rts.means).sum() + rts.covariances.sum(), params)
    for a, b in zip(ours, exact):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-8)


def test_power_ep_is_exact_on_a_linear_gaussian_model():
    # Power EP updates the one-step factors of the chain (docs/math/ep.md#power-ep), which are
    # Gaussian here: every power gives the RTS smoother, its means and covariances, from the
    # first sweep on (tests/infer/gaussian/test_ep_power.py has the nonlinear cases).
    params = [p.detach() for p in _linear_parameters(2)]
    _, ys = _linear(*params).simulate(20, generator=torch.Generator().manual_seed(3))
    rts = _linear(*params).rts_smoother(ys)
    out = EPSmoother(_linear(*params), max_iter=100, power=0.7, tol=1e-12).smooth(ys)
    assert out.converged and torch.allclose(out.means, rts.means, atol=1e-10)
    assert torch.allclose(out.first_sweep.covariances, rts.covariances, atol=1e-10)
    assert torch.allclose(out.covariances, rts.covariances, atol=1e-10)


# --- nonlinear models: implicit = unrolled at convergence = finite differences ---------------
class _Drift(PyroModule):
    """``x_{t+1} = a x + b sin(x)`` with learnable ``a``, ``b``."""

    def __init__(self, a, b):
        super().__init__()
        self.a = PyroParam(torch.tensor(a))
        self.b = PyroParam(torch.tensor(b))

    def forward(self, x):
        return self.a * x + self.b * torch.sin(x)


class _Pendulum(PyroModule):
    def __init__(self, g, dt=0.05):
        super().__init__()
        self.g = PyroParam(torch.tensor(g), constraints.positive)
        self.dt = dt

    def forward(self, x):
        return torch.stack([x[..., 0] + self.dt * x[..., 1], x[..., 1] - self.g * self.dt * torch.sin(x[..., 0])], -1)


def _scalar_model():
    one = torch.eye(1)
    ssm = NonlinearGaussianSSM(_Drift(0.8, 1.0), 0.5 * one, lambda x: x + 0.2 * x**3 / (1 + x**2), 0.3 * one, torch.zeros(1), one)
    ssm.transition_cov = PyroParam(0.5 * one, constraints.positive_definite)
    return ssm


def _pendulum_model():
    dt = 0.05
    q = 0.5 * torch.tensor([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]])
    ssm = NonlinearGaussianSSM(_Pendulum(9.81, dt), q, lambda x: torch.sin(x[..., :1]), 0.1 * torch.eye(1), torch.tensor([1.5, 0.0]), 0.1 * torch.eye(2))
    ssm.observation_cov = PyroParam(0.1 * torch.eye(1), constraints.positive_definite)
    return ssm


# Checked on seeds 0-3 (T = 10 and 12: implicit and unrolled agreed to 1.1e-10 relative at worst);
# the default run takes one seed per case. The pendulum under linearisation runs in the full run
# only: the 2-d linearisation's gradient is checked by test_projections_linearisation_grad.py, and
# the implicit gradient is the same code for every projection (the scalar cases cover both).
CASES = [
    (_scalar_model, "unscented", 1.0, 1.0, 0),
    (_scalar_model, "unscented", 1.0, 0.7, 1),
    (_scalar_model, "linearization", 0.6, 1.0, 2),
    (_pendulum_model, "unscented", 1.0, 1.0, 0),
    pytest.param(_pendulum_model, "linearization", 1.0, 1.0, 1, marks=pytest.mark.slow),
]


def _loss(out):
    # The evidence plus the marginals, so that every output's gradient path is checked.
    w = torch.linspace(-1, 1, out.means.numel()).reshape(out.means.shape)
    return out.log_evidence + (w * out.means).sum() + out.covariances.sum()


@pytest.mark.parametrize("model, projection, power, damping, seed", CASES)
def test_implicit_gradient_equals_unrolled_and_finite_differences(model, projection, power, damping, seed):
    # T = 10: about as many sweeps to converge as at T = 25 (7 to 25 on seeds 0-3), at a third of the cost.
    ssm = model()
    with torch.no_grad():
        _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(seed))
    params = list(ssm.parameters())

    def run(gradient, tol=1e-12):
        return EPSmoother(ssm, projection=projection, max_iter=300, power=power, damping=damping, tol=tol, gradient=gradient).smooth(ys)

    implicit = run("implicit")
    unrolled = run("unroll")
    assert implicit.converged and len(implicit.history) > 2  # a real fixed-point iteration
    assert torch.equal(implicit.means, unrolled.means) and torch.equal(implicit.log_evidence, unrolled.log_evidence)
    g_implicit = torch.autograd.grad(_loss(implicit), params)
    g_unrolled = torch.autograd.grad(_loss(unrolled), params)
    for a, b in zip(g_implicit, g_unrolled):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-8), (a, b)
    # Against finite differences too, for a gradient path cut off in both modes: one random
    # direction over all parameters (a missing term g_i v_i is almost surely not zero) will do.
    _directional_checks(lambda: _loss(run("implicit", tol=1e-13)), params, g_implicit, seed, num_directions=1)


def test_implicit_gradient_memory_does_not_grow_with_the_sweeps():
    """The graph of the implicit gradient is two sweeps, however many EP needs; the unrolled
    one grows linearly. Measured as the bytes autograd saves for backward. On data seeds 0-3
    (T = 10) damping 0.5 takes 33-34 sweeps to the undamped 6-9, and the unrolled graph is about
    twice the linear bound below and 11 times the implicit one."""
    ssm = _scalar_model()
    with torch.no_grad():
        _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))
    measured = {}
    for damping in (1.0, 0.5):
        for gradient in ("implicit", "unroll"):
            smoother = EPSmoother(ssm, projection="unscented", max_iter=500, damping=damping, tol=1e-10, gradient=gradient)
            out, saved = _saved_bytes(lambda s=smoother: s.smooth(ys))
            measured[gradient, damping] = (len(out.history), saved)
    (few, implicit_few), (many, implicit_many) = measured["implicit", 1.0], measured["implicit", 0.5]
    assert many >= 3 * few  # heavy damping: many more sweeps
    assert implicit_many == implicit_few
    unrolled_few, unrolled_many = measured["unroll", 1.0][1], measured["unroll", 0.5][1]
    assert unrolled_many > 0.5 * (many / few) * unrolled_few  # linear in the sweeps
    assert implicit_many < unrolled_many / 5


def test_values_do_not_depend_on_the_gradient_mode_or_grad_mode():
    ssm = _pendulum_model()
    with torch.no_grad():
        _, ys = ssm.simulate(15, generator=torch.Generator().manual_seed(4))
    smoother = EPSmoother(ssm, projection="unscented", max_iter=100, tol=1e-10)
    with_grad = smoother.smooth(ys)
    with torch.no_grad():
        without = smoother.smooth(ys)
    assert with_grad.log_evidence.requires_grad and not without.log_evidence.requires_grad
    for name in ("means", "covariances", "log_evidence", "log_evidence_increments"):
        assert torch.equal(getattr(with_grad, name), getattr(without, name))


def test_a_model_without_parameters_gives_results_without_a_graph():
    one = torch.eye(1)
    ssm = NonlinearGaussianSSM(lambda x: 0.8 * x + torch.sin(x), 0.5 * one, lambda x: x, 0.3 * one, torch.zeros(1), one)
    _, ys = ssm.simulate(10, generator=torch.Generator().manual_seed(0))
    out = EPSmoother(ssm, projection="unscented", max_iter=50).smooth(ys)
    assert not out.log_evidence.requires_grad and not out.means.requires_grad


def test_a_non_converged_run_is_never_differentiated_implicitly():
    ssm = _scalar_model()
    with torch.no_grad():
        _, ys = ssm.simulate(30, generator=torch.Generator().manual_seed(0))
    out = EPSmoother(ssm, projection="unscented", max_iter=2, damping=0.5, tol=1e-12).smooth(ys)
    assert not out.converged and torch.isfinite(out.log_evidence)
    with pytest.raises(RuntimeError, match=r"did not converge in max_iter=2 sweeps.*unroll"):
        out.log_evidence.backward()
    with pytest.raises(RuntimeError, match="did not converge"):
        out.means.sum().backward()
    # The unrolled gradient of the same truncated iteration is well defined.
    out = EPSmoother(ssm, projection="unscented", max_iter=2, damping=0.5, tol=1e-12, gradient="unroll").smooth(ys)
    out.log_evidence.backward()
    assert all(torch.isfinite(p.grad).all() for p in ssm.parameters())


def test_float32_gradient_agrees_with_float64():
    # On data seeds 0-3 the float32 gradients were off by at most 2.5% of the tolerance, at T = 15
    # as at T = 30 (measured): the tolerance is float32's, not the series length's.
    grads = {}
    for dtype in (torch.float64, torch.float32):
        torch.set_default_dtype(dtype)
        # A fresh store per dtype: Pyro's is global by name, so the float32 model would take the
        # float64 model's g, and its map return float64 (refused when the model is built).
        pyro.clear_param_store()
        ssm = _pendulum_model()
        with torch.no_grad():
            _, ys = ssm.simulate(15, generator=torch.Generator().manual_seed(1))
        if dtype == torch.float32:
            ys = grads["ys"].float()
        grads["ys"] = ys
        out = EPSmoother(ssm, projection="unscented", max_iter=100, tol=1e-4 if dtype == torch.float32 else 1e-10).smooth(ys)
        assert out.log_evidence.dtype == dtype
        grads[dtype] = [g.double() for g in torch.autograd.grad(out.log_evidence, list(ssm.parameters()))]
    for a, b in zip(grads[torch.float32], grads[torch.float64]):
        assert torch.allclose(a, b, rtol=2e-3, atol=2e-3), (a, b)


def test_gradient_must_be_a_known_mode():
    with pytest.raises(ValueError, match="gradient must be one of"):
        EPSmoother(_scalar_model(), gradient="adjoint")


# --- GP dynamics: hyperparameters and training targets --------------------------------------
def _gp_model(seed):
    g = torch.Generator().manual_seed(seed)
    X = -3 + 6 * torch.rand(15, 1, generator=g)
    Y = torch.sin(X) * 2 + 0.1 * torch.randn(15, 1, generator=g)
    gp = MultiOutputGP(X, Y, lengthscale=1.0, variance=2.0, noise=0.05)
    gp.Y = torch.nn.Parameter(Y.clone())
    one = torch.eye(1)
    return NonlinearGaussianSSM(gp, 0.1 * one, lambda x: x, 0.2 * one, torch.zeros(1), one)


@pytest.mark.parametrize("seed", [0])  # checked on seeds 0-3 (T = 8: 12-14 sweeps; each parameter's largest gradient > 0.02)
def test_gp_hyperparameter_and_data_gradients_against_finite_differences(seed):
    ssm = _gp_model(seed)
    with torch.no_grad():
        _, ys = ssm.simulate(8, generator=torch.Generator().manual_seed(seed + 5))
    params = list(ssm.parameters())
    names = [n for n, _ in ssm.named_parameters()]
    assert {"transition.lengthscale_unconstrained", "transition.variance_unconstrained", "transition.noise_unconstrained", "transition.Y"} <= set(names)

    def run(tol=1e-12):
        return EPSmoother(ssm, projection="moment_matching", max_iter=200, power=0.8, tol=tol).smooth(ys)

    out = run()
    assert out.converged and len(out.history) > 2
    grads = torch.autograd.grad(_loss(out), params)
    for name, a in zip(names, grads):
        assert a.abs().max() > 1e-6, name  # the old detached GP gave exactly zero here
    # One random direction over all of them (the training targets Y above all: a wrong entry
    # shows almost surely), and each hyperparameter alone, one direction each.
    _directional_checks(lambda: _loss(run(1e-13)), params, grads, seed, num_directions=1)
    for i, name in enumerate(names):
        if name != "transition.Y":
            _directional_checks(lambda: _loss(run(1e-13)), [params[i]], [grads[i]], seed + i, num_directions=1)
