"""The contract every resampler shares (pyro_smc/resamplers/base.py).

Every class on random shapes and weights (hypothesis; settings and strategies in
tests/property_cases.py), a dominant weight and particles of the wrong length; the ancestors a
resampler draws come back in ``Resampled``, and nothing of a call is left on the instance.
"""

import math

import pyro
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.weights import normalize
from pyro_smc.resamplers import MultinomialResampler, OTResampler, ResidualResampler, SoftResampler, StratifiedResampler, SystematicResampler
from tests.cases import DTYPE_IDS, ulp
from tests.property_cases import FLOAT_DTYPES, PROPERTY, SEEDS, eps, gen, random_log_weights

DTYPES = [torch.float32, torch.float64]

RESAMPLERS = st.sampled_from(["systematic", "stratified", "multinomial", "ot"])


def _make_resampler(kind, epsilon):
    return (
        {"systematic": SystematicResampler, "stratified": StratifiedResampler, "multinomial": MultinomialResampler}[kind]()
        if kind != "ot"
        else OTResampler(epsilon)
    )


@PROPERTY
@given(
    filters=st.sampled_from([(), (2,)]),
    n=st.integers(1, 25),
    dtype=FLOAT_DTYPES,
    seed=SEEDS,
    kind=RESAMPLERS,
    epsilon=st.sampled_from([0.1, 0.5, 1.0]),
    event=st.sampled_from([(), (2,), (2, 3)]),
    scale=st.sampled_from([0.0, 1.0, 5.0]),
    zero_fraction=st.sampled_from([0.0, 0.5]),
)
def test_resamplers(filters, n, dtype, seed, kind, epsilon, event, scale, zero_fraction):
    g = gen(seed)
    lw = random_log_weights(filters + (n,), g, dtype, scale, zero_fraction)
    a = torch.randn(filters + (n,) + event, generator=g, dtype=dtype)
    b = torch.randn(filters + (n, 2), generator=g, dtype=dtype)
    label = torch.arange(n).expand(filters + (n,))
    particles = {"a": a, "b": b, "label": label}
    torch.manual_seed(seed)
    new, new_lw = _make_resampler(kind, epsilon)(particles, lw)
    assert set(new) == set(particles)
    for key, value in particles.items():
        assert new[key].shape == value.shape and new[key].dtype == value.dtype
    assert new_lw.shape == lw.shape and new_lw.dtype == dtype
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    assert ((new["label"] >= 0) & (new["label"] < n)).all()
    if kind != "ot":
        # Every key takes the same ancestor, and no ancestor has zero weight.
        ancestors = new["label"]
        gather = ancestors.reshape(ancestors.shape + (1,) * len(event)).expand(a.shape)
        assert torch.equal(new["a"], a.gather(len(filters), gather))
        assert torch.equal(new["b"], b.gather(len(filters), ancestors.unsqueeze(-1).expand(b.shape)))
        assert torch.isfinite(lw.gather(-1, ancestors)).all()
        return
    # OT with a label of its own for every particle: each class is one particle, which stays
    # where it is, and the classes' offspring are drawn by the weights (systematic resampling).
    ancestors = new["label"]
    assert torch.isfinite(lw.gather(-1, ancestors)).all()
    # (up to the rounding of the centred coordinates the transform works in)
    close = dict(rtol=0, atol=8 * eps(dtype) * (1 + float(torch.cat([a.flatten(), b.flatten()]).abs().max())))
    assert torch.allclose(new["a"], a.gather(len(filters), ancestors.reshape(ancestors.shape + (1,) * len(event)).expand(a.shape)), **close)
    assert torch.allclose(new["b"], b.gather(len(filters), ancestors.unsqueeze(-1).expand(b.shape)), **close)
    # OT without the label: the ensemble transform of the concatenated float state.
    new, new_lw = _make_resampler(kind, epsilon)({"a": a, "b": b}, lw)
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    assert torch.isfinite(new["a"]).all() and torch.isfinite(new["b"]).all()
    x = torch.cat([a.reshape(filters + (n, -1)), b], -1)
    x_new, plan = ensemble_transform(x, lw, epsilon)
    width = x.shape[-1] - b.shape[-1]
    assert torch.allclose(new["a"].reshape(filters + (n, -1)), x_new[..., :width]) and torch.allclose(new["b"], x_new[..., width:])
    # Each new particle is a convex combination of the old ones ...
    slack = 16 * eps(dtype) * (1 + float(x.abs().max()))
    assert ((x_new >= x.amin(-2, keepdim=True) - slack) & (x_new <= x.amax(-2, keepdim=True) + slack)).all()
    # ... and the weighted mean is preserved up to the plan's marginal errors (an identity).
    col = (plan.sum(-2) - lw.exp()).abs().sum(-1)
    row = (plan.sum(-1) - 1 / n).abs().sum(-1)
    err = (x_new.mean(-2) - (lw.exp().unsqueeze(-1) * x).sum(-2)).abs().amax(-1)
    assert (err <= (col + row) * x.abs().amax((-1, -2)) + slack * n).all()


INDEX_RESAMPLERS = [SystematicResampler, StratifiedResampler, MultinomialResampler, ResidualResampler]


@pytest.mark.parametrize("resampler", INDEX_RESAMPLERS + [OTResampler], ids=lambda r: r.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_resampler_classes_with_a_dominant_weight(dtype, resampler):
    n, k = 16, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, 2, generator=g, dtype=dtype)
    lw = normalize(torch.full((3, n), -1e4, dtype=dtype).index_fill_(-1, torch.tensor([k]), 0.0))[0]
    new, new_lw = resampler()({"x": x, "label": torch.arange(n).expand(3, n)}, lw)
    assert new["x"].dtype == dtype and torch.isfinite(new["x"]).all()
    assert torch.allclose(new_lw, torch.full_like(lw, -math.log(n)))
    # Every particle becomes particle k (the OT map moves the whole mass onto it as well).
    assert torch.allclose(new["x"], x[:, k : k + 1].expand(3, n, 2), atol=10 * ulp(dtype, 1.0) * float(x.abs().max()))
    assert (new["label"] == k).all()


@pytest.mark.parametrize("resampler", [SystematicResampler(), OTResampler(0.5)], ids=["systematic", "ot"])
def test_resampler_rejects_particles_of_the_wrong_length(resampler):
    with pytest.raises(ValueError, match="x"):
        resampler({"x": torch.randn(3, 2)}, torch.full((4,), -math.log(4)))


def test_ancestors_returned_without_changing_the_output():
    particles = {"x": torch.arange(5.0).expand(3, 5)}
    log_w = torch.randn(3, 5).log_softmax(-1)
    for resampler in (SystematicResampler(), MultinomialResampler(), SoftResampler(0.5)):
        pyro.set_rng_seed(0)
        out = resampler.resample(particles, log_w)
        pyro.set_rng_seed(0)
        new, _ = resampler(particles, log_w)
        assert out.ancestors.shape == (3, 5) and out.ancestors.dtype == torch.int64
        assert torch.equal(new["x"], out.ancestors.to(new["x"].dtype))
        assert not any(name.startswith(("last", "_last")) for name in vars(resampler))
        assert "last_ancestors" not in repr(resampler)


@pytest.mark.parametrize("resampler", [OTResampler(), SoftResampler(0.5)])
def test_a_state_more_precise_than_its_weights_is_refused_by_resamplers_that_move_particles(resampler):
    """Before: OT called directly with a float64 state and float32 log-weights computed in float32,
    so positions near 1e6 with a spread of 1e-3 all came out one value. Now it is an error naming
    the state; the index resamplers, which only copy, accept it and keep the state's values."""
    x = 1e6 + 1e-3 * torch.randn(200, generator=gen(0), dtype=torch.float64)
    log_w = torch.randn(200, generator=gen(1), dtype=torch.float32).log_softmax(-1)
    if isinstance(resampler, OTResampler):
        with pytest.raises(ValueError, match=r"particles\['x'\] is torch.float64 but log_weights is torch.float32"):
            resampler.resample({"x": x}, log_w)
    out = SystematicResampler().resample({"x": x}, log_w)
    assert out.particles["x"].dtype == torch.float64 and float(out.particles["x"].std()) > 5e-4
