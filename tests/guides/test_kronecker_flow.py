import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO

from pyro_smc.guides import AutoKroneckerFlow
from pyro_smc.guides.kronecker_flow import factor_from_params, params_from_factor

KINDS = ["diag", "linear", "nonlinear"]
SIGMA = 0.3


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
    guide = AutoKroneckerFlow(regression, kind=kind, hidden_dims=(8,))
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


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_count_matches_formula(kind):
    n, p = 4, 2 * 3 * 3
    guide = AutoKroneckerFlow(conv_model, kind=kind, hidden_dims=(8,))
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
        guide.scales.w_row.copy_(params_from_factor(chol))
        guide.scales.w_col.copy_(params_from_factor(torch.eye(2)))
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

    def vector_model():
        pyro.sample("z", dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    guide = AutoKroneckerFlow(vector_model)
    with pytest.warns(UserWarning, match="no matrix-valued"):
        guide()

    def plated_matrices():
        with pyro.plate("layers", 2):
            pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3, 3]).to_event(2))

    with pytest.raises(ValueError, match="'w'"):
        AutoKroneckerFlow(plated_matrices)()


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
    guide = AutoKroneckerFlow(model, kind=kind, hidden_dims=(8,))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    losses = [svi.step(x, y, batch_size=10) for _ in range(5)]
    assert all(math.isfinite(v) for v in losses)
    assert set(guide._matrix_shapes) == {"fc1.weight", "fc2.weight"}
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
    site = next(guide.prototype_trace.iter_stochastic_nodes())[1]
    posterior = guide._posterior("w", site)
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
    draws = torch.stack([guide(x, y)["w"] for _ in range(4000)])
    empirical = torch.quantile(draws, torch.tensor([0.1, 0.9]), dim=0)
    # Sample quantiles of 4000 normal draws: sd about 1.7 sigma / sqrt(n) at the 10 % level.
    sd = draws.std(0)
    assert ((empirical - quantiles["w"][[0, 2]]).abs() < 5 * 1.7 * sd / math.sqrt(4000)).all()
    with pytest.raises(NotImplementedError):
        AutoKroneckerFlow(regression, kind="nonlinear").quantiles([0.5], x, y)


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
