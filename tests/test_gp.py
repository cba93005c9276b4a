import math
import warnings

import pyro
import pyro.contrib.gp as gp
import pytest
import torch

from pyro_smc.gp import MultiOutputGP
from pyro_smc.ops.gp_moments import se_ard_moments


def _data(n=30, D=2, E=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D, generator=g, dtype=dtype)
    W = torch.randn(D, E, generator=g, dtype=dtype)
    Y = torch.sin(X @ W) + 0.1 * torch.randn(n, E, generator=g, dtype=dtype)
    return X, Y, g


def _random_gp(seed=0, **kwargs):
    X, Y, g = _data(seed=seed, **kwargs)
    E, D = Y.shape[1], X.shape[1]
    return MultiOutputGP(
        X,
        Y,
        lengthscale=0.5 + torch.rand(E, D, generator=g, dtype=X.dtype),
        variance=0.5 + torch.rand(E, generator=g, dtype=X.dtype),
        noise=0.01 + 0.1 * torch.rand(E, generator=g, dtype=X.dtype),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_log_marginal_likelihood_matches_pyro_gpregression(seed):
    model = _random_gp(seed)
    ours = model.log_marginal_likelihood()
    assert ours.shape == (3,)
    for a in range(model.output_dim):
        pyro.clear_param_store()  # every GPRegression names its parameters "kernel.lengthscale", ...
        kernel = gp.kernels.RBF(input_dim=2, variance=model.variance[a].detach(), lengthscale=model.lengthscale[a].detach())
        reg = gp.models.GPRegression(model.X, model.Y[:, a], kernel, noise=model.noise[a].detach(), jitter=model.jitter)
        theirs = pyro.poutine.trace(reg.model).get_trace().log_prob_sum()
        assert torch.allclose(ours[a], theirs, rtol=1e-10), (ours[a], theirs)


def test_default_initialisation_is_data_driven():
    X, Y, _ = _data(n=50)
    X = X * torch.tensor([1.0, 10.0])
    model = MultiOutputGP(X, 3 * Y)
    assert model.input_dim == 2 and model.output_dim == 3
    assert torch.allclose(model.lengthscale, X.std(0, unbiased=False).expand(3, 2))
    assert torch.allclose(model.variance, (3 * Y).var(0, unbiased=False))
    assert torch.allclose(model.noise, 0.1 * model.variance)
    # Hyperparameters are optimised in log space.
    names = {name for name, _ in model.named_parameters()}
    assert names == {"lengthscale_unconstrained", "variance_unconstrained", "noise_unconstrained"}
    assert torch.allclose(model.lengthscale_unconstrained, model.lengthscale.log())


@pytest.mark.parametrize("optimizer, seed", [("adam", 0), ("lbfgs", 0), ("lbfgs", 1)])
def test_fit_increases_likelihood_and_recovers_lengthscale(optimizer, seed):
    # Draw one GP sample with lengthscales (0.5, 3) and check the fit finds them roughly.
    g = torch.Generator().manual_seed(seed)
    n = 150
    X = 6 * torch.rand(n, 2, generator=g) - 3
    true_ell = torch.tensor([0.5, 3.0])
    r2 = (((X[:, None] - X) / true_ell) ** 2).sum(-1)
    K = torch.exp(-0.5 * r2) + 1e-8 * torch.eye(n)
    f = torch.linalg.cholesky(K) @ torch.randn(n, generator=g)
    Y = torch.stack([f, -f], -1) + 0.05 * torch.randn(n, 2, generator=g)
    model = MultiOutputGP(X, Y)
    before = model.log_marginal_likelihood().sum().item()
    history = model.fit(num_steps=150 if optimizer == "adam" else 100, lr=0.1 if optimizer == "adam" else None, optimizer=optimizer)
    after = model.log_marginal_likelihood().sum().item()
    assert after > before + 50
    assert history[0] == pytest.approx(-before) and min(history) < -before
    ratio = model.lengthscale.detach() / true_ell
    assert ((ratio > 0.6) & (ratio < 1.6)).all(), model.lengthscale
    assert ((model.noise.detach().sqrt() > 0.02) & (model.noise.detach().sqrt() < 0.1)).all(), model.noise


def test_predictions_follow_hyperparameters_and_cache():
    model = _random_gp(1)
    x = torch.randn(4, 2)
    # With gradients enabled the hyperparameters require grad: the posterior carries a graph and
    # is rebuilt at each call (tests/test_gp_gradients.py); without them it is cached.
    assert model._posterior() is not model._posterior()
    with torch.no_grad():
        post = model._posterior()
        assert model._posterior() is post  # cached while nothing changes
    m1, v1 = model.predict(x)
    with torch.no_grad():
        model.lengthscale_unconstrained.add_(0.3)  # an optimiser-style in-place update
        assert model._posterior() is not post
    m2, v2 = model.predict(x)
    assert not torch.allclose(m1, m2)
    model.noise = pyro.nn.PyroParam(torch.full((3,), 0.5), torch.distributions.constraints.positive)
    _, v3 = model.predict(x, noisy=True)
    _, v4 = model.predict(x)
    assert torch.allclose(v3, v4 + 0.5)


def test_the_cached_posterior_follows_the_data_however_it_changes():
    """Before: the cache was keyed on the data's address and version counter. A new ``Y``
    allocated where a freed one had lived returned the old posterior (4 stale predictions in 20
    reassignments), and writes through ``.data`` bump no version (a doubled ``Y`` predicted as
    before; a doubled ``X`` mixed the new inputs with the old weights). Every prediction now
    equals a freshly built GP's."""
    X = torch.linspace(-2, 2, 15, dtype=torch.float64).unsqueeze(-1)
    x = torch.tensor([[0.3], [1.1]], dtype=torch.float64)
    model = MultiOutputGP(X, torch.sin(X), noise=1e-2)

    def fresh():
        return MultiOutputGP(model.X.detach().clone(), model.Y.detach().clone(), model.lengthscale.detach(), model.variance.detach(), model.noise.detach())

    with torch.no_grad():
        for k in range(1, 41):
            model.Y = torch.sin(X) + 0.1 * k
            if k % 2 == 0:
                assert torch.allclose(model.predict(x)[0], fresh().predict(x)[0], atol=1e-12), k
        model.Y.data.mul_(2)
        assert torch.allclose(model.predict(x)[0], fresh().predict(x)[0], atol=1e-12)
        model.X.data.mul_(2)
        for a, b in zip(model.predict(x), fresh().predict(x)):
            assert torch.allclose(a, b, atol=1e-12)


def test_predict_moments_and_linearize():
    model = _random_gp(2)
    mean, cov = torch.tensor([0.2, -0.1]), torch.tensor([[0.2, 0.05], [0.05, 0.1]])
    M, V, C = model.predict_moments(mean, cov)
    assert M.shape == (3,) and V.shape == (3, 3) and C.shape == (2, 3)
    post = model._posterior()
    for a, b in zip((M, V, C), se_ard_moments(mean, cov, *post[:5])):
        assert torch.equal(a, b)
    _, Vn, _ = model.predict_moments(mean, cov, noisy=True)
    assert torch.allclose(Vn, V + torch.diag(model.noise.detach()))
    # Batched inputs and gradients with respect to the input mean.
    Mb, Vb, Cb = model.predict_moments(mean.expand(5, 2), cov)
    assert Mb.shape == (5, 3) and Vb.shape == (5, 3, 3) and Cb.shape == (5, 2, 3)
    J = torch.autograd.functional.jacobian(lambda m: model.predict_moments(m, cov)[0], mean)
    assert torch.allclose(J, torch.linalg.solve(cov, C).T, atol=1e-8)
    # Linearisation: the Jacobian of the predictive mean.
    x = torch.randn(2)
    m, jac, var = model.linearize(x)
    assert torch.allclose(jac, torch.autograd.functional.jacobian(lambda z: model.predict(z)[0], x), atol=1e-10)
    pm, pv = model.predict(x)
    assert torch.allclose(m, pm) and torch.allclose(var, pv)
    _, _, var_noisy = model.linearize(x, noisy=True)
    assert torch.allclose(var_noisy, var + model.noise.detach())


def test_float32_and_device(device):
    X, Y, _ = _data(dtype=torch.float32)
    model = MultiOutputGP(X.to(device), Y.to(device), noise=0.01)
    assert model.lengthscale.dtype == torch.float32 and model.lengthscale.device.type == device.type
    model.fit(num_steps=5)
    mean, var = model.predict(torch.zeros(2, device=device))
    M, V, C = model.predict_moments(torch.zeros(2, device=device), 0.1 * torch.eye(2, device=device))
    for t in (mean, var, M, V, C):
        assert t.dtype == torch.float32 and t.device.type == device.type and torch.isfinite(t).all()
    ref = MultiOutputGP(X.double(), Y.double(), lengthscale=model.lengthscale.double(), variance=model.variance.double(), noise=model.noise.double())
    M64, V64, C64 = ref.predict_moments(torch.zeros(2), 0.1 * torch.eye(2))
    assert torch.allclose(M.cpu().double(), M64, atol=1e-4) and torch.allclose(V.cpu().double(), V64, atol=1e-4)


def test_submodules_get_distinct_pyro_names():
    # Two GPs inside one PyroModule record their hyperparameters under distinct names.
    class Pair(pyro.nn.PyroModule):
        def __init__(self):
            super().__init__()
            self.f = _random_gp(0)
            self.g = _random_gp(1)

        def forward(self, x):
            return self.f.predict(x)[0] + self.g.predict(x)[0]

    pair = Pair()
    tr = pyro.poutine.trace(pair).get_trace(torch.zeros(2))
    assert {"f.lengthscale", "g.lengthscale", "f.noise", "g.noise"} <= set(tr.nodes)
    assert not torch.allclose(pyro.param("f.lengthscale"), pyro.param("g.lengthscale"))


def _bad(**overrides):
    X, Y, _ = _data()
    kwargs = dict(X=X, Y=Y)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (_bad(X=torch.zeros(30)), "X"),
        (_bad(Y=torch.zeros(29, 3)), "Y"),
        (_bad(X=torch.full((30, 2), math.nan)), "X"),
        (_bad(Y=torch.full((30, 3), math.inf)), "Y"),
        (_bad(lengthscale=torch.tensor([1.0, -1.0])), "lengthscale"),
        (_bad(lengthscale=torch.ones(3, 3)), "lengthscale"),
        (_bad(variance=0.0), "variance"),
        (_bad(noise=torch.tensor([1.0, math.nan, 1.0])), "noise"),
        (_bad(jitter=-1.0), "jitter"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiOutputGP(**kwargs)


def test_bad_calls():
    model = _random_gp(0)
    with pytest.raises(ValueError, match="x"):
        model.predict(torch.zeros(3))
    with pytest.raises(ValueError, match="x"):
        model.linearize(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="mean"):
        model.predict_moments(torch.zeros(3), torch.eye(2))
    with pytest.raises(ValueError, match="cov"):
        model.predict_moments(torch.zeros(2), torch.eye(3))
    with pytest.raises(ValueError, match="optimizer"):
        model.fit(optimizer="sgd")


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_lbfgs_line_search_backs_off_instead_of_diverging(seed):
    # Regression: strong-Wolfe trial steps used to drive the log-hyperparameters to +-inf.
    g = torch.Generator().manual_seed(seed)
    X = -10 + 20 * torch.rand(30, 1, generator=g)
    Y = 4 * torch.sin(X) + 0.1 * torch.randn(30, 1, generator=g)
    gp = MultiOutputGP(X, Y)
    start = float(gp.log_marginal_likelihood().sum().detach())
    history = gp.fit(num_steps=100, optimizer="lbfgs")
    assert all(bool(torch.isfinite(p).all()) for p in (gp.lengthscale, gp.variance, gp.noise))
    assert -history[-1] > start


def test_a_float32_gp_with_small_noise_warns():
    """A float32 GP whose noise is a small fraction of its signal variance gave predictive
    variances 600 times too large (noise 2e-5 of the variance) without a word; it now warns once.
    A well-conditioned float32 GP stays silent."""
    X = torch.linspace(-3, 3, 40).unsqueeze(-1).float() + 5.0
    Y = torch.cat([X.sin(), X.cos()], -1)
    with pytest.warns(UserWarning, match="too ill-conditioned for float32") as record:
        model = MultiOutputGP(X, Y, noise=1e-5)
        model.predict(X[:2])
        model.predict(X[:3])
    assert sum("float32" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiOutputGP(X, Y, noise=0.1).predict(X[:2])
        MultiOutputGP(X.double(), Y.double(), noise=1e-5).predict(X[:2].double())
