import math

import pytest
import torch

import pyro_smc.ops.ensemble as ensemble_module
import pyro_smc.ops.sinkhorn_implicit as sk
from pyro_smc.ops.ensemble import ensemble_solve, ensemble_transform
from pyro_smc.ops.sinkhorn import SinkhornSettings
from tests.cases import DTYPE_IDS, DTYPES, EPSILONS, ot_threshold


@pytest.fixture(autouse=True, params=["saved", "rebuilt"])
def kernel_for_the_backward(request, monkeypatch):
    """Every test runs twice: with the fused transform's symmetric kernel saved for the backward
    pass (small kernels) and rebuilt there from the potentials (large ones)."""
    if request.param == "rebuilt":
        monkeypatch.setattr(ensemble_module, "_SAVED_KERNEL_MAX_BYTES", -1)
    return request.param


def _cloud(batch, n, d=2, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, d, generator=g)
    log_w = (spread * torch.randn(batch, n, generator=g)).log_softmax(-1)
    return x, log_w


def _grads(x, log_w, mode, eps=0.3, threshold=1e-12, weights_out=None):
    xr, lr = x.clone().requires_grad_(), log_w.clone().requires_grad_()
    x_new, _ = ensemble_transform(xr, lr, eps, threshold=threshold, max_iter=20000, gradient=mode)
    probe = torch.linspace(-1, 1, x_new.numel(), dtype=x.dtype).reshape(x_new.shape)
    ((x_new * probe).sum() + x_new.square().sum()).backward()
    return x_new.detach(), xr.grad, lr.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_implicit_gradient_matches_autograd_through_the_iterations(seed):
    # Oracle: autograd through every Sinkhorn iteration (exact for the iterate it returns),
    # converged to 1e-12.
    x, log_w = _cloud(3, 12, seed=seed, spread=2.0)
    log_w[1, :2] = -math.inf  # particles of zero weight
    log_w = log_w - log_w.logsumexp(-1, keepdim=True)
    fused, unrolled = _grads(x, log_w, "implicit"), _grads(x, log_w, "unroll")
    for a, b in zip(fused, unrolled):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_implicit_gradcheck_in_the_log_weights(seed):
    x, log_w = _cloud(2, 6, seed=seed, spread=1.5)
    log_w.requires_grad_()

    def fn(log_w):
        log_w = log_w - log_w.logsumexp(-1, keepdim=True)
        return ensemble_transform(x, log_w, 0.4, threshold=1e-13, max_iter=20000)[0]

    assert torch.autograd.gradcheck(fn, (log_w,), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dim", [1, 3])
def test_fused_implicit_gradcheck_in_the_particles(dim):
    """The scale delta = sqrt(D) max_k std(x_k) is differentiated too, so the gradient in the
    particles is the finite-difference derivative of the computed transform."""
    x, log_w = _cloud(2, 7, d=dim, seed=dim, spread=1.5)
    x.requires_grad_()

    def fn(x):
        return ensemble_transform(x, log_w, 0.4, threshold=1e-13, max_iter=20000)[0]

    assert torch.autograd.gradcheck(fn, (x,), atol=1e-6, rtol=1e-5)


def test_implicit_plan_carries_no_gradient_but_other_modes_do():
    x, log_w = _cloud(2, 8, seed=3)
    x.requires_grad_()
    _, plan = ensemble_transform(x, log_w, 0.5)
    assert not plan.requires_grad
    _, plan = ensemble_transform(x, log_w, 0.5, gradient="unroll")
    assert plan.requires_grad


@pytest.mark.parametrize("gradient", ["implicit", "last_step", "unroll"])
def test_a_solve_without_the_plan_moves_the_particles_and_their_gradients_alike(gradient):
    # plan=False only skips the (N, N) output: same particles, same gradients, no plan.
    x, log_w = _cloud(3, 10, seed=4, spread=2.0)
    settings = SinkhornSettings(0.4, threshold=1e-8, max_iter=5000, gradient=gradient)
    outs = []
    for plan in (True, False):
        xr, lr = x.clone().requires_grad_(), log_w.clone().requires_grad_()
        out = ensemble_solve(xr, lr, settings, plan=plan)
        assert (out.plan is None) == (not plan)
        outs.append((out.x_new.detach(), *torch.autograd.grad(out.x_new.square().sum(), (xr, lr))))
    for with_plan, without in zip(*outs):
        assert torch.equal(with_plan, without)


def test_implicit_gradient_with_zero_weights_is_finite():
    x, log_w = _cloud(1, 8, seed=5)
    log_w[0, :3] = -math.inf
    log_w = log_w - log_w.logsumexp(-1, keepdim=True)
    x.requires_grad_()
    log_w.requires_grad_()
    x_new, _ = ensemble_transform(x, log_w, 0.5)
    x_new.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.isfinite(log_w.grad).all() and (log_w.grad[0, :3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ensemble_transform_preserves_weighted_mean(dtype):
    x, log_w = _cloud(3, 64, d=3, seed=6, spread=2.0)
    x, log_w = x.to(dtype), log_w.to(dtype)
    x_new, plan = ensemble_transform(x, log_w, 0.5, threshold=1e-5, max_iter=1000)
    target = (log_w.exp().unsqueeze(-1) * x).sum(-2)
    tol = 1e-4 if dtype == torch.float32 else 1e-6
    # Column marginal error <= threshold bounds the mean error by threshold * max |x|.
    assert torch.allclose(x_new.mean(-2), target, atol=tol * 10 * x.abs().max().item())
    assert x_new.dtype == plan.dtype == dtype


@pytest.mark.parametrize("epsilon", [0.1, 0.02, 0.01])
@pytest.mark.parametrize("seed", [0, 1])
def test_small_epsilon_converges_in_float32(epsilon, seed):
    # Particle weights from a sharp likelihood underflow float32 (log-weights near -90): the
    # kernel-domain iterations must recover from overflowing scalings and still converge.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 100, 2, generator=g)
    y = torch.randn(16, 1, 2, generator=g)
    log_w = (-0.5 * (x - y).square().sum(-1) / 0.1).log_softmax(-1)
    threshold = 1e-3
    x_new, plan = ensemble_transform(x, log_w, epsilon, threshold=threshold, max_iter=2000)
    assert torch.isfinite(x_new).all() and torch.isfinite(plan).all()
    col_err = (plan.sum(-2) - log_w.exp()).abs().sum(-1)
    assert col_err.max() < 2 * threshold
    assert torch.allclose(plan.sum(-1), torch.full_like(plan[..., 0], 1 / 100), atol=1e-6)


def test_conjugate_gradient_adjoint_matches_dense(monkeypatch):
    # Small problems try CG first and hand unconverged ones to a dense Cholesky solve; large
    # problems use CG only. All three routes must give the same gradients.
    x, log_w = _cloud(3, 12, seed=8, spread=1.5)
    cg_then_dense = _grads(x, log_w, "implicit")
    monkeypatch.setattr(sk, "_CG_STEPS_BEFORE_DENSE", 0)
    dense = _grads(x, log_w, "implicit")
    monkeypatch.setattr(sk, "_CG_STEPS_BEFORE_DENSE", 2)
    mixed = _grads(x, log_w, "implicit")
    monkeypatch.setattr(sk, "_DENSE_SOLVE_MAX", 4)
    cg_only = _grads(x, log_w, "implicit")
    for other in (cg_then_dense, mixed, cg_only):
        for d, c in zip(dense, other):
            assert torch.allclose(d, c, rtol=1e-6, atol=1e-8)


# =================================================================================================
# OT with epsilon down to 0.01
# =================================================================================================
@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ensemble_transform_mean_error_is_bounded_by_the_plans_marginal_errors(dtype, epsilon):
    """Exact identity: with x~_i = sum_j P_ij x_j / r_i, |mean(x~) - sum_j w_j x_j| is at most
    (||P^T 1 - w||_1 + ||P 1 - 1/N||_1) max|x| (plus rounding), whatever the threshold; so the
    transform preserves the weighted mean exactly at an exact plan."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 50, 3, generator=g, dtype=dtype)
    lw = (3 * torch.randn(3, 50, generator=g, dtype=dtype)).log_softmax(-1)
    for threshold in (1e-2, ot_threshold(dtype)):
        x_new, plan = ensemble_transform(x, lw, epsilon, threshold=threshold, max_iter=20000)
        col = (plan.sum(-2) - lw.exp()).abs().sum(-1)
        row = (plan.sum(-1) - 1 / 50).abs().sum(-1)
        err = (x_new.mean(-2) - (lw.exp().unsqueeze(-1) * x).sum(-2)).abs().amax(-1)
        scale = x.abs().amax((-1, -2))
        assert (err <= (col + row) * scale + 500 * torch.finfo(dtype).eps * scale).all(), (err, col, row)


# =================================================================================================
# Invalid input
# =================================================================================================
@pytest.mark.parametrize("epsilon", [0.0, -0.5, math.nan])
def test_ensemble_transform_rejects_bad_epsilon(epsilon):
    x = torch.randn(1, 5, 2)
    with pytest.raises(ValueError, match="epsilon"):
        ensemble_transform(x, torch.full((1, 5), -math.log(5)), epsilon)


@pytest.mark.parametrize("gradient", ["implicit", "last_step"])
def test_fused_transform_restores_the_denormal_mode(gradient):
    """The fused op flushes float32 denormals for speed while it runs; afterwards the caller's
    arithmetic must keep its denormals (PyTorch's default)."""
    probe = torch.tensor([1e-20], dtype=torch.float32)
    assert bool((probe * probe != 0).all())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 2, generator=g, dtype=torch.float32, requires_grad=True)
    log_w = torch.log_softmax(20 * torch.randn(2, 30, generator=g, dtype=torch.float32), -1)
    x_new, _ = ensemble_transform(x, log_w, 0.5, gradient=gradient)
    x_new.square().sum().backward()
    assert bool((probe * probe != 0).all())
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dim", [2, 5])
def test_low_rank_and_explicit_cost_gradients_agree(dim, monkeypatch):
    """The backward forms d loss / d C through its rank-(D + 2) factors for small D and as an
    (N, N) matrix otherwise; forcing each route on the same problem gives the same gradients
    (float64, to rounding)."""
    import pyro_smc.ops.ensemble as ens

    x, log_w = _cloud(3, 15, d=dim, seed=dim, spread=1.5)
    log_w[0, :2] = -math.inf
    log_w = log_w - log_w.logsumexp(-1, keepdim=True)
    monkeypatch.setattr(ens, "_LOW_RANK_MAX_WIDTH", 1 << 30)
    low_rank = _grads(x, log_w, "implicit", threshold=1e-10)
    monkeypatch.setattr(ens, "_LOW_RANK_MAX_WIDTH", 0)
    explicit = _grads(x, log_w, "implicit", threshold=1e-10)
    for a, b in zip(low_rank, explicit):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_cost_workspace_is_not_shared_with_the_results(dtype):
    """The fused forward writes the cost into a buffer kept between calls: a later call of the
    same shape must leave an earlier call's outputs, plan and gradients untouched."""
    x1, w1 = _cloud(4, 30, seed=1, spread=2.0)
    x2, w2 = _cloud(4, 30, seed=2, spread=2.0)
    x1, w1, x2, w2 = (t.to(dtype) for t in (x1, w1, x2, w2))
    settings = SinkhornSettings(0.3, threshold=1e-6)
    xr = x1.clone().requires_grad_()
    first = ensemble_solve(xr, w1, settings)
    kept = first.x_new.detach().clone(), first.plan.clone(), first.solve.f.clone()
    ensemble_solve(x2, w2, settings)  # reuses the buffer
    first.x_new.square().sum().backward()
    again = x1.clone().requires_grad_()
    fresh = ensemble_solve(again, w1, settings)
    fresh.x_new.square().sum().backward()
    assert torch.equal(first.x_new, kept[0]) and torch.equal(first.plan, kept[1]) and torch.equal(first.solve.f, kept[2])
    assert torch.equal(first.x_new, fresh.x_new) and torch.equal(xr.grad, again.grad)


def test_a_workspace_made_under_inference_mode_serves_later_calls_with_autograd():
    """The cost buffer is made outside inference mode even when the first call on a thread runs
    inside it: a later call with autograd writes into the same buffer and differentiates."""
    import threading

    out = {}

    def run():  # a fresh thread: its own, still empty, workspace
        x, w = _cloud(3, 20, seed=3, spread=2.0)
        settings = SinkhornSettings(0.3, threshold=1e-6)
        with torch.inference_mode():
            out["inference"] = ensemble_solve(x, w, settings).x_new.clone()
        xr = x.clone().requires_grad_()
        result = ensemble_solve(xr, w, settings)
        result.x_new.square().sum().backward()
        out["normal"], out["grad"] = result.x_new.detach(), xr.grad

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert torch.equal(out["inference"], out["normal"])
    assert out["grad"] is not None and torch.isfinite(out["grad"]).all()


def test_a_non_finite_adjoint_residual_stops_conjugate_gradients_and_warns(monkeypatch):
    """A right-hand side (or a CG iterate) that turns NaN stops its problem at once: CG on a
    large problem (no dense fallback) used to run all its 10 M steps on NaN before the residual
    check warned. Counts the kernel products and checks the warning."""
    gen = torch.Generator().manual_seed(0)
    kernel = torch.rand(2, 600, 600, generator=gen, dtype=torch.float64) / 600
    sqrt_b = torch.full((2, 600), 600**-0.5, dtype=torch.float64)
    rhs = torch.randn(2, 600, generator=gen, dtype=torch.float64)
    rhs = rhs - (rhs * sqrt_b).sum(-1, keepdim=True) * sqrt_b  # orthogonal to the null vector
    rhs[1, 3] = math.nan
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: (calls.append(1), bmm(*a, **k))[1])
    with pytest.warns(sk.SinkhornConvergenceWarning, match="residual of nan"):
        x = sk._adjoint_solve(kernel, sqrt_b, rhs, 1e-8)
    assert len(calls) < 100  # the finite problem converges in a few steps; nothing runs to 6000
    assert torch.isfinite(x[0]).all()


def test_a_far_off_cloud_in_float32_is_transported_and_differentiated_as_in_float64():
    """The cost's expanded quadratic form subtracts terms of the size of |x|^2. Computed from
    uncentred particles, a float32 cloud of spread 1 at 10^4 from the origin lost every digit:
    particles moved 2.5 off and the gradient in x was off by a factor of 10^5, with no warning.
    From centred particles float32 agrees with float64 on the same stored points to its
    resolution there (an ulp of 10^4 is 1e-3)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 50, 2, generator=g, dtype=torch.float64) + 1e4).float()
    log_w = (2 * torch.randn(3, 50, generator=g, dtype=torch.float64)).log_softmax(-1).float()
    probe = torch.randn(3, 50, 2, generator=g)
    settings = SinkhornSettings(0.5, threshold=1e-5, max_iter=2000)
    got = {}
    for dtype in (torch.float32, torch.float64):
        xr, lr = x.to(dtype).requires_grad_(), log_w.to(dtype).requires_grad_()
        x_new = ensemble_solve(xr, lr, settings, plan=False).x_new
        grads = torch.autograd.grad((x_new * probe.to(dtype)).sum(), (xr, lr))
        got[dtype] = [t.detach().double() for t in (x_new, *grads)]
    (x32, gx32, gl32), (x64, gx64, gl64) = got[torch.float32], got[torch.float64]
    assert float((x32 - x64).abs().max()) < 5e-3
    assert float((gx32 - gx64).norm() / gx64.norm()) < 1e-2
    assert float((gl32 - gl64).norm() / gl64.norm()) < 1e-2


def test_a_small_problem_whose_conjugate_gradients_break_down_is_solved_densely():
    """CG on an indefinite adjoint system (a forward solve whose kernel's top singular value
    exceeds one) divides by a negative curvature and turns NaN. A NaN residual stops CG at once,
    and a small problem must then go to the dense solve, not come back as NaN (it did: the
    stop counted as convergence; found in a filter with labels at epsilon 0.1)."""
    m = 40
    kernel = 1.2 * torch.eye(m, dtype=torch.float64).expand(2, m, m)  # I - K^T K = -0.44 I
    sqrt_b = torch.full((2, m), m**-0.5, dtype=torch.float64)
    rhs = torch.randn(2, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rhs = rhs - (rhs * sqrt_b).sum(-1, keepdim=True) * sqrt_b  # orthogonal to the null vector
    x = sk._adjoint_solve(kernel, sqrt_b, rhs, 1e-10)
    s = sqrt_b.unsqueeze(-1) / sqrt_b.norm(dim=-1)[:, None, None]
    matrix = torch.eye(m, dtype=torch.float64) - kernel.transpose(1, 2) @ kernel + s @ s.transpose(1, 2)
    assert torch.allclose(x, torch.linalg.solve(matrix, rhs.unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize("mode", ["implicit", "last_step", "unroll"])
def test_a_second_derivative_is_refused_by_the_once_differentiable_modes_and_taken_by_unroll(mode):
    """With ``create_graph=True`` the implicit and last-step backward passes raised a bare in-place
    error at the second derivative (the solve updates in place, and its saved kernel is a
    constant to autograd, so a Hessian would miss its dependence on the particles); they now say
    so at once. ``"unroll"`` differentiates the iterations themselves: its second derivative
    passes ``gradgradcheck``."""
    x, log_w = _cloud(1, 4, d=1, seed=3, spread=1.0)
    xr = x.clone().requires_grad_()
    if mode != "unroll":
        x_new, _ = ensemble_transform(xr, log_w, 0.4, threshold=1e-12, max_iter=20000, gradient=mode)
        with pytest.raises(RuntimeError, match="differentiable once.*gradient='unroll'"):
            torch.autograd.grad(x_new.square().sum(), xr, create_graph=True)
        return

    def fn(x):
        return ensemble_transform(x, log_w, 0.4, threshold=1e-12, max_iter=20000, gradient="unroll")[0]

    assert torch.autograd.gradgradcheck(fn, (xr,), atol=1e-5, rtol=1e-4)
