"""StepFrame: the coordinates in which the online filter's optimiser steps (issue 26)."""

import pytest
import torch

from pyro_smc.guides import StreamingFamily
from pyro_smc.guides.streaming.frame import StepFrame


def _family(covariance, backward, c=1.0):
    """A family at a state scaled by ``c``: mean, kernel bias and sds ``c`` times those at ``c = 1``."""
    q = StreamingFamily(2, covariance=covariance, backward=backward, hidden_dims=(3,)).double()
    m = torch.tensor([1.0, -2.0], dtype=torch.float64)
    P = torch.tensor([[0.5, 0.2], [0.2, 0.3]], dtype=torch.float64)
    W = torch.tensor([[0.7, 0.1], [-0.2, 0.4]], dtype=torch.float64)
    b = torch.tensor([0.3, 0.1], dtype=torch.float64)
    S = torch.tensor([[0.2, -0.05], [-0.05, 0.1]], dtype=torch.float64)
    q.set_marginal(c * m, c**2 * P)
    q.set_kernel(W, c * b, c**2 * S)
    return q


def _at(family, params):
    """A copy of ``family`` with the given parameters."""
    import copy

    out = copy.deepcopy(family)
    with torch.no_grad():
        for name, p in out.named_parameters():
            p.copy_(params[name])
    return out


def _random_w(frame, g):
    return {name: 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for name, v in frame.variables().items()}


@pytest.mark.parametrize("backward", ["linear", "mlp"])
@pytest.mark.parametrize("covariance", ["diag", "full"])
def test_the_frame_starts_at_the_family(covariance, backward):
    q = _family(covariance, backward)
    frame = StepFrame(q)
    at_zero = frame.parameters(frame.variables())
    assert at_zero.keys() == dict(q.named_parameters()).keys()
    for name, p in q.named_parameters():
        torch.testing.assert_close(at_zero[name], p.detach(), rtol=1e-12, atol=1e-12, msg=name)


def test_a_unit_step_is_a_unit_of_the_distribution():
    """On a posterior 1e4 times narrower along (1, 1) than across it, a unit whitened step moves
    the mean by exactly one Mahalanobis unit in any direction (a per-coordinate step of 1e-2 of
    each coordinate's sd is 70 units along the narrow direction); the kernel's c moves its mean
    by one of its own units and A leaves the mean at x_t = m_0 where it was."""
    q = StreamingFamily(2, covariance="full").double()
    rotation = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / 2**0.5
    P = rotation @ torch.diag(torch.tensor([1e-8, 1.0], dtype=torch.float64)) @ rotation.T
    q.set_marginal(torch.tensor([1.0, 2.0], dtype=torch.float64), P)
    q.set_kernel(0.5 * torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), P / 4)
    frame, start = StepFrame(q), q.filtering_distribution()
    kernel = q.backward_distribution(q.loc.detach())
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        w = frame.variables()
        u = torch.randn(2, generator=g, dtype=torch.float64)
        w["loc"], w["bias"], w["weight"] = u, u, torch.randn(2, 2, generator=g, dtype=torch.float64)
        moved = _at(q, frame.parameters(w))
        step = moved.loc.detach() - start.mean
        distance = step @ torch.linalg.solve(start.covariance_matrix, step)
        torch.testing.assert_close(distance, u.square().sum())
        k_step = moved.backward_distribution(start.mean).mean.detach() - kernel.mean
        torch.testing.assert_close(k_step @ torch.linalg.solve(kernel.covariance_matrix, k_step), u.square().sum())


@pytest.mark.parametrize("backward", ["linear", "mlp"])
@pytest.mark.parametrize("covariance", ["diag", "full"])
def test_the_frame_follows_the_units_of_the_state(covariance, backward):
    """Rescaling the state by c: the same whitened point gives the rescaled distributions, so
    Adam's iterates (functions of gradients that do not change) are the same fit in new units
    (before, Adam stepped each parameter by about lr in the state's units)."""
    c = 1e-3
    one, small = _family(covariance, backward), _family(covariance, backward, c)
    w = _random_w(StepFrame(one), torch.Generator().manual_seed(1))
    q1, qc = _at(one, StepFrame(one).parameters(w)), _at(small, StepFrame(small).parameters(w))
    m1, mc = q1.filtering_distribution(), qc.filtering_distribution()
    torch.testing.assert_close(mc.mean, c * m1.mean)
    torch.testing.assert_close(mc.variance, c**2 * m1.variance)
    if backward == "mlp":
        return  # its hidden layers start at random weights on the raw x_t, not rescaled with it
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    k1, kc = q1.backward_distribution(x), qc.backward_distribution(c * x)
    torch.testing.assert_close(kc.mean, c * k1.mean)
    torch.testing.assert_close(kc.variance, c**2 * k1.variance)


# Found by the property suite (tests/infer/test_online_properties.py): accepted silently before.
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"init_scale": float("inf")}, "init_scale must be a finite number > 0"),  # inf parameters
        ({"init_scale": float("nan")}, "init_scale must be a finite number > 0"),
        ({"hidden_dims": (2.5,)}, "hidden_dims must be a non-empty tuple of positive ints"),  # became 2
        ({"state_dim": True}, "state_dim must be a positive int"),  # became 1
        ({"num_steps": True}, "num_steps must be a positive int or None"),
    ],
)
def test_invalid_family_arguments_are_refused(kwargs, match):
    from pyro_smc.guides import StreamingFilterGuide

    kwargs = {"state_dim": 2, "backward": "mlp"} | kwargs
    with pytest.raises(ValueError, match=match):
        StreamingFilterGuide(kwargs.pop("state_dim"), **kwargs)
