import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO

from pyro_smc.guides import AutoKroneckerFlow
from pyro_smc.guides.kronecker.flow import factor_from_params, params_from_factor
from tests.cases import DTYPE_IDS, DTYPES

KINDS = ["diag", "linear", "nonlinear"]
SIGMA = 0.3


def _flow_options(kind, hidden_dims):
    """``hidden_dims`` for the kind that has flows (the others reject it)."""
    return {"hidden_dims": hidden_dims} if kind == "nonlinear" else {}


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1], 2]).to_event(2))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, SIGMA * s).to_event(1), obs=y)


def conv_model(x):
    pyro.sample("kernel", dist.Normal(0.0, 1.0).expand([4, 2, 3, 3]).to_event(4))
    pyro.sample("b", dist.Normal(0.0, 1.0).expand([4]).to_event(1))


def known_noise_regression(x, y):
    """Multi-output regression with known noise: a conjugate matrix-normal posterior."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, SIGMA).to_event(1), obs=y)


def _exact_log_evidence(x, y):
    marginal = dist.MultivariateNormal(torch.zeros(x.shape[0]), x @ x.T + SIGMA**2 * torch.eye(x.shape[0]))
    return float(sum(marginal.log_prob(y[:, e]) for e in range(y.shape[1])))


def _data(seed=0, n=30, d=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, x @ torch.randn(d, 2, generator=g) + SIGMA * torch.randn(n, 2, generator=g)


@pytest.mark.parametrize("kind", KINDS)
def test_svi_runs_and_model_guide_match(kind):
    x, y = _data()
    guide = AutoKroneckerFlow(regression, kind=kind, **_flow_options(kind, (8,)))
    pyro.enable_validation(True)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pyro reports model/guide mismatches as warnings
        elbos = [Trace_ELBO()] + ([TraceMeanField_ELBO()] if kind != "nonlinear" else [])
        for elbo in elbos:
            svi = SVI(regression, guide, pyro.optim.Adam({"lr": 0.02}), elbo)
            losses += [svi.step(x, y) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    samples = Predictive(regression, guide=guide, num_samples=5)(x)
    # Predictive pads global sites with the model's plate dims, as for every AutoGuide.
    assert samples["w"].shape == (5, 1, 3, 2) and samples["y"].shape == (5, 30, 2)
    assert (samples["s"] > 0).all()


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kronecker_flow_svi_in_both_dtypes(dtype, kind):
    torch.set_default_dtype(dtype)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 2, dtype=dtype), 1.0).to_event(2))
        s = pyro.sample("s", dist.LogNormal(torch.zeros((), dtype=dtype), 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(x @ w, 0.3 * s).to_event(1), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g, dtype=dtype)
    y = x @ torch.randn(3, 2, generator=g, dtype=dtype) + 0.3 * torch.randn(20, 2, generator=g, dtype=dtype)
    guide = AutoKroneckerFlow(model, kind=kind, **_flow_options(kind, (8,)))
    elbos = [Trace_ELBO()] + ([TraceMeanField_ELBO()] if kind != "nonlinear" else [])
    losses = []
    for elbo in elbos:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), elbo)
        losses += [svi.step(x, y) for _ in range(4)]
    assert all(math.isfinite(v) for v in losses), losses
    params = dict(guide.named_parameters())
    assert params and all(p.dtype == dtype for p in params.values()), {k: p.dtype for k, p in params.items()}
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
    draw = guide(x, y)
    assert draw["w"].dtype == dtype and draw["w"].shape == (3, 2) and torch.isfinite(draw["w"]).all()
    assert guide.median(x, y)["w"].dtype == dtype


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_count_matches_formula(kind):
    n, p = 4, 2 * 3 * 3
    guide = AutoKroneckerFlow(conv_model, kind=kind, **_flow_options(kind, (8,)))
    guide(torch.zeros(1))
    matrix = {"diag": n * p + n + p, "linear": n * p + n * (n + 1) // 2 + p * (p + 1) // 2}
    matrix["nonlinear"] = matrix["linear"] + sum(q.numel() for q in guide.flows.parameters())
    other = 2 * 4  # diagonal normal for "b"
    assert sum(q.numel() for q in guide.parameters()) == matrix[kind] + other
    assert guide(torch.zeros(1))["kernel"].shape == (4, 2, 3, 3)


def test_linear_guide_at_the_exact_posterior_gives_the_exact_evidence():
    # Bayesian multi-output regression with known noise: the posterior of W (d x 2) is a matrix
    # normal with row covariance Sigma = (X^T X / s^2 + I)^-1 and identity column covariance.
    # With the guide set to it, log p(y, W) - log q(W) equals log p(y) for every draw.
    x, y = _data(1)

    precision = x.T @ x / SIGMA**2 + torch.eye(3)
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y / SIGMA**2
    chol = torch.linalg.cholesky(cov)
    guide = AutoKroneckerFlow(known_noise_regression, kind="linear")
    guide(x, y)
    with torch.no_grad():
        guide.locs.w.copy_(mean)
        guide.row_factors.w.copy_(params_from_factor(chol))
        guide.col_factors.w.copy_(params_from_factor(torch.eye(2)))
    log_evidence = _exact_log_evidence(x, y)
    elbos = [-Trace_ELBO().loss(known_noise_regression, guide, x, y) for _ in range(5)]
    assert all(abs(e - log_evidence) < 1e-8 for e in elbos)


def test_state_dict_round_trip_and_median():
    x, y = _data()
    guide = AutoKroneckerFlow(regression, kind="nonlinear", hidden_dims=(8,))
    svi = SVI(regression, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
    other = AutoKroneckerFlow(regression, kind="nonlinear", hidden_dims=(8,))
    other(x, y)
    other.load_state_dict(guide.state_dict())
    for key, value in guide.median(x, y).items():
        assert torch.allclose(other.median(x, y)[key], value)


def test_bad_input():
    with pytest.raises(ValueError, match="kind"):
        AutoKroneckerFlow(regression, kind="full")
    with pytest.raises(ValueError, match="flow"):
        AutoKroneckerFlow(regression, flow="glow")
    with pytest.raises(ValueError, match="init_scale"):
        AutoKroneckerFlow(regression, init_scale=0.0)
    # Finite, but beyond float32: the factors' share sqrt(init_scale) used to underflow to a
    # singular factor (a constraint error on a zero matrix) or overflow in torch.full_like.
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    for dtype, extremes in ((torch.float32, (1e-300, 1e300)), (torch.float64, (1e-310,))):
        for extreme in extremes:
            with pytest.raises(ValueError, match=rf"init_scale=.*site 'w'.*{dtype}"):
                AutoKroneckerFlow(_on(regression, dtype), kind="linear", init_scale=extreme)(x.to(dtype), y.to(dtype))


def _on(model, dtype):
    """``model`` run with ``dtype`` as the default dtype (its priors' draws take it)."""

    def run(*args):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return model(*args)
        finally:
            torch.set_default_dtype(old)

    return run


def test_model_without_matrix_sites_is_autonormal_without_a_warning():
    # A drop-in must not turn a Pyro test suite run with warnings as errors into failures.
    def vector_model():
        pyro.sample("z", dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    guide = AutoKroneckerFlow(vector_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide()
    assert guide.matrix_sites == {}
    assert set(dict(guide.named_parameters())) == {"locs.z", "scales.z_unconstrained"} or len(list(guide.parameters())) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_unsupported_supports_get_pyros_helpful_errors(kind):
    def discrete():
        pyro.sample("coin", dist.Bernoulli(0.5))

    def spherical():
        pyro.sample("direction", dist.ProjectedNormal(torch.ones(3)))

    with pytest.raises(ValueError, match="discrete sample site 'coin'"):
        AutoKroneckerFlow(discrete, kind=kind)()
    with pytest.raises(ValueError, match="spherical sample site 'direction'"):
        AutoKroneckerFlow(spherical, kind=kind)()


def test_the_additive_coupling_preserves_volume_and_the_affine_one_does_not():
    from pyro_smc.guides.kronecker.transforms import AdditiveCoupling, kronecker_nonlinear

    with pytest.raises(ValueError, match="flow must be one of"):
        AutoKroneckerFlow(regression, flow="realnvp", hidden_dims=(8,))  # the removed old name
    assert isinstance(kronecker_nonlinear(3, 4, "additive_coupling")[0].base, AdditiveCoupling)
    # "affine_coupling" is RealNVP proper: once its scale network moves, volume is not preserved.
    g = kronecker_nonlinear(3, 4, "affine_coupling", (8,))
    with torch.no_grad():
        for q in g.parameters():
            q.add_(0.5)
    e = torch.randn(3, 4)
    assert g.log_abs_det_jacobian(e, g(e)).abs() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_matrix_sites_are_decided_on_the_unconstrained_value(kind):
    # LKJCholesky's value is a 2x2 matrix but its unconstrained value a 1-vector: a vector site.
    # A positive matrix (LogNormal) is a matrix site; so are matrices inside a plate.
    def model():
        pyro.sample("corr", dist.LKJCholesky(2, 1.0))
        pyro.sample("w", dist.LogNormal(0.0, 1.0).expand([3, 2]).to_event(2))
        with pyro.plate("groups", 4):
            pyro.sample("v", dist.Normal(0.0, 1.0).expand([4, 2, 3]).to_event(2))

    guide = AutoKroneckerFlow(model, kind=kind, **_flow_options(kind, (4,)))
    sample = guide()
    assert guide.matrix_sites == {"w": (3, 2), "v": (2, 3)}
    assert sample["corr"].shape == (2, 2) and sample["w"].shape == (3, 2) and sample["v"].shape == (4, 2, 3)
    torch.testing.assert_close(sample["corr"] @ sample["corr"].T, sample["corr"] @ sample["corr"].T)
    assert torch.allclose((sample["corr"] @ sample["corr"].T).diagonal(), torch.ones(2))
    median = guide.median()
    assert median["corr"].shape == (2, 2) and median["v"].shape == (4, 2, 3) and (median["w"] > 0).all()
    # Under vectorised particles a value gains exactly one leading dim (and the plate's).
    draws = Predictive(model, guide=guide, num_samples=10, parallel=True)()
    assert draws["corr"].shape == (10, 1, 2, 2) and draws["v"].shape == (10, 4, 2, 3)
    # Each plate element has its own factors.
    assert guide.row_factors.v.shape[0] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_median_returns_detached_copies(kind):
    x, y = _data()
    guide = AutoKroneckerFlow(regression, kind=kind, **_flow_options(kind, (8,)))
    guide(x, y)
    median = guide.median(x, y)
    assert not any(v.requires_grad for v in median.values())
    median["w"].add_(100.0)
    assert (guide.median(x, y)["w"] - median["w"]).abs().min() > 99


@pytest.mark.parametrize("kind", KINDS)
def test_subsampled_local_latents_have_full_size_parameters(kind):
    # Each of 50 points has its own mean z_i (scalar) and matrix m_i; the plate subsamples 20 a
    # step. The guide must keep 50 of each and learn every one, not share the first minibatch's.
    data = torch.linspace(-2.0, 2.0, 50)

    def model():
        with pyro.plate("data", 50, subsample_size=20) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 3.0))
            m = pyro.sample("m", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
            pyro.sample("y", dist.Normal(z, 0.1), obs=data[idx])
            pyro.sample("y_m", dist.Normal(m, 0.1).to_event(2), obs=data[idx, None, None].expand(-1, 2, 2))

    pyro.set_rng_seed(0)
    guide = AutoKroneckerFlow(model, kind=kind, **_flow_options(kind, (4,)))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(600):
        svi.step()
    median = guide.median()
    assert median["z"].shape == (50,) and median["m"].shape == (50, 2, 2)
    # Posterior means: the data shrunk by the prior (noise sd 0.1 against prior sds 3 and 1), up to
    # Adam's noise: within 3 posterior sds (0.1). Shared parameters would miss by up to 4.
    assert (median["z"] - data).abs().max() < 0.3
    assert (median["m"] - data[:, None, None] / 1.01).abs().max() < 0.3


def test_user_subsample_indices_select_the_parameters():
    def model(idx):
        with pyro.plate("data", 50, subsample=idx):
            pyro.sample("m", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))

    guide = AutoKroneckerFlow(model, kind="linear", create_plates=lambda idx: pyro.plate("data", 50, subsample=idx))
    guide(torch.arange(20))
    with torch.no_grad():
        guide.locs.m.copy_(torch.arange(50.0)[:, None, None].expand(50, 2, 2))
        guide.row_factors.m.fill_(-30.0)  # log scale: a point mass at the location
    for idx in (torch.arange(10), torch.tensor([49, 3, 7])):
        draw = guide(idx)["m"]
        assert draw.shape == (len(idx), 2, 2)
        torch.testing.assert_close(draw, idx.to(draw.dtype)[:, None, None].expand(-1, 2, 2))


@pytest.mark.parametrize("flow", ["additive_coupling", "affine_coupling", "iaf"])
def test_nonlinear_guide_is_jit_traceable(flow):
    from pyro.infer import JitTrace_ELBO

    x, y = _data()
    guide = AutoKroneckerFlow(regression, kind="nonlinear", flow=flow, hidden_dims=(8,))
    svi = SVI(regression, guide, pyro.optim.Adam({"lr": 0.01}), JitTrace_ELBO(ignore_jit_warnings=True))
    assert all(math.isfinite(svi.step(x, y)) for _ in range(3))
    predictive = Predictive(regression, guide=guide, num_samples=7, return_sites=["w", "y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace_module(predictive, {"call": (x,)}, check_trace=False)
    w, y_pred = traced.call(x)
    assert w.shape == (7, 1, 3, 2) and y_pred.shape == (7, 30, 2)


class BNN(pyro.nn.PyroModule):
    """A 2-layer Bayesian MLP written the usual Pyro way."""

    def __init__(self, d_in=3, hidden=4, d_out=2):
        super().__init__()
        self.fc1 = pyro.nn.PyroModule[torch.nn.Linear](d_in, hidden)
        self.fc1.weight = pyro.nn.PyroSample(dist.Normal(0.0, 1.0).expand([hidden, d_in]).to_event(2))
        self.fc1.bias = pyro.nn.PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.fc2 = pyro.nn.PyroModule[torch.nn.Linear](hidden, d_out)
        self.fc2.weight = pyro.nn.PyroSample(dist.Normal(0.0, 1.0).expand([d_out, hidden]).to_event(2))
        self.fc2.bias = pyro.nn.PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x, y=None, batch_size=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            pyro.sample("y", dist.Categorical(logits=logits[idx]), obs=None if y is None else y[idx])
        return logits


@pytest.mark.parametrize("kind", KINDS)
def test_pyro_module_bnn_with_minibatches(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    y = (x[:, 0] > 0).long()
    model = BNN()
    guide = AutoKroneckerFlow(model, kind=kind, **_flow_options(kind, (8,)))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    losses = [svi.step(x, y, batch_size=10) for _ in range(5)]
    assert all(math.isfinite(v) for v in losses)
    assert guide.matrix_sites == {"fc1.weight": (4, 3), "fc2.weight": (2, 4)}
    assert guide.median(x)["fc1.weight"].shape == (4, 3)


def test_fitted_linear_guide_reaches_the_exact_evidence():
    # The K-Linear family contains this posterior: after fitting, the ELBO is within Monte Carlo
    # error (and a small optimisation gap) of log p(y).
    x, y = _data(2)

    log_evidence = _exact_log_evidence(x, y)
    pyro.set_rng_seed(0)
    guide = AutoKroneckerFlow(known_noise_regression, kind="linear", init_scale=0.05)
    # One particle per step (this model's `x @ w` is not written for vectorised particles) and a
    # decaying step size, so the end point is close to the optimum rather than SGD noise.
    svi = SVI(known_noise_regression, guide, pyro.optim.ClippedAdam({"lr": 0.03, "lrd": 0.998}), TraceMeanField_ELBO())
    for _ in range(2000):
        svi.step(x, y)
    elbos = torch.tensor([-Trace_ELBO().loss(known_noise_regression, guide, x, y) for _ in range(200)])
    gap = log_evidence - float(elbos.mean())
    se = float(elbos.std()) / math.sqrt(len(elbos))
    assert gap > -5 * se  # the ELBO never exceeds the evidence
    assert gap < 0.1 + 5 * se


def test_nonlinear_log_density_equals_the_brute_force_change_of_variables():
    # log q(W) = log N(E) - log|det dW/dE| with the full (np x np) Jacobian of E -> W.
    guide = AutoKroneckerFlow(lambda: pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2)), kind="nonlinear", hidden_dims=(8,))
    guide()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in guide.parameters():
            q.add_(0.3 * torch.randn(q.shape, generator=g))
    posterior = guide._posterior("w")
    E = torch.randn(3, 4, generator=g)
    transform = torch.distributions.transforms.ComposeTransform(posterior.transforms)
    W = transform(E)
    jac = torch.autograd.functional.jacobian(lambda e: transform(e.reshape(3, 4)).reshape(-1), E.reshape(-1))
    expected = dist.Normal(0.0, 1.0).log_prob(E).sum() - torch.linalg.slogdet(jac)[1]
    assert torch.allclose(posterior.log_prob(W), expected, atol=1e-8)
    assert torch.allclose(posterior.log_prob(W.clone()), expected, atol=1e-8)  # without the cache


@pytest.mark.parametrize("kind", ["diag", "linear"])
def test_quantiles_match_sample_quantiles(kind):
    x, y = _data()
    guide = AutoKroneckerFlow(regression, kind=kind)
    guide(x, y)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in guide.parameters():
            q.add_(0.2 * torch.randn(q.shape, generator=g))
    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    assert quantiles["w"].shape == (3, 3, 2) and quantiles["s"].shape == (3,)
    assert torch.allclose(quantiles["w"][1], guide.median()["w"], atol=1e-10)
    # 4000 draws in one vectorised call (an outer plate, as Predictive(parallel=True) draws).
    with torch.no_grad(), pyro.plate("draws", 4000, dim=-2):
        draws = guide(x, y)["w"].squeeze(1)
    empirical = torch.quantile(draws, torch.tensor([0.1, 0.9]), dim=0)
    # Sample quantiles of 4000 normal draws: sd about 1.7 sigma / sqrt(n) at the 10 % level.
    sd = draws.std(0)
    assert ((empirical - quantiles["w"][[0, 2]]).abs() < 5 * 1.7 * sd / math.sqrt(4000)).all()


def test_nonlinear_quantiles_are_monte_carlo_and_reproducible():
    x, y = _data()
    linear = AutoKroneckerFlow(regression, kind="linear")
    linear(x, y)
    guide = AutoKroneckerFlow(regression, kind="nonlinear", hidden_dims=(8,))
    guide(x, y)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same locations and factors; the flows stay the identity
        for name in ("locs.w", "row_factors.w", "col_factors.w"):
            q = guide.get_parameter(name)
            q.copy_(linear.get_parameter(name).add_(0.2 * torch.randn(q.shape, generator=g)))
    state = torch.get_rng_state()
    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(guide.quantiles([0.1, 0.5, 0.9])["w"], quantiles["w"])
    exact = linear.quantiles([0.1, 0.5, 0.9])["w"]
    # A sample quantile of S normal draws has sd sqrt(q (1 - q) / S) / pdf(z_q) sigma.
    S, sigma = guide.quantile_samples, (exact[2] - exact[0]) / (2 * 1.2816)
    se = torch.tensor([0.3 / 0.1755, 0.5 / 0.3989, 0.3 / 0.1755])[:, None, None] / math.sqrt(S) * sigma
    assert ((quantiles["w"] - exact).abs() < 5 * se).all()
    assert quantiles["s"].shape == (3,)


@pytest.mark.parametrize("kind", ["diag", "linear", "nonlinear"])
def test_init_loc_fn_sets_the_locations(kind):
    from pyro.infer.autoguide.initialization import init_to_value

    def model():
        pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
        pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    pyro.clear_param_store()
    values = {"w": torch.full((3, 2), 0.7), "b": torch.tensor([1.0, 2.0])}
    guide = AutoKroneckerFlow(model, kind=kind, init_loc_fn=init_to_value(values=values))
    guide()
    median = guide.median()
    torch.testing.assert_close(median["w"].detach(), values["w"])
    torch.testing.assert_close(median["b"].detach(), values["b"])


def test_factor_parameterisation_is_row_scaled_and_invertible():
    """L = D (I + N): the stored off-diagonals are relative to their row's diagonal."""
    g = torch.Generator().manual_seed(0)
    params = torch.randn(2, 10, generator=g)
    factor = factor_from_params(params, 4)
    rows, cols = torch.tril_indices(4, 4)
    diag = params[..., rows == cols].exp()
    expected = torch.zeros(2, 4, 4)
    expected[..., rows, cols] = torch.where(rows == cols, diag[..., rows], params * diag[..., rows])
    torch.testing.assert_close(factor, expected)
    torch.testing.assert_close(params_from_factor(factor), params)
    with pytest.raises(ValueError, match="positive diagonal"):
        params_from_factor(-torch.eye(3))


def test_kinds_are_strategy_objects_and_open_to_new_families():
    from pyro_smc.guides.kronecker.kinds import DiagKind, NonlinearKind

    x, y = _data()
    by_name = AutoKroneckerFlow(regression, kind="nonlinear", flow="iaf", hidden_dims=(8,))
    by_object = AutoKroneckerFlow(regression, kind=NonlinearKind(flow="iaf", hidden_dims=(8,)))
    for guide in (by_name, by_object):
        pyro.clear_param_store()
        guide(x, y)
    assert by_object.kind == "nonlinear" and by_object.flow == "iaf"
    assert by_name.state_dict().keys() == by_object.state_dict().keys()

    class IsotropicKind(DiagKind):
        """A new family: A = a I and B = b I, one scale each (the guide needs no change)."""

        name = "isotropic"

        def init_factor(self, size, scale, like, batch):
            return like.new_full(batch + (1,), scale), torch.distributions.constraints.positive

        def factor(self, params, size):
            return torch.diag_embed(params.expand(params.shape[:-1] + (size,)))

    pyro.clear_param_store()  # the guides above used the same parameter names
    guide = AutoKroneckerFlow(regression, kind=IsotropicKind(), init_scale=0.04)
    svi = SVI(regression, guide, pyro.optim.Adam({"lr": 0.02}), TraceMeanField_ELBO())
    assert all(math.isfinite(svi.step(x, y)) for _ in range(3))
    assert guide.row_factors.w.shape == (1,) and guide.kind == "isotropic"
    q = guide.quantiles([0.5, 0.8413447])["w"]
    spread = q[1] - q[0]  # one sd, the same for every entry: a * b
    torch.testing.assert_close(spread, torch.full_like(spread, float((guide.row_factors.w * guide.col_factors.w).detach())), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        AutoKroneckerFlow(regression, kind="full")
