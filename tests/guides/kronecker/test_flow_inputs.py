"""``AutoKroneckerFlow``'s handling of its options and of edge-case inputs (issue 26): every option a
kind does not use, every malformed option and every out-of-range quantile is a ``ValueError`` naming
it; a site with no entries gets a working (trivial) guide, as under ``AutoNormal``."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_smc.guides import AutoKroneckerFlow
from pyro_smc.guides.kronecker.kinds import LinearKind, NonlinearKind
from pyro_smc.guides.kronecker.transforms import AdditiveCoupling, kronecker_nonlinear

KINDS = ["diag", "linear", "nonlinear"]


def matrix_model():
    pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    pyro.sample("pos", dist.LogNormal(0.0, 1.0).expand([2, 2]).to_event(2))
    pyro.sample("s", dist.LogNormal(0.0, 1.0))


def _guide(kind, model=matrix_model, **kwargs):
    if kind == "nonlinear":
        kwargs.setdefault("hidden_dims", (8,))
    return AutoKroneckerFlow(model, kind=kind, **kwargs)


# --- options a kind does not use ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["diag", "linear"])
@pytest.mark.parametrize("option", [{"flow": "iaf"}, {"flow": "additive_coupling"}, {"hidden_dims": (8,)}, {"hidden_dims": (32,)}])
def test_an_option_the_kind_does_not_use_is_an_error(kind, option):
    # Before: flow= and hidden_dims= were silently ignored by "diag" and "linear" (guide.flow
    # even reported the ignored flow).
    (name,) = option
    with pytest.raises(ValueError, match=rf"{name}.*kind='{kind}'"):
        AutoKroneckerFlow(matrix_model, kind=kind, **option)


@pytest.mark.parametrize("option", [{"flow": "iaf"}, {"hidden_dims": (8,)}])
@pytest.mark.parametrize("kind", [LinearKind(), NonlinearKind(flow="affine_coupling", hidden_dims=(4,))])
def test_an_option_next_to_a_kind_object_is_an_error(kind, option):
    # Before: ignored in favour of the object's own settings.
    (name,) = option
    with pytest.raises(ValueError, match=rf"{name}.*{type(kind).__name__}"):
        AutoKroneckerFlow(matrix_model, kind=kind, **option)


def test_defaults_and_reported_options_per_kind():
    linear = AutoKroneckerFlow(matrix_model, kind="linear")
    assert linear.kind == "linear" and linear.flow is None and linear.hidden_dims is None
    nonlinear = AutoKroneckerFlow(matrix_model, kind="nonlinear")
    assert nonlinear.flow == "additive_coupling" and nonlinear.hidden_dims == (32,)
    chosen = AutoKroneckerFlow(matrix_model, kind="nonlinear", flow="iaf", hidden_dims=[16, 16])
    assert chosen.flow == "iaf" and chosen.hidden_dims == (16, 16)
    by_object = AutoKroneckerFlow(matrix_model, kind=NonlinearKind(flow="iaf", hidden_dims=(16,)))
    assert by_object.flow == "iaf" and by_object.hidden_dims == (16,)


def test_a_kind_class_instead_of_an_instance_is_an_error():
    with pytest.raises(ValueError, match=r"kind.*instance"):
        AutoKroneckerFlow(matrix_model, kind=LinearKind)


# --- malformed options ----------------------------------------------------------------------
BAD_HIDDEN_DIMS = [(), [], 8, (0,), (8, 0), (-1,), (2.5,), ("8",), (True,)]


@pytest.mark.parametrize("hidden_dims", BAD_HIDDEN_DIMS, ids=repr)
def test_malformed_hidden_dims_are_errors_naming_them(hidden_dims):
    # Before: () raised a bare IndexError when the guide first ran, 8 "'int' object is not
    # iterable", (-1,) and (2.5,) torch errors, and (0,) built a flow of constant shifts.
    with pytest.raises(ValueError, match="hidden_dims"):
        AutoKroneckerFlow(matrix_model, kind="nonlinear", hidden_dims=hidden_dims)
    with pytest.raises(ValueError, match="hidden_dims"):
        NonlinearKind(hidden_dims=hidden_dims)
    with pytest.raises(ValueError, match="hidden_dims"):
        kronecker_nonlinear(3, 2, hidden_dims=hidden_dims)
    with pytest.raises(ValueError, match="hidden_dims"):
        AdditiveCoupling(3, hidden_dims=hidden_dims)


@pytest.mark.parametrize("split_dim", [0, 3, -1, 1.5])
def test_additive_coupling_rejects_a_split_outside_the_vector(split_dim):
    # Before: 0 built a coupling that shifts by a constant, 3 one that does nothing.
    with pytest.raises(ValueError, match="split_dim"):
        AdditiveCoupling(3, split_dim=split_dim)


def test_iaf_hidden_dims_narrower_than_a_side_name_the_site():
    # Before: Pyro's "Hidden dimension must not be less than input dimension." with no site, flow
    # or option named (and with the default hidden_dims=(32,), for any side over 32).
    def model():
        pyro.sample("wide", dist.Normal(0.0, 1.0).expand([2, 6]).to_event(2))

    guide = AutoKroneckerFlow(model, kind="nonlinear", flow="iaf", hidden_dims=(4,))
    with pytest.raises(ValueError, match=r"'wide'.*\(2, 6\).*hidden_dims"):
        guide()
    with pytest.raises(ValueError, match="hidden_dims"):
        kronecker_nonlinear(2, 6, flow="iaf", hidden_dims=(4,))
    assert AutoKroneckerFlow(model, kind="nonlinear", flow="iaf", hidden_dims=(6,))()["wide"].shape == (2, 6)


@pytest.mark.parametrize("init_scale", [math.inf, math.nan, 0.0, -1.0, True, "0.1"], ids=repr)
def test_init_scale_must_be_a_finite_positive_number(init_scale):
    # Before: inf was accepted (every draw infinite).
    with pytest.raises(ValueError, match="init_scale"):
        AutoKroneckerFlow(matrix_model, kind="linear", init_scale=init_scale)


# --- sites with no entries ------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(0,), (0, 2), (2, 0), (0, 0), (0, 2, 3)])
def test_a_site_with_no_entries_gets_a_trivial_guide_as_under_autonormal(kind, shape):
    # Before: for matrix shapes "diag" and "linear" raised a bare IndexError from torch's
    # constraint check, and "nonlinear" built a flow over no entries; for every empty site (the
    # vector (0,) too, found by the property suite) quantiles() raised "cannot reshape tensor of 0
    # elements". AutoNormal gives such a site a (trivial) guide.
    def model():
        pyro.sample("empty", dist.Normal(0.0, 1.0).expand(list(shape)).to_event(len(shape)))
        pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))

    guide = _guide(kind, model)
    draw = guide()
    assert draw["empty"].shape == shape and draw["w"].shape == (2, 3)
    assert guide.matrix_sites == {"w": (2, 3)}
    assert guide.median()["empty"].shape == shape
    assert guide.quantiles([0.1, 0.9])["empty"].shape == (2,) + shape
    # log p = log q = 0 for a site with no entries; the ELBO is finite.
    guide_trace = poutine.trace(guide).get_trace()
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace()
    for trace in (guide_trace, model_trace):
        trace.compute_log_prob()
        assert float(trace.nodes["empty"]["log_prob_sum"].detach()) == 0.0
    assert math.isfinite(Trace_ELBO().loss(model, guide))


# --- quantiles ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quantiles", [[1.5], [-0.1], [0.5, 1.0000001], [math.nan], [[0.1, 0.5]], "0.5", [0.1, None]], ids=repr)
def test_quantiles_outside_the_unit_interval_are_errors(kind, quantiles):
    # Before: [1.5] gave NaN for "diag"/"linear" (as AutoNormal does) and finite values, the sample
    # maximum, for "nonlinear"; [nan] an IndexError for "nonlinear"; [[0.1, 0.5]] was flattened.
    guide = _guide(kind)
    guide()
    with pytest.raises(ValueError, match="quantiles"):
        guide.quantiles(quantiles)


@pytest.mark.parametrize("kind", KINDS)
def test_quantiles_at_zero_and_one_are_the_ends_of_the_support(kind):
    # Before: "nonlinear" returned the minimum and maximum of its Monte Carlo draws. The flow is a
    # bijection of R^{n p} with a positive density, so every marginal's support is the real line.
    guide = _guide(kind)
    guide()
    q = guide.quantiles(torch.tensor([0.0, 0.5, 1.0]))
    inf = torch.tensor(math.inf)
    assert (q["w"][0] == -inf).all() and (q["w"][2] == inf).all() and torch.isfinite(q["w"][1]).all()
    assert (q["pos"][0] == 0).all() and (q["pos"][2] == inf).all()
    reference = AutoNormal(matrix_model)
    reference()
    torch.testing.assert_close(q["s"][[0, 2]], reference.quantiles([0.0, 1.0])["s"])
    # A scalar probability and an empty list are fine.
    assert guide.quantiles(0.5)["w"].shape == (1, 3, 2) and guide.quantiles([])["w"].shape == (0, 3, 2)


@pytest.mark.parametrize("samples", [0, 1, -5, 2.5])
def test_nonlinear_quantile_samples_must_be_at_least_two(samples):
    # Before: 1 indexed draw -1 (the maximum for every q), 0 raised an IndexError.
    guide = _guide("nonlinear")
    guide()
    guide.quantile_samples = samples
    with pytest.raises(ValueError, match="quantile_samples"):
        guide.quantiles([0.5])


@pytest.mark.parametrize("kind", ["diag", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_exact_quantiles_are_accurate_in_the_far_tails(kind, dtype):
    # Found by the property suite. Before: Normal.icdf's erfinv(2 q - 1) rounds 2 q - 1 to -1 for
    # q below ~1e-17 (float64) or ~6e-8 (float32, and q was cast to the site's dtype first), so
    # q = 1e-20 gave -inf (so does AutoNormal), and 1 - 1e-9 gave +inf for a float32 site. The
    # oracle is log Phi((Q - m) / s) = log q, with torch's tail-accurate log_ndtr in float64.
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(3, 2, dtype=dtype), 1.0).to_event(2))
        pyro.sample("s", dist.Normal(torch.zeros((), dtype=dtype), 1.0))

    guide = AutoKroneckerFlow(model, kind=kind)
    guide()
    probs = torch.tensor([1e-300, 1e-20, 1e-9, 0.3, 1 - 1e-9], dtype=torch.float64)
    q = guide.quantiles(probs)
    median, upper = guide.median(), guide.quantiles([0.8413447460685429])  # Phi(1): one sd above
    for name in ("w", "s"):
        assert torch.isfinite(q[name]).all() and q[name].dtype == dtype
        sd = (upper[name][0] - median[name]).double()
        z = (q[name].double() - median[name].double()) / sd
        tails = torch.where(probs < 0.5, probs, 1 - probs).reshape((-1,) + (1,) * median[name].dim())
        log_tail = torch.special.log_ndtr(torch.where(probs.reshape(tails.shape) < 0.5, z, -z))
        tol = 1e-3 if dtype == torch.float32 else 1e-8
        assert ((log_tail - tails.log()).abs() <= tol * tails.log().abs()).all(), (log_tail, tails.log())


@pytest.mark.parametrize("first,second", [("linear", "diag"), ("diag", "linear"), ("nonlinear", "diag"), ("linear", "linear")])
def test_a_stale_param_store_is_an_error_naming_the_parameter(first, second):
    # Found while probing the options. Before: "scale_tril_row must have shape (..., 3, 3) to match
    # loc's n = 3, got shape (6, 6)" or "params must have last dim size ...": a PyroParam takes the
    # stored value of its name, whatever its shape. (AutoNormal silently returns the stale shape.)
    def model_of(n):
        def model():
            pyro.sample("w", dist.Normal(0.0, 1.0).expand([n, 2]).to_event(2))
            pyro.sample("b", dist.Normal(0.0, 1.0).expand([n]).to_event(1))

        return model

    _guide(first, model_of(3))()
    with pytest.raises(ValueError, match=r"param store.*clear_param_store"):
        _guide(second, model_of(3 if first != second else 4))()
    pyro.clear_param_store()
    assert _guide(second, model_of(4))()["w"].shape == (4, 2)
