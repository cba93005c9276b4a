"""Property suite of ``AutoKroneckerFlow`` (issue 26): construction options per kind, drawn models
(scalar, vector, matrix (1 x k, k x 1, with zero-size dims), 3-d sites; real and positive supports;
plates; float32/float64) and ``guide()``, ``Trace_ELBO``, ``median``, ``quantiles``. The invariant:
a clear ``ValueError`` naming the argument (or site), or a finite answer that agrees with the oracle:
the dense ``(B B^T) kron (A A^T)`` Gaussian for ``"diag"``/``"linear"`` (log-density and exact
quantiles), fresh draws for ``"nonlinear"`` (empirical CDF at the quantiles, within 5 sigma).

A long run: ``PYRO_SMC_PROPERTY_EXAMPLES=300 python -m pytest tests/guides/kronecker/test_flow_properties.py
--hypothesis-show-statistics``.
"""

import math

import pyro
import pyro.distributions as dist
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from pyro import poutine
from pyro.infer import Trace_ELBO

from pyro_smc.guides import AutoKroneckerFlow
from pyro_smc.guides.kronecker.flow import factor_from_params
from pyro_smc.guides.kronecker.kinds import DiagKind, LinearKind, NonlinearKind
from pyro_smc.guides.kronecker.transforms import FLOWS
from tests.property_cases import ENGINE, F32, FLOAT_DTYPES, SEEDS, assert_clear_error, assert_finite, dense_kron, gen

KIND_NAMES = ("diag", "linear", "nonlinear")
HIDDEN = st.sampled_from([(4,), (8,), (3, 5), [6]])


# --- construction options -------------------------------------------------------------------
BAD_FLOWS = st.sampled_from(["glow", "", "IAF", 3])
BAD_HIDDEN = st.sampled_from([(), 8, (0,), (-2,), (2.5,), ("4",), (True,)])
BAD_SCALES = st.sampled_from([0.0, -0.1, math.inf, math.nan, True, "0.1"])


def _vector_model():
    pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))


@ENGINE
@given(
    kind=st.sampled_from(KIND_NAMES + ("object-diag", "object-linear", "object-nonlinear", "full")),
    flow=st.one_of(st.none(), st.sampled_from(FLOWS), BAD_FLOWS),
    hidden_dims=st.one_of(st.none(), HIDDEN, BAD_HIDDEN),
    init_scale=st.one_of(st.floats(1e-3, 2.0), BAD_SCALES),
)
def test_property_construction_options(kind, flow, hidden_dims, init_scale):
    objects = {"object-diag": DiagKind(), "object-linear": LinearKind(), "object-nonlinear": NonlinearKind(hidden_dims=(4,))}
    # Which arguments are wrong, by the documented rules.
    bad = set()
    if not (isinstance(init_scale, float) and 0 < init_scale < math.inf):
        bad.add("init_scale")
    if kind == "full":
        bad.add("kind")
    if flow is not None and (kind != "nonlinear" or flow not in FLOWS):
        bad.add("flow")
    if hidden_dims is not None and (
        kind != "nonlinear" or not (isinstance(hidden_dims, (tuple, list)) and hidden_dims and all(type(h) is int and h > 0 for h in hidden_dims))
    ):
        bad.add("hidden_dims")
    try:
        guide = AutoKroneckerFlow(_vector_model, kind=objects.get(kind, kind), flow=flow, hidden_dims=hidden_dims, init_scale=init_scale)
    except Exception as error:  # noqa: BLE001 - the invariant decides
        assert bad, f"unexpected error for valid options: {error!r}"
        assert_clear_error(error, *bad)
        return
    assert not bad, f"accepted bad options {bad}"
    name = kind.removeprefix("object-")
    assert guide.kind == name
    if name == "nonlinear":
        assert guide.flow == (flow or "additive_coupling") and guide.hidden_dims == tuple(hidden_dims or ((4,) if kind.startswith("object") else (32,)))
    else:
        assert guide.flow is None and guide.hidden_dims is None
    pyro.clear_param_store()
    draw = guide()
    assert draw["w"].shape == (2, 3) and torch.isfinite(draw["w"]).all()


# --- drawn models ---------------------------------------------------------------------------
@st.composite
def models(draw):
    """``(dtype, sites)``, each site ``(name, event shape, support, plate size or None)``."""
    dtype = draw(FLOAT_DTYPES)
    sites = []
    for i in range(draw(st.integers(1, 3))):
        rank = draw(st.sampled_from([0, 1, 2, 2, 2, 3]))
        shape = tuple(draw(st.sampled_from([0, 1, 1, 2, 3, 4])) for _ in range(rank))
        sites.append((f"s{i}", shape, draw(st.sampled_from(["real", "positive"])), draw(st.sampled_from([None, None, 1, 3]))))
    return dtype, sites


def make_model(dtype, sites):
    def model():
        for name, shape, support, plate in sites:
            zeros = torch.zeros(shape, dtype=dtype)
            fn = (dist.Normal(zeros, 1.0) if support == "real" else dist.LogNormal(zeros, 0.5)).to_event(len(shape))
            if plate is None:
                pyro.sample(name, fn)
            else:
                with pyro.plate(f"plate_{name}", plate, dim=-1):
                    pyro.sample(name, fn.expand([plate]))

    return model


def _options(kind, flow, hidden_dims):
    return {"flow": flow, "hidden_dims": hidden_dims} if kind == "nonlinear" else {}


def _unconstrained_site(trace, name):
    return trace.nodes[name] if f"{name}_unconstrained" not in trace.nodes else trace.nodes[f"{name}_unconstrained"]


def _dense_posterior(guide, name, kind):
    """Mean, and ``Cov(vec U) = (B B^T) kron (A A^T)`` in float64, of a matrix site's unconstrained value."""
    n, p = guide.matrix_sites[name]
    loc = getattr(guide.locs, name).detach().double()
    rows, cols = getattr(guide.row_factors, name).detach().double(), getattr(guide.col_factors, name).detach().double()
    if kind == "diag":
        a, b = torch.diag_embed(rows), torch.diag_embed(cols)
    else:
        a, b = factor_from_params(rows, n), factor_from_params(cols, p)
    return loc, dense_kron(b @ b.mT, a @ a.mT)  # dense_kron(V, U) = V^T kron U = V kron U


@ENGINE
@given(
    model=models(),
    kind=st.sampled_from(KIND_NAMES),
    flow=st.sampled_from(FLOWS),
    hidden_dims=HIDDEN,
    seed=SEEDS,
    probs=st.lists(st.floats(0.02, 0.98), min_size=1, max_size=3).map(sorted),
)
def test_property_guide_on_drawn_models(model, kind, flow, hidden_dims, seed, probs):
    dtype, sites = model
    fn = make_model(dtype, sites)
    pyro.clear_param_store()
    guide = AutoKroneckerFlow(fn, kind=kind, **_options(kind, flow, hidden_dims))
    sides = [max(s[0], math.prod(s[1:])) for _, s, _, _ in sites if len(s) >= 2 and math.prod(s) > 0]
    event(f"kind={kind}" + (f", flow={flow}" if kind == "nonlinear" else ""))
    event("a site with no entries" if any(math.prod(s) == 0 for _, s, _, _ in sites) else "no empty site")
    try:
        draw = guide()
    except ValueError as error:
        event("iaf narrower than a side: error")
        # iaf's masked networks need a hidden unit per input: a clear error naming the site.
        assert kind == "nonlinear" and flow == "iaf" and min(hidden_dims) < max(sides)
        assert_clear_error(error, "hidden_dims")
        assert "site" in str(error)
        return
    assert not (kind == "nonlinear" and flow == "iaf" and sides and min(hidden_dims) < max(sides))
    expected = {name: (s[0], math.prod(s[1:])) for name, s, _, _ in sites if len(s) >= 2 and math.prod(s) > 0}
    assert guide.matrix_sites == expected
    event(f"{len(expected)} matrix sites, {sum(1 for *_, plate in sites if plate)} plated sites")
    full = {name: ((plate,) if plate else ()) + shape for name, shape, _, plate in sites}
    for name, *_ in sites:
        assert draw[name].shape == full[name] and draw[name].dtype == dtype
        assert_finite(draw[name], f"guide()[{name!r}]")
    # Move every parameter (flows included) off its initial value.
    g = gen(seed)
    with torch.no_grad():
        for param in guide.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    loss = Trace_ELBO().loss(fn, guide)
    assert math.isfinite(loss), loss
    median, quantiles = guide.median(), guide.quantiles(probs)
    for name, _, support, _ in sites:
        assert median[name].shape == full[name] and quantiles[name].shape == (len(probs),) + full[name]
        assert median[name].dtype == dtype and quantiles[name].dtype == dtype
        assert_finite(median[name], f"median[{name!r}]")
        assert_finite(quantiles[name], f"quantiles[{name!r}]")
        if support == "positive":
            assert (median[name] > 0).all() and (quantiles[name] > 0).all()
        assert (quantiles[name].diff(dim=0) >= 0).all(), f"{name}: quantiles not monotone"
    trace = poutine.trace(guide).get_trace()
    rtol = 1e-3 if dtype == F32 else 1e-9
    for name, (n, p) in guide.matrix_sites.items():
        site = _unconstrained_site(trace, name)
        value = site["value"].detach()
        positive = dict((s[0], s[2]) for s in sites)[name] == "positive"
        batch = value.shape[: value.dim() - site["fn"].event_dim]
        matrix = value.reshape(batch + (n, p)).double()
        if kind != "nonlinear":
            _check_exact(guide, name, kind, site, value, matrix, batch, probs, quantiles[name], positive, rtol)
        else:
            _check_monte_carlo(site, quantiles[name], probs, positive, batch, n, p)


def _check_exact(guide, name, kind, site, value, matrix, batch, probs, quantiles, positive, rtol):
    """The log-density and the quantiles of the dense Gaussian ``N(vec M, (B B^T) kron (A A^T))``."""
    n, p = matrix.shape[-2:]
    loc, cov = _dense_posterior(guide, name, kind)
    vec = lambda x: x.mT.reshape(x.shape[:-2] + (n * p,))  # noqa: E731 - column-major
    mvn = torch.distributions.MultivariateNormal(vec(loc), covariance_matrix=cov)
    expected = mvn.log_prob(vec(matrix))
    got = site["fn"].log_prob(value).detach().double()
    assert ((got - expected).abs() <= rtol * (n * p + expected.abs())).all(), (got, expected)
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt().reshape(batch + (p, n)).mT
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(probs, dtype=torch.float64))
    exact = loc + sd * z.reshape((-1,) + (1,) * loc.dim())
    exact = exact.exp() if positive else exact
    q = quantiles.double().reshape(exact.shape)
    assert ((q - exact).abs() <= rtol * (1 + exact.abs())).all(), (q, exact)


def _check_monte_carlo(site, quantiles, probs, positive, batch, n, p, num=2000):
    """Fresh draws from the guide's own distribution: their empirical CDF at each returned quantile
    is the quantile's level, within 5 sigma of the two sample sizes' binomial errors."""
    with torch.no_grad():
        draws = site["fn"].sample((num,)).reshape((num,) + batch + (n, p)).double()
    q = quantiles.double().reshape((len(probs),) + batch + (n, p))
    q = q.log() if positive else q
    cdf = (draws.unsqueeze(1) <= q).double().mean(0)  # (len(probs), *batch, n, p)
    level = torch.tensor(probs, dtype=torch.float64).reshape((-1,) + (1,) * (q.dim() - 1))
    samples = AutoKroneckerFlow.quantile_samples
    sigma = (level * (1 - level) * (1 / samples + 1 / num)).sqrt()
    assert ((cdf - level).abs() <= 5 * sigma + 1 / num).all(), (cdf, level)


# --- quantile arguments ---------------------------------------------------------------------
PROBABILITY = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0]))
OUT_OF_RANGE = st.one_of(st.floats(1.0, 10.0, exclude_min=True), st.floats(-10.0, 0.0, exclude_max=True), st.sampled_from([math.nan, math.inf, -math.inf]))


def _quantile_model():
    pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
    pyro.sample("pos", dist.LogNormal(0.0, 1.0).expand([3, 1]).to_event(2))
    pyro.sample("s", dist.Normal(0.0, 1.0))


@ENGINE
@given(
    kind=st.sampled_from(KIND_NAMES),
    good=st.lists(PROBABILITY, max_size=4),
    bad=st.lists(OUT_OF_RANGE, max_size=2),
    as_tensor=st.booleans(),
    nested=st.booleans(),
)
def test_property_quantile_arguments(kind, good, bad, as_tensor, nested):
    pyro.clear_param_store()
    guide = AutoKroneckerFlow(_quantile_model, kind=kind, **_options(kind, "additive_coupling", (4,)))
    guide()
    probs = good + bad
    arg = [probs] if nested else probs
    arg = torch.tensor(arg, dtype=torch.float64) if as_tensor else arg
    try:
        out = guide.quantiles(arg)
    except Exception as error:  # noqa: BLE001 - the invariant decides
        assert bad or nested, f"rejected valid quantiles {probs}: {error!r}"
        assert_clear_error(error, "quantiles")
        return
    assert not bad and not nested
    q = torch.tensor(probs, dtype=torch.float64)
    for name, shape in (("w", (2, 3)), ("pos", (3, 1)), ("s", ())):
        values = out[name]
        assert values.shape == (len(probs),) + shape
        inner = (q > 0) & (q < 1)
        assert_finite(values[inner], f"quantiles[{name!r}]")
        low = 0.0 if name == "pos" else -math.inf
        assert (values[q == 0] == low).all() and (values[q == 1] == math.inf).all()
