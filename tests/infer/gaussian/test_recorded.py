"""The recorded forward pass (pyro_smc/infer/gaussian/recorded.py): the same answer as the eager
steps (bitwise for the unscented transform), exact on linear models, differentiable, and taken
only when it is faithful, with the reason said otherwise."""

import contextlib
import logging
import math

import pytest
import torch

from pyro_smc.infer import extended_rts_smoother, gaussian_smoother, unscented_kalman_filter, unscented_rts_smoother
from pyro_smc.infer import Linearization, Unscented
from pyro_smc.infer.gaussian.observed import observation_status
from pyro_smc.infer.gaussian.recorded import RECORD_MIN_STEPS, LeanFilter, recording
from pyro_smc.models import LinearGaussianSSM, NonlinearGaussianSSM, time_dependent

T = RECORD_MIN_STEPS + 22  # long enough to be recorded, with room for missing steps


def pendulum(dtype=torch.float64, scale=None):
    """Sarkka's pendulum (2-d state, sin observation), ``scale`` (a tensor) times its process noise."""
    dt = 0.01

    def f(x):
        return torch.stack([x[..., 0] + dt * x[..., 1], x[..., 1] - 9.81 * dt * torch.sin(x[..., 0])], -1)

    q = 0.01 * torch.tensor([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]], dtype=dtype)
    q = q if scale is None else scale * q
    one = torch.eye(1, dtype=dtype)
    return NonlinearGaussianSSM(f, q, lambda x: torch.sin(x[..., :1]), 0.1 * one, torch.tensor([1.5, 0.0], dtype=dtype), 0.1 * torch.eye(2, dtype=dtype))


def data(ssm, steps=T, seed=0):
    _, ys = ssm.simulate(steps, generator=torch.Generator().manual_seed(seed))
    return ys


class Path:
    """The forward pass's path that the runs inside ``with taken() as path:`` logged:
    ``path.last`` is ``"recorded"`` or ``"eager: <why>"`` (``pyro_smc`` logger, ``DEBUG``)."""

    def __init__(self):
        self.paths = []

    @property
    def last(self):
        return self.paths[-1] if self.paths else None


@contextlib.contextmanager
def taken():
    path, log = Path(), logging.getLogger("pyro_smc")

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Gaussian filter: forward pass "):
                path.paths.append(message[len("Gaussian filter: forward pass ") :])

    handler, level = Handler(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def path():
    with taken() as path:
        yield path


def both_paths(engine, ssm, ys):
    """``(recorded result, eager result)``; asserts that the first run was the recorded one."""
    with taken() as path:
        fast = engine(ssm, ys)
        assert path.last == "recorded", path.last
        with recording(False):
            eager = engine(ssm, ys)
        assert path.last == "eager: recording(False)"
    return fast, eager


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("engine", [unscented_kalman_filter, unscented_rts_smoother])
def test_the_recorded_unscented_pass_is_the_eager_pass_bit_for_bit(engine, dtype):
    ssm = pendulum(dtype)
    ys = data(ssm)
    ys[[5, 60, 61]] = math.nan  # missing steps replay the recorded prediction alone
    fast, eager = both_paths(engine, ssm, ys)
    for name in ("means", "covariances", "log_evidence", "log_evidence_increments"):
        assert torch.equal(getattr(fast, name), getattr(eager, name)), name


def test_the_recorded_linearisation_is_the_eager_one_to_rounding():
    # The recorded Jacobian takes f(m) from the copies that give J (one call of f fewer).
    ssm = pendulum()
    fast, eager = both_paths(extended_rts_smoother, ssm, data(ssm))
    assert torch.allclose(fast.means, eager.means, rtol=1e-13, atol=1e-13)
    assert torch.allclose(fast.covariances, eager.covariances, rtol=1e-12, atol=1e-15)
    assert torch.allclose(fast.log_evidence, eager.log_evidence, rtol=1e-13)


@pytest.mark.parametrize("projection", ["unscented", "linearization"])
def test_recorded_passes_are_the_kalman_smoother_on_a_linear_model(projection, path):
    g = torch.Generator().manual_seed(1)
    d, e = 3, 2
    A = 0.9 * torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    C = torch.randn(e, d, generator=g, dtype=torch.float64)
    B = torch.randn(d, d, generator=g, dtype=torch.float64)
    ssm = LinearGaussianSSM(A, 0.1 * B @ B.T + 0.1 * torch.eye(d, dtype=torch.float64), C, 0.5 * torch.eye(e, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64))
    ys = data(ssm, seed=2)
    ys[[0, 40, 41, 42]] = math.nan
    out = gaussian_smoother(ssm, ys, projection)
    assert path.last == "recorded"
    exact = ssm.rts_smoother(ys)
    assert (out.means - exact.means).abs().max() < 1e-10
    assert (out.covariances - exact.covariances).abs().max() < 1e-10
    assert abs(float(out.log_evidence - ssm.log_evidence(ys))) < 1e-10


def test_gradients_through_the_recorded_smoother_are_the_eager_ones_and_pass_gradcheck(path):
    ys = data(pendulum())
    scale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    shift = torch.zeros(1, dtype=torch.float64, requires_grad=True)

    def loss(scale, shift):
        out = unscented_rts_smoother(pendulum(scale=scale), ys + shift)
        return out.log_evidence + out.means[::17].sum() + out.covariances[::23].sum()

    fast = torch.autograd.grad(loss(scale, shift), (scale, shift))
    assert path.last == "recorded"
    with recording(False):
        eager = torch.autograd.grad(loss(scale, shift), (scale, shift))
    assert all(torch.equal(a, b) for a, b in zip(fast, eager))
    assert torch.autograd.gradcheck(loss, (scale, shift))



@pytest.mark.parametrize("projection", [Unscented(), Linearization()])
def test_a_replay_without_a_gradient_hands_back_ordinary_tensors(projection, path):
    # The replay runs in inference mode when nothing is differentiated: none of its tensors may
    # leave it as inference tensors (autograd refuses to save those). With y_0 and y_1 missing,
    # the residuals and factors of the run are the replay's alone, not concatenated to eager ones.
    ssm = pendulum()
    ys = data(ssm)
    ys[:2] = math.nan
    run = LeanFilter.of(ssm, projection).run(ys, ~torch.isnan(ys), observation_status(ys))
    assert path.last == "recorded"
    tensors = [run.means, run.covariances, run.info, *run.predictions, *run.full[1:]]
    assert len(run.full[0]) == T - 2 and not any(x.is_inference() for x in tensors)
    with recording(False):
        eager = LeanFilter.of(ssm, projection).run(ys, ~torch.isnan(ys), observation_status(ys))
    close = torch.equal if isinstance(projection, Unscented) else lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    assert all(close(a, b) for a, b in zip(tensors, [eager.means, eager.covariances, eager.info, *eager.predictions, *eager.full[1:]]))


@pytest.mark.parametrize("engine", [unscented_rts_smoother, extended_rts_smoother])
def test_a_replay_under_no_grad_of_a_model_with_parameters_is_the_eager_pass(engine):
    # Parameters that require grad, under no_grad: recorded, and replayed in inference mode.
    ssm, ys = pendulum(scale=torch.tensor(1.3, dtype=torch.float64, requires_grad=True)), data(pendulum())
    with torch.no_grad():
        fast, eager = both_paths(engine, ssm, ys)
    assert torch.allclose(fast.means, eager.means, rtol=1e-13, atol=1e-13)
    assert torch.allclose(fast.covariances, eager.covariances, rtol=1e-12, atol=1e-15)
    assert not fast.means.requires_grad

def test_a_map_reading_a_parameter_that_requires_grad_runs_eagerly_with_its_gradient(path):
    ys = data(pendulum())
    g = torch.tensor(9.81, dtype=torch.float64, requires_grad=True)
    ssm = pendulum()
    ssm.transition = lambda x: torch.stack([x[..., 0] + 0.01 * x[..., 1], x[..., 1] - g * 0.01 * torch.sin(x[..., 0])], -1)
    out = unscented_rts_smoother(ssm, ys)
    assert path.last.startswith("eager: the step could not be recorded")
    (grad,) = torch.autograd.grad(out.log_evidence, g)
    with torch.no_grad():
        step = 1e-5
        ssm_hi, ssm_lo = pendulum(), pendulum()
        ssm_hi.transition = lambda x: torch.stack([x[..., 0] + 0.01 * x[..., 1], x[..., 1] - (9.81 + step) * 0.01 * torch.sin(x[..., 0])], -1)
        ssm_lo.transition = lambda x: torch.stack([x[..., 0] + 0.01 * x[..., 1], x[..., 1] - (9.81 - step) * 0.01 * torch.sin(x[..., 0])], -1)
        numeric = (unscented_rts_smoother(ssm_hi, ys).log_evidence - unscented_rts_smoother(ssm_lo, ys).log_evidence) / (2 * step)
    assert torch.allclose(grad, numeric, rtol=1e-5)


def test_a_data_dependent_branch_is_not_recorded(path):
    # A trace would keep one side of the branch; TracerWarning sends the run to the eager steps.
    ssm = pendulum()
    base = ssm.transition
    ssm.transition = lambda x: base(x) if bool((x[..., 0] < 10).all()) else -base(x)
    ys = data(pendulum())
    out = unscented_rts_smoother(ssm, ys)
    assert path.last == "eager: tracing met a data-dependent branch (TracerWarning)"
    with recording(False):
        assert torch.equal(out.means, unscented_rts_smoother(ssm, ys).means)


def test_time_dependent_maps_partly_observed_steps_and_short_series_run_eagerly(path):
    ssm = pendulum()
    ys = data(ssm)
    unscented_rts_smoother(ssm, ys[: RECORD_MIN_STEPS - 1])
    assert path.last.startswith("eager: T = ")
    forced = NonlinearGaussianSSM(time_dependent(lambda x, t: ssm.transition(x)), ssm.transition_cov, ssm.observation, ssm.observation_cov, ssm.init_mean, ssm.init_cov)
    assert torch.equal(unscented_rts_smoother(forced, ys).means, unscented_rts_smoother(ssm, ys).means)
    unscented_rts_smoother(forced, ys)
    assert path.last == "eager: a map takes the time index"
    two = NonlinearGaussianSSM(ssm.transition, ssm.transition_cov, lambda x: torch.sin(x), 0.1 * torch.eye(2, dtype=torch.float64), ssm.init_mean, ssm.init_cov)
    ys2 = data(two)
    ys2[7, 0] = math.nan
    unscented_rts_smoother(two, ys2)
    assert path.last == "eager: a step is partly observed"


def test_a_failed_factorisation_in_a_recorded_run_names_the_step_the_eager_run_names(path):
    # x_2 <- x_2 + x_2^3 from x_2 = 1, unobserved: the state overflows within ten steps.
    def f(x):
        return torch.stack([0.5 * x[..., 0], x[..., 1] + x[..., 1] ** 3], -1)

    eye = torch.eye(2, dtype=torch.float64)
    ssm = NonlinearGaussianSSM(f, 0.1 * eye, lambda x: x[..., :1], eye[:1, :1], torch.tensor([0.0, 1.0], dtype=torch.float64), 0.1 * eye)
    ys = torch.randn(T, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for engine in (unscented_rts_smoother, extended_rts_smoother):
        with pytest.raises(ValueError, match=r"time step \d+\b.*(not finite|not positive definite).*diverg") as fast:
            engine(ssm, ys)
        assert path.last == "recorded"
        with recording(False), pytest.raises(ValueError) as eager:
            engine(ssm, ys)
        assert str(fast.value) == str(eager.value)
