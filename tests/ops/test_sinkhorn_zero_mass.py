import pytest
import torch

from pyro_smc.ops.sinkhorn_kernel import complete_zero_mass, soft_min, zero_mass


def _dense_completion(cost, log_a, log_b, f, g, eps):
    """The full-matrix c-transform the gathered completion replaces."""
    g = torch.where(zero_mass(log_b), soft_min(cost, f, log_a, eps, rows=True), g)
    f = torch.where(zero_mass(log_a), soft_min(cost, g, log_b, eps, rows=False), f)
    return f, g


@pytest.mark.parametrize("dtype,tiny", [(torch.float64, -900.0), (torch.float32, -150.0)])
@pytest.mark.parametrize("eps", [1e-3, 0.1, 1.0])
def test_gathered_completion_matches_dense(dtype, tiny, eps):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 1, generator=gen, dtype=dtype)
    cost = (x - x.transpose(-1, -2)) ** 2
    log_a = torch.randn(3, 40, generator=gen, dtype=dtype)
    log_a[0, :5] = tiny
    log_b = log_a.flip(-1).clone()
    log_b[2, 7] = tiny
    f, g = torch.randn(3, 40, generator=gen, dtype=dtype), torch.randn(3, 40, generator=gen, dtype=dtype)
    got, want = complete_zero_mass(cost, log_a, log_b, f, g, eps), _dense_completion(cost, log_a, log_b, f, g, eps)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-12 if dtype == torch.float64 else 1e-5)
    # The solver passes the masks it already has; the answer is the same.
    given = complete_zero_mass(cost, log_a, log_b, f, g, eps, (zero_mass(log_a), zero_mass(log_b)))
    for a, b in zip(given, got):
        assert torch.equal(a, b)


def test_gathered_completion_is_differentiable():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 1, generator=gen, dtype=torch.float64)
    cost = (x - x.transpose(-1, -2)) ** 2
    log_a = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    log_a[1, 2] = -900.0
    log_b = log_a.flip(-1).clone()
    f = torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, g: complete_zero_mass(cost, log_a, log_b, f, g, 0.5), (f, g))


def test_no_zero_mass_is_identity():
    cost = torch.rand(2, 5, 5)
    log_a = log_b = torch.full((2, 5), -5.0**0.5)
    f, g = torch.randn(2, 5), torch.randn(2, 5)
    nf, ng = complete_zero_mass(cost, log_a, log_b, f, g, 0.1)
    assert nf is f and ng is g
