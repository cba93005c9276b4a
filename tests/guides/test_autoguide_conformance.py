"""Conformance suite: ``AutoKroneckerFlow`` as a drop-in replacement for Pyro's ``AutoNormal``.

Every test runs against four guide factories, ``AutoNormal`` (the reference) and
``AutoKroneckerFlow(model, kind=k)`` for ``k`` in ``diag``, ``linear`` and ``nonlinear`` (the last
with ``hidden_dims=(8,)``; ids ``AutoNormal``, ``K-Diag``, ``K-Linear``, ``K-Nonlinear``), in the spirit of
Pyro's own ``tests/infer/test_autoguide.py``. A case that ``AutoNormal`` passes must pass for every
kind.

What is checked (the behaviour ``AutoKroneckerFlow`` must have):

* shapes of ``guide()`` for every support Pyro's tests use (real scalars / vectors / matrices,
  positive, interval, simplex, ``LKJCholesky``, plated ``MultivariateNormal``, masked sites,
  ``ProjectedNormalReparam`` spheres), also under vectorised particles and ``Predictive``;
  ``guide.matrix_sites`` (name -> ``(n, p)``) for sites whose *unconstrained* event dim is >= 2;
* ``median()``: detached full-size copies, in the support, and the image of zero noise (checked by
  running the guide with torch's standard-normal draws patched to return zeros);
* ``quantiles()``: shape, in the support, monotone in ``q`` for entry-wise supports (for simplex and
  ``LKJCholesky`` sites a "quantile" is the bijection of per-coordinate quantiles, as in
  ``AutoNormal``, and need not be monotone), ``q = 0.5`` equal to the median; at initialisation
  the K-Diag and K-Nonlinear quantiles equal K-Linear's (exactly, or within 5 Monte Carlo
  standard errors for K-Nonlinear matrix sites); after moving every parameter they are the
  marginal quantiles of the guide's own draws; repeated calls agree and leave the global RNG alone;
* ``Predictive`` (sequential, parallel, ``torch.jit``), ``JitTrace_ELBO``/``JitTraceMeanField_ELBO``;
* ``torch.save``/``pickle``/``state_dict`` round trips;
* data subsampling (model-side ``subsample_size``, user ``subsample=idx``, ``create_plates``),
  with scalar and matrix-valued local latents;
* ``AutoGuideList`` compositions, ``init_loc_fn`` strategies, Pyro's helpful errors for discrete
  and spherical sites;
* exactness on conjugate models (Normal-Normal; multi-output Bayesian linear regression whose
  matrix-normal posterior K-Linear and K-Nonlinear can represent exactly);
* no warnings (warnings are errors here, as in Pyro's suite) and float32/float64 consistency.

The ``tests/conftest.py`` autouse fixture sets float64 as the default dtype, clears the param store
and seeds the RNG before every test; validation is enabled by the fixture below.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import pickle
import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceMeanField_ELBO,
    Predictive,
    Trace_ELBO,
)
from pyro.infer.autoguide import (
    AutoGuideList,
    AutoNormal,
    init_to_feasible,
    init_to_median,
    init_to_sample,
    init_to_value,
)
from pyro.infer.reparam import ProjectedNormalReparam
from pyro.poutine.util import prune_subsample_sites

from pyro_smc.guides import AutoKroneckerFlow

# As in Pyro's setup.cfg: every warning is an error, except DeprecationWarnings (which come from the
# libraries, not from the guide). Module marks are applied after function marks, so they win.
pytestmark = [pytest.mark.filterwarnings("error"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

GUIDES = [
    pytest.param(AutoNormal, id="AutoNormal"),
    pytest.param(functools.partial(AutoKroneckerFlow, kind="diag"), id="K-Diag"),
    pytest.param(functools.partial(AutoKroneckerFlow, kind="linear"), id="K-Linear"),
    pytest.param(functools.partial(AutoKroneckerFlow, kind="nonlinear", hidden_dims=(8,)), id="K-Nonlinear"),
]
K_LINEAR = functools.partial(AutoKroneckerFlow, kind="linear")


def _kind(factory):
    """``None`` for ``AutoNormal``, else the ``AutoKroneckerFlow`` kind."""
    return getattr(factory, "keywords", {}).get("kind")


@pytest.fixture(autouse=True)
def _validation():
    with pyro.validation_enabled(True):
        yield


# ---------------------------------------------------------------------------------------------
# models (module level, so that guides built on them can be pickled)
# ---------------------------------------------------------------------------------------------


def _shapes_model_raw():
    pyro.sample("scalar", dist.Normal(0.0, 1.0))
    pyro.sample("vector", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    pyro.sample("matrix", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("pos_matrix", dist.LogNormal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("tensor3", dist.Normal(0.0, 1.0).expand([2, 2, 3]).to_event(3))
    with pyro.plate("plate", 3):
        pyro.sample("plated", dist.Normal(0.0, 1.0))
    with pyro.plate("mat_plate", 2):
        pyro.sample("plated_matrix", dist.Normal(0.0, 1.0).expand([2, 3, 2]).to_event(2))
    pyro.sample("positive", dist.LogNormal(0.0, 1.0))
    pyro.sample("uniform", dist.Uniform(0.0, 2.0))
    pyro.sample("beta", dist.Beta(2.0, 2.0).expand([2]).to_event(1))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(3)))
    pyro.sample("lkj2", dist.LKJCholesky(2, torch.tensor(1.0)))
    pyro.sample("lkj3", dist.LKJCholesky(3, torch.tensor(1.0)))
    with pyro.plate("lkj_plate", 2):
        pyro.sample("plated_lkj3", dist.LKJCholesky(3, torch.tensor(1.0)))
    with pyro.plate("mvn_plate", 2):
        pyro.sample("plated_mvn", dist.MultivariateNormal(torch.zeros(2), torch.eye(2)))
    pyro.sample("masked", dist.Normal(0.0, 1.0).expand([2]).mask(torch.arange(2) > 0).to_event(1))
    pyro.sample("sphere", dist.ProjectedNormal(torch.tensor([1.0, 0.0, 0.0])))


shapes_model = poutine.reparam(_shapes_model_raw, config={"sphere": ProjectedNormalReparam()})
SHAPES_MATRIX_SITES = {"matrix": (3, 2), "pos_matrix": (3, 2), "tensor3": (2, 6), "plated_matrix": (3, 2)}


def quantile_model():
    """Sites of every kind for the quantile tests (all plates at dim -1)."""
    pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("pos", dist.LogNormal(0.0, 1.0))
    pyro.sample("u", dist.Uniform(0.0, 2.0))
    pyro.sample("beta", dist.Beta(2.0, 2.0).expand([2]).to_event(1))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(3)))
    pyro.sample("lkj", dist.LKJCholesky(3, torch.tensor(1.0)))
    pyro.sample("W", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("V", dist.LogNormal(0.0, 1.0).expand([2, 3]).to_event(2))
    with pyro.plate("layers", 2):
        pyro.sample("P", dist.Normal(0.0, 1.0).expand([2, 2, 2]).to_event(2))


ELEMENTWISE = {"x", "pos", "u", "beta", "W", "V", "P"}  # supports whose bijection acts entry by entry
QUANTILE_MATRIX_SITES = {"W", "V", "P"}


def _matmul(x, w):
    """``x @ w`` for ``w`` of shape ``(3, 2)`` or, under a particle plate, ``(S, 1, 3, 2)``/``(S, 3, 2)``."""
    if w.dim() > 2:
        w = w.reshape(w.shape[:-2].numel(), *w.shape[-2:])
    return x @ w


def _per_particle(v, event_dim):
    """A global value, or its particle batch ``(S,)``/``(S, 1)`` as ``(S, 1, *event)`` (broadcasts against data)."""
    if v.dim() == event_dim:
        return v
    return v.reshape(-1, 1, *v.shape[v.dim() - event_dim :])


def regression_model(x, y=None):
    """A matrix weight, a vector bias and a positive noise scale; particle-vectorisable."""
    w = pyro.sample("W", dist.Normal(0.0, 1.0).expand([x.shape[-1], 2]).to_event(2))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        mean = _matmul(x, w) + _per_particle(b, 1)
        return pyro.sample("y", dist.Normal(mean, _per_particle(s, 0).unsqueeze(-1)).to_event(1), obs=y)


def serialization_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("plate", 2):
        pyro.sample("y", dist.LogNormal(0.0, 1.0))
        pyro.sample("z", dist.Beta(2.0, 2.0))
    pyro.sample("W", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("V", dist.LogNormal(0.0, 1.0).expand([2, 2]).to_event(2))


def vector_only_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("v", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    pyro.sample("pos", dist.LogNormal(0.0, 1.0).expand([2]).to_event(1))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("plate", 4):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(z, 1.0), obs=torch.zeros(4))


N_DATA = 50


def local_model(data, mat_data, batch_size=None):
    """Each data point has its own scalar and 2 x 2 matrix latent; vague priors, precise data."""
    with pyro.plate("data", N_DATA, subsample_size=batch_size) as idx:
        z = pyro.sample("z", dist.Normal(0.0, 10.0))
        m = pyro.sample("m", dist.Normal(0.0, 10.0).expand([2, 2]).to_event(2))
        pyro.sample("obs_z", dist.Normal(z, 0.1), obs=data[idx])
        pyro.sample("obs_m", dist.Normal(m, 0.1).to_event(2), obs=mat_data[idx])


def indexed_model(data, mat_data, idx):
    """As ``local_model``, with the minibatch indices passed in by the user."""
    with pyro.plate("data", N_DATA, subsample=idx):
        z = pyro.sample("z", dist.Normal(0.0, 10.0))
        m = pyro.sample("m", dist.Normal(0.0, 10.0).expand([2, 2]).to_event(2))
        pyro.sample("obs_z", dist.Normal(z, 0.1), obs=data[idx])
        pyro.sample("obs_m", dist.Normal(m, 0.1).to_event(2), obs=mat_data[idx])


def indexed_plates(data, mat_data, idx):
    return pyro.plate("data", N_DATA, subsample=idx)


def _local_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_DATA, generator=g), torch.randn(N_DATA, 2, 2, generator=g)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _latent_sites(model, *args, **kwargs):
    """The model's latent sample sites (name -> site), as an autoguide sees them."""
    with poutine.block():
        trace = prune_subsample_sites(poutine.trace(model).get_trace(*args, **kwargs))
    return {name: site for name, site in trace.iter_stochastic_nodes()}


def _assert_in_support(site, value, name):
    ok = site["fn"].support.check(value)
    assert bool(ok.all()), f"{name}: value outside {site['fn'].support}"


def _assert_padded_shape(value, num, shape, name):
    """``value`` is ``(num, 1, ..., 1, *shape)``: one extra leading dim, otherwise only singletons."""
    shape = tuple(shape)
    assert value.shape[0] == num, f"{name}: {tuple(value.shape)} does not start with {num}"
    tail = tuple(value.shape[value.dim() - len(shape) :]) if shape else ()
    assert tail == shape, f"{name}: {tuple(value.shape)} does not end with {shape}"
    middle = value.shape[1 : value.dim() - len(shape)]
    assert all(d == 1 for d in middle), f"{name}: {tuple(value.shape)} is not {num} x site shape {shape}"


def _perturb(guide, scale=0.3, seed=1):
    """Moves every parameter (flows included) away from its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


@contextlib.contextmanager
def _zero_noise(monkeypatch):
    """Every standard-normal draw made through torch returns zeros (so rsample returns its loc)."""

    def randn(*size, generator=None, out=None, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False, **kwargs):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = size[0]
        return torch.zeros(size, dtype=dtype, device=device)

    def randn_like(t, *, dtype=None, layout=None, device=None, requires_grad=False, memory_format=None, **kwargs):
        return torch.zeros_like(t, dtype=dtype, device=device)

    def normal(mean, std=1.0, size=None, *, generator=None, out=None, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False):
        if size is not None:
            return torch.full(tuple(size), float(mean), dtype=dtype, device=device)
        mean, std = torch.as_tensor(mean), torch.as_tensor(std)
        return mean + torch.zeros_like(std)

    def normal_(self, mean=0.0, std=1.0, *, generator=None):
        return self.fill_(mean)

    with monkeypatch.context() as m:
        m.setattr(torch, "randn", randn)
        m.setattr(torch, "randn_like", randn_like)
        m.setattr(torch, "normal", normal)
        m.setattr(torch.Tensor, "normal_", normal_)
        yield


def _sample_latents(guide, *args, seed=0, **kwargs):
    pyro.set_rng_seed(seed)
    with poutine.block():
        return {k: v.detach().clone() for k, v in guide(*args, **kwargs).items()}


def _assert_same(a: dict, b: dict, atol=0.0):
    assert set(a) == set(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0.0), f"{name}: {a[name]} != {b[name]}"


# ---------------------------------------------------------------------------------------------
# 1-2. shapes and matrix sites
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", GUIDES)
def test_shapes_every_support(factory):
    sites = _latent_sites(shapes_model)
    guide = factory(shapes_model)
    values = guide()
    assert set(values) == set(sites)
    for name, site in sites.items():
        assert values[name].shape == site["value"].shape, name
        _assert_in_support(site, values[name], name)
    if _kind(factory):
        assert guide.matrix_sites == SHAPES_MATRIX_SITES
    # The model accepts the guide's values and the ELBO is finite.
    loss = Trace_ELBO().loss(shapes_model, guide)
    assert math.isfinite(loss)


@pytest.mark.parametrize("factory", GUIDES)
def test_shapes_vectorized_particles(factory):
    num = 10
    sites = _latent_sites(shapes_model)
    guide = factory(shapes_model)
    elbo = Trace_ELBO(num_particles=num, vectorize_particles=True, max_plate_nesting=1)
    assert math.isfinite(elbo.loss(shapes_model, guide))
    with poutine.block(), pyro.plate("particles", num, dim=-2):
        values = guide()
    for name, site in sites.items():
        _assert_padded_shape(values[name], num, site["value"].shape, name)
        _assert_in_support(site, values[name], name)
    for parallel in (False, True):
        samples = Predictive(shapes_model, guide=guide, num_samples=num, parallel=parallel)()
        for name, site in sites.items():
            _assert_padded_shape(samples[name], num, site["value"].shape, f"{name} (parallel={parallel})")


# ---------------------------------------------------------------------------------------------
# 3. median
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", GUIDES)
def test_median_detached_copies_in_support(factory):
    sites = _latent_sites(shapes_model)
    guide = factory(shapes_model)
    guide()
    _perturb(guide)
    median = guide.median()
    assert set(median) == set(sites)
    expected = {k: v.clone() for k, v in median.items()}
    for name, site in sites.items():
        assert median[name].shape == site["value"].shape, name
        assert not median[name].requires_grad, name
        _assert_in_support(site, median[name], name)
        median[name].add_(1.0)  # must not write through to the guide
    _assert_same(guide.median(), expected)


@pytest.mark.parametrize("factory", GUIDES)
def test_median_is_image_of_zero_noise(factory, monkeypatch):
    # With every standard-normal draw replaced by zeros the guide returns M (AutoNormal, K-Diag,
    # K-Linear) or M + A G(0) B (K-Nonlinear): median() must return exactly that point.
    guide = factory(shapes_model)
    guide()
    _perturb(guide)  # flows no longer the identity
    with _zero_noise(monkeypatch):
        at_zero = _sample_latents(guide)
    _assert_same(guide.median(), at_zero, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# 4. quantiles
# ---------------------------------------------------------------------------------------------

PROBS = [0.1, 0.5, 0.9]
MC_DRAWS = 4096


def _reference_quantiles(delta=1e-4):
    """Exact K-Linear quantiles at PROBS and their slopes dQ/dq, at initialisation."""
    guide = K_LINEAR(quantile_model, init_loc_fn=init_to_feasible)
    guide()
    exact = guide.quantiles(PROBS)
    lo = guide.quantiles([q - delta for q in PROBS])
    hi = guide.quantiles([q + delta for q in PROBS])
    slope = {k: (hi[k] - lo[k]) / (2 * delta) for k in exact}
    pyro.clear_param_store()
    return exact, slope


def _mc_tolerance(slope, probs=PROBS, sigmas=5.0):
    """5 standard errors of a sample quantile: sqrt(q (1 - q) / S) / pdf, with 1 / pdf = dQ/dq."""
    q = torch.tensor(probs).reshape((-1,) + (1,) * (slope.dim() - 1))
    return sigmas * (q * (1 - q) / MC_DRAWS).sqrt() * slope.abs() + 1e-8


@pytest.mark.parametrize("factory", GUIDES)
def test_quantiles_every_site(factory):
    kind = _kind(factory)
    exact, slope = _reference_quantiles() if kind is not None else (None, None)
    sites = _latent_sites(quantile_model)
    guide = factory(quantile_model, init_loc_fn=init_to_feasible)
    guide()
    quantiles = guide.quantiles(PROBS)
    median = guide.median()
    assert set(quantiles) == set(sites)
    for name, site in sites.items():
        q = quantiles[name]
        assert torch.is_tensor(q) and not q.requires_grad, name
        assert q.shape == (3,) + tuple(site["value"].shape), name
        for value in q:
            _assert_in_support(site, value, name)
        if name in ELEMENTWISE:
            assert bool((q[0] < q[1]).all() and (q[1] < q[2]).all()), f"{name}: quantiles not monotone"
        monte_carlo = kind == "nonlinear" and name in QUANTILE_MATRIX_SITES
        if monte_carlo:
            # At initialisation the flows are the identity: the marginals are K-Linear's.
            tol = _mc_tolerance(slope[name])
            assert bool(((q - exact[name]).abs() <= tol).all()), f"{name}: {q} vs exact {exact[name]}"
            assert bool(((q[1] - median[name]).abs() <= tol[1]).all()), f"{name}: q(0.5) {q[1]} vs median {median[name]}"
        else:
            assert torch.allclose(q[1], median[name], atol=1e-10, rtol=0), f"{name}: q(0.5) != median"
            if kind is not None:
                assert torch.allclose(q, exact[name], atol=1e-10, rtol=0), f"{name}: differs from K-Linear at init"


@pytest.mark.parametrize("factory", GUIDES)
def test_quantiles_are_marginal_quantiles_of_samples(factory):
    # After moving every parameter (K-Nonlinear flows no longer the identity), the quantiles of
    # every entry-wise site are the marginal quantiles of the guide's own draws.
    num = 8000
    sites = _latent_sites(quantile_model)
    guide = factory(quantile_model)
    guide()
    _perturb(guide)
    quantiles = guide.quantiles(PROBS)
    pyro.set_rng_seed(5)
    with torch.no_grad(), poutine.block(), pyro.plate("particles", num, dim=-2):
        draws = guide()
    probs = torch.tensor(PROBS)
    for name in sorted(ELEMENTWISE):
        shape = tuple(sites[name]["value"].shape)
        x = draws[name].reshape((num,) + shape)
        empirical = torch.quantile(x, probs, dim=0)
        slope = (torch.quantile(x, probs + 0.02, dim=0) - torch.quantile(x, probs - 0.02, dim=0)) / 0.04
        inv_draws = 1 / num + (1 / MC_DRAWS if _kind(factory) == "nonlinear" and name in QUANTILE_MATRIX_SITES else 0.0)
        p = probs.reshape((-1,) + (1,) * len(shape))
        tol = 5 * (p * (1 - p) * inv_draws).sqrt() * slope
        assert bool(((quantiles[name] - empirical).abs() <= tol).all()), f"{name}: quantiles {quantiles[name]} vs sample quantiles {empirical}"


@pytest.mark.parametrize("factory", GUIDES)
def test_quantiles_deterministic(factory):
    # Monte Carlo quantiles come from a fixed-seed sample: two calls agree and leave the global RNG alone.
    guide = factory(quantile_model)
    guide()
    _perturb(guide)
    pyro.set_rng_seed(3)
    first = guide.quantiles(PROBS)
    after_first = torch.rand(())
    pyro.set_rng_seed(3)
    second = guide.quantiles(PROBS)
    after_second = torch.rand(())
    _assert_same(first, second)
    assert after_first == after_second


# ---------------------------------------------------------------------------------------------
# 5. Predictive and JIT
# ---------------------------------------------------------------------------------------------


def _regression_data(n=10):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("factory", GUIDES)
def test_predictive(factory, parallel):
    x, y = _regression_data()
    guide = factory(regression_model)
    guide(x, y)
    sites = _latent_sites(regression_model, x)
    samples = Predictive(regression_model, guide=guide, num_samples=7, parallel=parallel)(x)
    assert set(samples) == set(sites) | {"y"}
    for name, site in sites.items():
        _assert_padded_shape(samples[name], 7, site["value"].shape, name)
        _assert_in_support(site, samples[name], name)
    assert samples["y"].shape == (7, 10, 2)


@pytest.mark.parametrize("factory", GUIDES)
def test_predictive_jit(factory):
    # As Pyro's test_predictive: trace Predictive.call with torch.jit, save, load and call.
    x, y = _regression_data()
    guide = factory(regression_model)
    guide(x, y)
    predictive = Predictive(regression_model, guide=guide, num_samples=5)
    pyro.set_rng_seed(0)
    samples = predictive(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        traced = torch.jit.trace_module(predictive, {"call": (x,)})
    f = io.BytesIO()
    torch.jit.save(traced, f)
    f.seek(0)
    loaded = torch.jit.load(f)
    pyro.set_rng_seed(0)
    out = loaded.call(x)
    assert len(out) == len(samples)
    assert sorted(tuple(v.shape) for v in out) == sorted(tuple(v.shape) for v in samples.values())
    assert all(bool(torch.isfinite(v).all()) for v in out)


@pytest.mark.parametrize("Elbo", [JitTrace_ELBO, JitTraceMeanField_ELBO])
@pytest.mark.parametrize("factory", GUIDES)
def test_jit_elbo(factory, Elbo):
    # K-Nonlinear has no closed-form KL: TraceMeanField_ELBO falls back to a Monte Carlo one.
    x, y = _regression_data()
    guide = factory(regression_model)
    elbo = Elbo(num_particles=4, vectorize_particles=True, max_plate_nesting=1, ignore_jit_warnings=True)
    svi = SVI(regression_model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    losses = [svi.step(x, y) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)


# ---------------------------------------------------------------------------------------------
# 6. serialisation
# ---------------------------------------------------------------------------------------------


def _trained_serialization_guide(factory):
    guide = factory(serialization_model)
    svi = SVI(serialization_model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(3):
        svi.step()
    _perturb(guide, scale=0.1)
    return guide


def _torch_round_trip(guide, factory):
    f = io.BytesIO()
    torch.save(guide, f)
    pyro.clear_param_store()
    f.seek(0)
    return torch.load(f, weights_only=False)


def _pickle_round_trip(guide, factory):
    blob = pickle.dumps(guide)
    pyro.clear_param_store()
    return pickle.loads(blob)


def _state_dict_round_trip(guide, factory):
    state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    pyro.clear_param_store()
    fresh = factory(serialization_model)
    fresh()
    fresh.load_state_dict(state)
    return fresh


@pytest.mark.parametrize("round_trip", [_torch_round_trip, _pickle_round_trip, _state_dict_round_trip], ids=["torch.save", "pickle", "state_dict"])
@pytest.mark.parametrize("factory", GUIDES)
def test_serialization(factory, round_trip):
    guide = _trained_serialization_guide(factory)
    expected_median = guide.median()
    expected_samples = _sample_latents(guide, seed=7)
    expected_params = {k: v.detach().clone() for k, v in guide.named_parameters()}
    other = round_trip(guide, factory)
    del guide
    _assert_same(other.median(), expected_median)
    _assert_same(_sample_latents(other, seed=7), expected_samples)
    _assert_same({k: v.detach() for k, v in other.named_parameters()}, expected_params)


# ---------------------------------------------------------------------------------------------
# 7. subsampling
# ---------------------------------------------------------------------------------------------


def _assert_tracks_data(guide, data, mat_data, *args, tol=0.35):
    # The posterior sd is 0.1 and the data spread 1: misaligned parameters give errors of order 2.
    median = guide.median(data, mat_data, *args)
    assert median["z"].shape == (N_DATA,)
    assert median["m"].shape == (N_DATA, 2, 2)
    err_z = (median["z"] - data).abs().max().item()
    err_m = (median["m"] - mat_data).abs().max().item()
    assert err_z < tol and err_m < tol, f"max |median - data|: z {err_z:.3f}, m {err_m:.3f}"


@pytest.mark.parametrize("factory", GUIDES)
def test_subsample_model_side(factory):
    data, mat_data = _local_data()
    guide = factory(local_model, init_loc_fn=init_to_feasible)
    values = guide(data, mat_data, batch_size=20)
    assert values["z"].shape == (20,) and values["m"].shape == (20, 2, 2)
    # The parameters cover the full data set, not the first minibatch.
    if _kind(factory) is None:
        assert guide.locs.z.shape == (N_DATA,) and guide.locs.m.shape == (N_DATA, 2, 2)
    else:
        assert guide.matrix_sites == {"m": (2, 2)}
    median = guide.median(data, mat_data, batch_size=20)
    assert median["z"].shape == (N_DATA,) and median["m"].shape == (N_DATA, 2, 2)
    # Every data point has its own posterior: after training on random minibatches, all 50 medians
    # follow their own data (posterior sd 0.1, data spread 1).
    steps = 300
    optim = pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.05 ** (1 / steps)})
    svi = SVI(local_model, guide, optim, Trace_ELBO())
    pyro.set_rng_seed(0)
    for _ in range(steps):
        svi.step(data, mat_data, batch_size=20)
    _assert_tracks_data(guide, data, mat_data, None)


@pytest.mark.parametrize("factory", GUIDES)
def test_subsample_user_indices(factory):
    # Minibatches of different sizes passed in by the user: the guide's plate must use exactly the
    # model's indices (create_plates), so sizes 10 then 20 work and the right parameters are used.
    data, mat_data = _local_data()
    guide = factory(indexed_model, create_plates=indexed_plates)
    for size in (10, 20, 10):
        idx = torch.randperm(N_DATA)[:size]
        guide_trace = poutine.trace(guide).get_trace(data, mat_data, idx)
        assert torch.equal(guide_trace.nodes["data"]["value"], idx)
        assert guide_trace.nodes["z"]["value"].shape == (size,)
        assert guide_trace.nodes["m"]["value"].shape == (size, 2, 2)
        loss = Trace_ELBO().loss(indexed_model, guide, data, mat_data, idx)
        assert math.isfinite(loss)
    median = guide.median(data, mat_data, idx)
    assert median["z"].shape == (N_DATA,) and median["m"].shape == (N_DATA, 2, 2)


@pytest.mark.parametrize("factory", GUIDES)
def test_subsample_create_plates_training(factory):
    # Deterministic chunks of sizes 10, 20, 20 (as Pyro's test_subsample_guide); a guide that drew
    # its own indices would train the wrong points and fail to track the data.
    data, mat_data = _local_data()
    guide = factory(indexed_model, create_plates=indexed_plates, init_loc_fn=init_to_feasible)
    chunks = [torch.arange(0, 10), torch.arange(10, 30), torch.arange(30, 50)]
    epochs = 100
    optim = pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.05 ** (1 / (3 * epochs))})
    svi = SVI(indexed_model, guide, optim, Trace_ELBO())
    for _ in range(epochs):
        for idx in chunks:
            svi.step(data, mat_data, idx)
    _assert_tracks_data(guide, data, mat_data, chunks[0])


def plated_matrix_model(obs):
    # Two independent 2 x 2 matrices, observed with very different noise: their posteriors differ.
    noise = torch.tensor([0.05, 1.0])
    with pyro.plate("layers", 2):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 2, 2]).to_event(2))
        pyro.sample("obs", dist.Normal(w, noise[:, None, None]).to_event(2), obs=obs)


@pytest.mark.parametrize("factory", GUIDES)
def test_plated_matrix_site_has_factors_per_element(factory):
    obs = torch.tensor([[[0.5, -0.5], [1.0, 0.0]], [[2.0, 1.0], [-1.0, 0.5]]])
    noise = torch.tensor([0.05, 1.0])
    post_var = 1 / (1 + noise**-2)
    post_mean = post_var[:, None, None] * obs / noise[:, None, None] ** 2
    post_sd = post_var.sqrt()[:, None, None].expand(2, 2, 2)
    guide = factory(plated_matrix_model, init_loc_fn=init_to_feasible)
    steps = 200
    elbo = Trace_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(plated_matrix_model, guide, pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.1 ** (1 / steps)}), elbo)
    for _ in range(steps):
        svi.step(obs)
    if _kind(factory):
        assert guide.matrix_sites == {"w": (2, 2)}
    q = guide.quantiles([0.15865525, 0.5, 0.84134475], obs)["w"]
    sd = (q[2] - q[0]) / 2
    # Posterior sds 0.05 and 0.71: one shared pair of factors for both elements cannot fit them.
    assert bool(((q[1] - post_mean).abs() <= 0.5 * post_sd).all()), q[1]
    assert torch.allclose(sd, post_sd, rtol=0.15, atol=0), sd


# ---------------------------------------------------------------------------------------------
# 8. AutoGuideList
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("part", ["matrix", "rest"], ids=["factory-on-W", "factory-on-rest"])
@pytest.mark.parametrize("factory", GUIDES)
def test_guide_list(factory, part):
    x, y = _regression_data()
    guide = AutoGuideList(regression_model)
    if part == "matrix":
        first = factory(poutine.block(regression_model, expose=["W"]))
        guide.append(first)
        guide.append(AutoNormal(poutine.block(regression_model, hide=["W"])))
    else:
        guide.append(AutoNormal(poutine.block(regression_model, expose=["W"])))
        first = factory(poutine.block(regression_model, hide=["W"]))
        guide.append(first)
    svi = SVI(regression_model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    if _kind(factory):
        assert first.matrix_sites == ({"W": (3, 2)} if part == "matrix" else {})
    sites = _latent_sites(regression_model, x, y)
    median = guide.median(x, y)
    quantiles = guide.quantiles(PROBS, x, y)
    assert set(median) == set(quantiles) == set(sites)
    for name, site in sites.items():
        assert median[name].shape == site["value"].shape
        assert quantiles[name].shape == (3,) + tuple(site["value"].shape)
    samples = Predictive(regression_model, guide=guide, num_samples=4, parallel=True)(x)
    assert samples["W"].shape[-2:] == (3, 2)


# ---------------------------------------------------------------------------------------------
# 9. init_loc_fn
# ---------------------------------------------------------------------------------------------


def init_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.MultivariateNormal(torch.zeros(5), torch.eye(5)))
    pyro.sample("W", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("V", dist.LogNormal(0.0, 1.0).expand([2, 3]).to_event(2))
    pyro.sample("p", dist.Beta(2.0, 2.0))
    with pyro.plate("plate", 2):
        pyro.sample("P", dist.Normal(0.0, 1.0).expand([2, 2, 2]).to_event(2))


def _init_values():
    return {
        "x": torch.tensor(0.7),
        "y": torch.linspace(-1.0, 1.0, 5),
        "W": torch.tensor([[0.1, -0.2], [0.3, 0.4], [-0.5, 0.6]]),
        "V": torch.tensor([[0.5, 1.0, 2.0], [3.0, 0.25, 1.5]]),
        "p": torch.tensor(0.3),
        "P": torch.arange(8.0).reshape(2, 2, 2) / 4 - 1,
    }


@pytest.mark.parametrize("init_loc_fn", [init_to_median, init_to_sample, init_to_feasible], ids=lambda f: f.__name__)
@pytest.mark.parametrize("factory", GUIDES)
def test_init_strategies(factory, init_loc_fn):
    sites = _latent_sites(init_model)
    guide = factory(init_model, init_loc_fn=init_loc_fn)
    values = guide()
    median = guide.median()
    for name, site in sites.items():
        assert values[name].shape == median[name].shape == site["value"].shape, name
        _assert_in_support(site, median[name], name)
    if init_loc_fn is init_to_feasible:
        expected = {name: init_to_feasible(site) for name, site in sites.items()}
        _assert_same(median, expected, atol=1e-10)


@pytest.mark.parametrize("how", ["init_to_value", "callable"])
@pytest.mark.parametrize("factory", GUIDES)
def test_init_to_value(factory, how):
    values = _init_values()
    if how == "init_to_value":
        init_loc_fn = init_to_value(values=values)
    else:

        def init_loc_fn(site):
            return values[site["name"]]

    guide = factory(init_model, init_loc_fn=init_loc_fn)
    guide()
    _assert_same(guide.median(), values, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# 10. helpful errors
# ---------------------------------------------------------------------------------------------


def bernoulli_model():
    p = pyro.sample("p", dist.Beta(2.0, 2.0))
    x = pyro.sample("x", dist.Bernoulli(p))
    pyro.sample("obs", dist.Bernoulli(p * x + (1 - p) * (1 - x)), obs=torch.tensor([1.0, 0.0]))


def categorical_model():
    pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
    pyro.sample("x", dist.Categorical(torch.ones(3) / 3))


def sphere_model():
    x = pyro.sample("x", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    y = pyro.sample("y", dist.ProjectedNormal(x))
    pyro.sample("obs", dist.Normal(y, 1.0).to_event(1), obs=torch.tensor([1.0, 0.0]))


INIT_FNS = [init_to_feasible, init_to_median, init_to_sample]


@pytest.mark.parametrize("init_loc_fn", INIT_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("model", [bernoulli_model, categorical_model], ids=["Bernoulli", "Categorical"])
@pytest.mark.parametrize("factory", GUIDES)
def test_discrete_helpful_error(factory, model, init_loc_fn):
    guide = factory(model, init_loc_fn=init_loc_fn)
    with pytest.raises(ValueError, match="Continuous inference cannot handle discrete sample site 'x'.*enumeration.html"):
        guide()


@pytest.mark.parametrize("init_loc_fn", INIT_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("factory", GUIDES)
def test_sphere_helpful_error(factory, init_loc_fn):
    guide = factory(sphere_model, init_loc_fn=init_loc_fn)
    with pytest.raises(ValueError, match="Continuous inference cannot handle spherical sample site 'y'.*ProjectedNormalReparam"):
        guide()


# ---------------------------------------------------------------------------------------------
# 11. exactness on conjugate models
# ---------------------------------------------------------------------------------------------


def normal_normal_model(data):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    M = pyro.sample("M", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
    with pyro.plate("data", data.shape[0]):
        pyro.sample("obs_mu", dist.Normal(mu, 1.0), obs=data[:, 0, 0])
        pyro.sample("obs_M", dist.Normal(M, 1.0).to_event(2), obs=data)


@pytest.mark.parametrize("factory", GUIDES)
def test_exact_normal_normal(factory):
    # Every entry is an independent conjugate Normal-Normal problem: mean sum(data) / (1 + n),
    # sd (1 + n)^-1/2. A scalar site and a (mean-field-representable) matrix site.
    g = torch.Generator().manual_seed(0)
    data = torch.randn(3, 2, 2, generator=g) + 1.0
    n = data.shape[0]
    sd = (1 + n) ** -0.5
    mean = {"mu": data[:, 0, 0].sum() / (1 + n), "M": data.sum(0) / (1 + n)}
    guide = factory(normal_normal_model)
    steps = 200
    elbo = Trace_ELBO(num_particles=200, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(normal_normal_model, guide, pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.01 ** (1 / steps)}), elbo)
    for _ in range(steps):
        svi.step(data)
    median = guide.median(data)
    quantiles = guide.quantiles(PROBS, data)
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(PROBS))
    tol = 0.05 * sd  # optimisation error (AutoNormal reaches about 0.02 sd)
    for name in ("mu", "M"):
        expected = mean[name] + sd * z.reshape((-1,) + (1,) * mean[name].dim())
        qtol = tol
        if _kind(factory) == "nonlinear" and name == "M":  # Monte Carlo quantiles
            pdf = torch.distributions.Normal(0.0, 1.0).log_prob(z).exp()
            qtol = tol + _mc_tolerance((sd / pdf).reshape((-1,) + (1,) * mean[name].dim()).expand_as(expected))
        assert torch.allclose(median[name], mean[name], atol=tol, rtol=0), f"{name}: median {median[name]} vs {mean[name]}"
        assert bool(((quantiles[name] - expected).abs() <= qtol).all()), f"{name}: quantiles {quantiles[name]} vs {expected}"


SIGMA = 0.3


def blr_model(x, y):
    """Multi-output regression with known noise; W ~ N(0, 1) is 3 x 2. Particle-vectorisable."""
    w = pyro.sample("W", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(_matmul(x, w), SIGMA).to_event(1), obs=y)


def _blr_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g)
    x[:, 2] = x[:, 0] + x[:, 2]  # correlated inputs: rows 0 and 2 of W are correlated a posteriori
    w = torch.randn(3, 2, generator=g)
    return x, x @ w + SIGMA * torch.randn(20, 2, generator=g)


@pytest.mark.parametrize("factory", GUIDES)
def test_exact_matrix_normal_regression(factory):
    # Exact posterior: matrix normal with mean Sigma X^T Y / s^2, row covariance
    # Sigma = (X^T X / s^2 + I)^-1 and identity column covariance. K-Linear and K-Nonlinear contain it.
    x, y = _blr_data()
    precision = x.T @ x / SIGMA**2 + torch.eye(3)
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y / SIGMA**2
    var = cov.diagonal()[:, None].expand(3, 2)
    steps = 400
    elbo = Trace_ELBO(num_particles=32, vectorize_particles=True, max_plate_nesting=1)
    guide = factory(blr_model)
    svi = SVI(blr_model, guide, pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.005 ** (1 / steps)}), elbo)
    for _ in range(steps):
        svi.step(x, y)
    sd = var.sqrt()
    median = guide.median(x, y)["W"]
    assert bool(((median - mean).abs() <= 0.2 * sd).all()), f"median {median} vs {mean}"
    if _kind(factory) in ("linear", "nonlinear"):
        with torch.no_grad():
            samples = Predictive(blr_model, guide=guide, num_samples=4000, parallel=True, return_sites=["W"])(x, y)["W"]
        samples = samples.reshape(-1, 3, 2)
        assert bool(((samples.mean(0) - mean).abs() <= 0.2 * sd).all()), f"sample mean {samples.mean(0)} vs {mean}"
        assert torch.allclose(samples.var(0), var, rtol=0.15), f"entry variances {samples.var(0)} vs {var}"
        # The check can fail: the mean-field variances 1 / diag(precision) are 40 % below diag(Sigma) here.
        assert bool((1 / precision.diagonal() < 0.7 * cov.diagonal()).any())


# ---------------------------------------------------------------------------------------------
# 12. no warnings without matrix sites
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", GUIDES)
def test_vector_only_model_is_autonormal(factory):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        guide = factory(vector_only_model, init_loc_fn=init_to_feasible)
        guide()
        svi = SVI(vector_only_model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        assert math.isfinite(svi.step())
        median = guide.median()
        quantiles = guide.quantiles(PROBS)
    if _kind(factory):
        assert guide.matrix_sites == {}
    # Same initial posterior as AutoNormal, site by site.
    pyro.clear_param_store()
    reference = AutoNormal(vector_only_model, init_loc_fn=init_to_feasible)
    reference()
    pyro.clear_param_store()
    fresh = factory(vector_only_model, init_loc_fn=init_to_feasible)
    fresh()
    _assert_same(fresh.median(), reference.median(), atol=1e-12)
    _assert_same(fresh.quantiles(PROBS), reference.quantiles(PROBS), atol=1e-12)
    assert set(median) == set(quantiles) == set(reference.median())


# ---------------------------------------------------------------------------------------------
# 13. dtype / device
# ---------------------------------------------------------------------------------------------


def _dtype_model(dtype, device):
    def model():
        zero = torch.zeros((), dtype=dtype, device=device)
        pyro.sample("x", dist.Normal(zero, 1.0))
        pyro.sample("W", dist.Normal(zero, 1.0).expand([3, 2]).to_event(2))
        pyro.sample("V", dist.LogNormal(zero, 1.0).expand([2, 2]).to_event(2))
        pyro.sample("p", dist.Beta(zero + 2.0, zero + 2.0))
        with pyro.plate("plate", 2, device=device):
            pyro.sample("P", dist.Normal(zero, 1.0).expand([2, 3, 2]).to_event(2))
            pyro.sample("obs", dist.Normal(zero, 1.0), obs=torch.ones(2, dtype=dtype, device=device))

    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("factory", GUIDES)
def test_dtype_follows_model(factory, dtype, device):
    # The default dtype is set to the *other* precision: nothing may be built in the default one.
    torch.set_default_dtype(torch.float32 if dtype == torch.float64 else torch.float64)
    model = _dtype_model(dtype, device)
    guide = factory(model)
    values = guide()
    for name, p in guide.named_parameters():
        assert p.dtype == dtype and p.device.type == device.type, f"parameter {name}: {p.dtype} on {p.device}"
    for results in (values, guide.median(), guide.quantiles(PROBS), Predictive(model, guide=guide, num_samples=3)()):
        for name, v in results.items():
            assert v.dtype == dtype and v.device.type == device.type, f"{name}: {v.dtype} on {v.device}"
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    assert math.isfinite(svi.step())
