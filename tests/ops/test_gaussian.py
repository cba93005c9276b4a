import pytest
import torch

from pyro_smc.ops.gaussian import check_psd, damp, divide, is_proper, multiply, psd_repair, to_moment, to_natural


def _random_gaussian(d, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g)
    return torch.randn(d, generator=g), a @ a.T + 0.5 * torch.eye(d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_natural_round_trip(seed):
    m, P = _random_gaussian(4, seed)
    m2, P2 = to_moment(*to_natural(m, P))
    assert torch.allclose(m, m2, atol=1e-10) and torch.allclose(P, P2, atol=1e-10)


def test_product_matches_dense_density_ratio():
    # log N(x|m1,P1) + log N(x|m2,P2) - log N(x|m,P) must be constant in x for the product (m, P).
    (m1, P1), (m2, P2) = _random_gaussian(3, 4), _random_gaussian(3, 5)
    m, P = to_moment(*multiply(to_natural(m1, P1), to_natural(m2, P2)))
    xs = torch.randn(10, 3)
    logp = [torch.distributions.MultivariateNormal(a, b).log_prob(xs) for a, b in ((m1, P1), (m2, P2), (m, P))]
    diff = logp[0] + logp[1] - logp[2]
    assert torch.allclose(diff, diff[0].expand_as(diff), atol=1e-10)


def test_divide_undoes_multiply_and_damping_interpolates():
    a, b = to_natural(*_random_gaussian(3, 6)), to_natural(*_random_gaussian(3, 7))
    back = divide(multiply(a, b), b)
    assert all(torch.allclose(x, y, atol=1e-10) for x, y in zip(back, a))
    assert damp(a, b, 1.0) is b
    half = damp(a, b, 0.5)
    assert torch.allclose(half[1], (a[1] + b[1]) / 2)
    # power: q / q_i^0.5
    assert torch.allclose(divide(a, b, 0.5)[1], a[1] - 0.5 * b[1])


def test_is_proper_and_psd_checks():
    assert bool(is_proper(torch.eye(2)))
    assert not bool(is_proper(torch.diag(torch.tensor([1.0, 0.0]))))
    assert is_proper(torch.stack([torch.eye(2), -torch.eye(2)])).tolist() == [True, False]
    check_psd("P", torch.eye(3))
    check_psd("P", torch.diag(torch.tensor([1.0, 0.0])), strict=False)
    with pytest.raises(ValueError, match="Q must be positive definite"):
        check_psd("Q", torch.diag(torch.tensor([1.0, -1.0])))
    with pytest.raises(ValueError, match="R must be symmetric"):
        check_psd("R", torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="S must be a square"):
        check_psd("S", torch.ones(2, 3))
    with pytest.raises(ValueError, match="S has non-finite"):
        check_psd("S", torch.full((2, 2), float("nan")))
    with pytest.raises(ValueError, match="semi-definite"):
        check_psd("S", torch.diag(torch.tensor([1.0, -1.0])), strict=False)


def test_psd_repair_clips_eigenvalues_only():
    m, P = _random_gaussian(4, 8)
    assert torch.allclose(psd_repair(P), P, atol=1e-10)
    bad = P - 2 * torch.linalg.eigvalsh(P).max() * torch.outer(torch.ones(4), torch.ones(4)) / 4
    fixed = psd_repair(bad, 1e-6)
    assert torch.linalg.eigvalsh(fixed).min() >= 1e-6 - 1e-12
