"""Label classes, within-class weights and class sums, against brute-force loops."""

import math

import pytest
import torch

from pyro_smc.ops.labels import class_moments, class_sums, class_weights, label_classes, separate_classes
from tests.cases import DTYPE_IDS, DTYPES


def _brute_force_classes(keys):
    """Per filter: the rank of each particle's label tuple among the sorted distinct tuples."""
    flat = keys.reshape(-1, *keys.shape[-2:])
    out = []
    for k in flat:
        rows = [tuple(r) for r in k.tolist()]
        rank = {r: i for i, r in enumerate(sorted(set(rows)))}
        out.append([rank[r] for r in rows])
    return torch.tensor(out).reshape(keys.shape[:-1])


@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (3, 20, 1), (2, 4, 30, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_label_classes_match_the_ranks_of_the_distinct_labels(shape, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2, 3, shape, generator=g)
    classes = label_classes(keys)
    assert classes.dtype == torch.int64 and classes.shape == shape[:-1]
    assert torch.equal(classes, _brute_force_classes(keys))


def test_label_classes_take_booleans_and_small_integers():
    keys = torch.tensor([[True, False], [False, False], [True, False]])
    assert label_classes(keys).tolist() == [1, 0, 1]
    assert label_classes(keys.to(torch.int8)).tolist() == [1, 0, 1]


def test_label_classes_rejects_a_key_without_the_label_dimension():
    with pytest.raises(ValueError, match="keys"):
        label_classes(torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_class_weights_match_a_loop_over_the_classes(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    b, n = 4, 25
    classes = torch.randint(3, (b, n), generator=g)
    log_w = (2 * torch.randn(b, n, generator=g, dtype=dtype)).log_softmax(-1)
    log_w[0, classes[0] == 1] = -math.inf  # a class of zero mass
    log_w = log_w.log_softmax(-1)
    within, log_share = class_weights(log_w, classes)
    w = log_w.double().exp()
    for i in range(b):
        for k in classes[i].unique():
            members = classes[i] == k
            mass, count = float(w[i, members].sum()), int(members.sum())
            want = torch.full((count,), 1 / n, dtype=torch.float64) if mass == 0 else w[i, members] * count / (n * mass)
            assert torch.allclose(within[i, members].double().exp(), want, rtol=1e-5, atol=0)
            assert torch.allclose(log_share[i, members].double().exp(), torch.full((count,), mass / count, dtype=torch.float64), rtol=1e-5, atol=0)
    # Both are normalised over the particles.
    assert torch.allclose(within.logsumexp(-1), torch.zeros(b, dtype=dtype), atol=1e-5)
    assert torch.allclose(log_share.logsumexp(-1), torch.zeros(b, dtype=dtype), atol=1e-5)


def test_class_weights_keep_a_class_whose_weights_underflow_exp():
    # Float32 exp underflows below -104; the class's relative weights are still exact.
    log_w = torch.tensor([0.0, -200.0, -201.0, -math.inf])
    within, log_share = class_weights(log_w, torch.tensor([0, 1, 1, 1]))
    p = torch.tensor([1.0, math.exp(-1)]) / (1 + math.exp(-1))
    assert torch.allclose(within[1:3].exp(), 3 / 4 * p)
    assert within[3] == -math.inf and torch.isfinite(log_share[1:]).all()
    assert math.isclose(float(log_share[1]), -200 + math.log1p(math.exp(-1)) - math.log(3), rel_tol=1e-6)


def test_class_weights_have_finite_gradients_through_a_class_of_zero_mass():
    log_w = torch.tensor([0.0, -math.inf, -math.inf], dtype=torch.float64, requires_grad=True)
    within, log_share = class_weights(log_w, torch.tensor([0, 1, 1]))
    (within.exp().sum() + log_share.exp().sum()).backward()
    assert torch.isfinite(log_w.grad).all()


def test_class_sums_match_a_loop():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2, 9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    classes = torch.randint(4, (2, 9), generator=g)
    out = class_sums(values, classes)
    for i in range(2):
        for j in range(9):
            assert torch.allclose(out[i, j], values[i, classes[i] == classes[i, j]].sum(0))
    assert torch.autograd.gradcheck(lambda v: class_sums(v, classes), (values,))


def test_class_moments_match_a_loop():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 11, 3, generator=g, dtype=torch.float64)
    classes = torch.randint(3, (2, 11), generator=g)
    centred, var, counts = class_moments(x, classes)
    for i in range(2):
        for j in range(11):
            members = x[i, classes[i] == classes[i, j]]
            assert torch.allclose(centred[i, j], x[i, j] - members.mean(0))
            assert torch.allclose(var[i, j], members.var(0, unbiased=False))
            assert counts[i, j] == len(members)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("epsilon", [0.01, 0.5, 20.0])
def test_separated_pairs_have_a_kernel_of_exactly_zero(dtype, epsilon):
    """Pairs within a class keep their cost, the mean returned is the mean over them, and pairs
    across classes get a kernel of exactly zero even against potentials as large as twice the
    largest cost within a class, at any epsilon up to the annealing start."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 2, generator=g, dtype=dtype)
    classes = torch.randint(2, (3, 10), generator=g)
    scale2 = 0.5 + torch.rand(3, 10, generator=g, dtype=dtype)
    scale2 = class_sums(scale2.unsqueeze(-1), classes).squeeze(-1)  # one scale per class
    cost = torch.cdist(x, x).square() / scale2.unsqueeze(-2)
    apart = classes.unsqueeze(-1) != classes.unsqueeze(-2)
    before = cost.clone()
    mean = separate_classes(cost, x, classes, scale2, epsilon)
    assert torch.equal(cost[~apart], before[~apart])
    assert math.isclose(mean, float(before[~apart].mean()), rel_tol=1e-5)
    top = 2 * float(before[~apart].max())
    for eps in (epsilon, max(epsilon, mean / 4)):
        assert (torch.exp((top - cost[apart]) / eps) == 0).all()
