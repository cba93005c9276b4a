import pytest
import torch

from pyro_smc.guides.kronecker.transforms import AdditiveCoupling, ColumnwiseTransform, RowwiseTransform, kronecker_nonlinear


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _brute_force_logdet(transform, E):
    # Full Jacobian of vec(G(E)) (np x np) and its slogdet.
    n, p = E.shape
    jac = torch.autograd.functional.jacobian(lambda e: transform(e.reshape(n, p)).reshape(-1), E.reshape(-1))
    return torch.linalg.slogdet(jac)[1]


@pytest.mark.parametrize("flow", ["additive_coupling", "affine_coupling", "iaf"])
@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (1, 5), (5, 1), (2, 2)])
def test_log_det_equals_brute_force_slogdet(flow, shape):
    g = kronecker_nonlinear(*shape, flow=flow, hidden_dims=(8,))
    _randomise(g, 0)
    E = torch.randn(*shape)
    W = g(E)
    assert torch.allclose(g.log_abs_det_jacobian(E, W), _brute_force_logdet(g, E), atol=1e-10)
    assert torch.allclose(g.inv(W.clone()), E, atol=1e-10)  # a clone bypasses the transforms' cache


def test_volume_preserving_coupling_has_unit_determinant_and_a_nontrivial_map():
    t = AdditiveCoupling(4, (8,))
    _randomise(t, 1)
    x = torch.randn(7, 4)
    y = t(x)
    assert not torch.allclose(x, y)
    assert torch.equal(t.log_abs_det_jacobian(x, y), torch.zeros(7))
    assert abs(float(_brute_force_logdet(ColumnwiseTransform(t), torch.randn(4, 3)))) < 1e-10


def test_rows_and_columns_are_lifted_with_batch_dims():
    t = AdditiveCoupling(3, (8,))
    _randomise(t, 2)
    E = torch.randn(2, 5, 3)
    rows = RowwiseTransform(t)(E)
    assert torch.allclose(rows[1, 4], t(E[1, 4]))
    cols = ColumnwiseTransform(t)(E.transpose(-1, -2))
    assert torch.allclose(cols[1, :, 4], t(E[1, 4]))
    assert kronecker_nonlinear(5, 3)(E).shape == (2, 5, 3)


def test_initial_flow_is_the_identity_and_bad_flow_names_fail():
    g = kronecker_nonlinear(3, 4)
    E = torch.randn(3, 4)
    assert torch.equal(g(E), E)
    with pytest.raises(ValueError, match="flow"):
        kronecker_nonlinear(3, 4, flow="magic")
    with pytest.raises(ValueError, match="input_dim"):
        AdditiveCoupling(1)
