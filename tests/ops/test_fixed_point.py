"""Implicit differentiation of a fixed point against closed forms and unrolled iterations."""

import pytest
import torch

from pyro_smc.ops.fixed_point import depends_on_other_leaves, implicit_fixed_point


def _affine_problem(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g)
    A = (0.8 * A / torch.linalg.matrix_norm(A, 2)).requires_grad_()  # a contraction
    b = torch.randn(n, generator=g).requires_grad_()
    return A, b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_affine_fixed_point_gradient_equals_the_closed_form(seed):
    # theta = A theta + b  =>  theta* = (I - A)^{-1} b, differentiated by autograd through a solve.
    A, b = _affine_problem(seed)
    theta = torch.zeros(4)
    with torch.no_grad():
        for _ in range(500):
            theta = A @ theta + b
    w = torch.linspace(-1, 2, 4)
    z = implicit_fixed_point(lambda u: A @ u + b, theta, tol=1e-14, max_iter=1000)
    ours = torch.autograd.grad((w * z).sum() + z.square().sum(), (A, b))
    exact = torch.linalg.solve(torch.eye(4) - A, b)
    closed = torch.autograd.grad((w * exact).sum() + exact.square().sum(), (A, b))
    for a, c in zip(ours, closed):
        assert torch.allclose(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("damping", [1.0, 0.1, 0.01])
def test_a_slowly_contracting_adjoint_stops_near_its_answer_not_on_a_small_step(damping):
    """``theta = (1 - gamma) theta + gamma (a theta + 1)`` contracts by ``1 - gamma (1 - a)`` per
    step (0.995 at gamma = 0.01), as a heavily damped EP sweep does. Its fixed point 1 / (1 - a)
    has derivative 1 / (1 - a)^2 = 4 at a = 0.5 whatever the damping. Stopping on the last step
    (at most ``tol``) left the adjoint 200 steps' worth short: 2% off at ``tol=1e-4``."""
    a = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    theta = torch.tensor(2.0, dtype=torch.float64)
    z = implicit_fixed_point(lambda u: (1 - damping) * u + damping * (a * u + 1), theta, tol=1e-4, max_iter=10000)
    (grad,) = torch.autograd.grad(z, a)
    assert abs(float(grad) - 4.0) < 4.0 * 1e-3, float(grad)


@pytest.mark.parametrize("seed", [0, 1])
def test_nonlinear_fixed_point_gradient_equals_the_unrolled_one(seed):
    # theta = tanh(W theta + c): a contraction for ||W|| < 1; unrolled to convergence as the oracle.
    g = torch.Generator().manual_seed(seed)
    W = (0.5 * torch.randn(3, 3, generator=g) / 3**0.5).requires_grad_()
    c = torch.randn(3, generator=g).requires_grad_()
    theta = torch.zeros(3)
    for _ in range(200):
        theta = torch.tanh(W @ theta + c)
    unrolled = torch.autograd.grad(theta.sum(), (W, c))
    z = implicit_fixed_point(lambda u: torch.tanh(W @ u + c), theta.detach(), tol=1e-14, max_iter=500)
    ours = torch.autograd.grad(z.sum(), (W, c))
    for a, b in zip(ours, unrolled):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda W_, c_: implicit_fixed_point(lambda u: torch.tanh(W_ @ u + c_), _solve(W_, c_), tol=1e-14, max_iter=500),
        (W.detach().requires_grad_(), c.detach().requires_grad_()),
        check_undefined_grad=False,  # a tensor hook is never called with an undefined gradient
    )


def _solve(W, c):
    theta = torch.zeros(3)
    with torch.no_grad():
        for _ in range(300):
            theta = torch.tanh(W @ theta + c)
    return theta


def test_error_is_raised_in_the_backward_pass_only():
    A, b = _affine_problem(0)
    z = implicit_fixed_point(lambda u: A @ u + b, torch.zeros(4), tol=1e-10, max_iter=100, error="not a fixed point")
    assert torch.equal(z, b.detach())  # the forward value is fn(theta)
    with pytest.raises(RuntimeError, match="not a fixed point"):
        z.sum().backward()
    state = {"message": None}
    z = implicit_fixed_point(lambda u: A @ u + b, torch.zeros(4), tol=1e-10, max_iter=100, error=lambda: state["message"])
    state["message"] = "decided late"
    with pytest.raises(RuntimeError, match="decided late"):
        z.sum().backward()


def test_a_fixed_point_where_the_map_does_not_contract_is_differentiated_by_gmres():
    # theta = A theta + b with eigenvalues of A at -1.6 and 0.5: the plain adjoint iteration
    # diverges, but I - A is invertible and theta* = (I - A)^{-1} b is differentiable.
    g = torch.Generator().manual_seed(3)
    Q, _ = torch.linalg.qr(torch.randn(5, 5, generator=g))
    A = (Q @ torch.diag(torch.tensor([-1.6, 0.5, 0.3, -0.2, 0.9])) @ Q.T).requires_grad_()
    b = torch.randn(5, generator=g).requires_grad_()
    exact = torch.linalg.solve(torch.eye(5) - A, b)
    w = torch.linspace(-1, 2, 5)
    z = implicit_fixed_point(lambda u: A @ u + b, exact.detach(), tol=1e-13, max_iter=50)
    ours = torch.autograd.grad((w * z).sum() + z.square().sum(), (A, b))
    closed = torch.autograd.grad((w * exact).sum() + exact.square().sum(), (A, b))
    for a, c in zip(ours, closed):
        assert torch.allclose(a, c, rtol=1e-9, atol=1e-11)


def test_a_singular_fixed_point_equation_is_reported():
    a = torch.tensor(1.0, requires_grad=True)  # theta = a theta: every theta is a fixed point at a = 1
    z = implicit_fixed_point(lambda u: a * u, torch.tensor(2.0), tol=1e-10, max_iter=50)
    with pytest.raises(RuntimeError, match="did not converge in 50 steps.*GMRES.*singular"):
        z.backward()


def test_a_map_without_parameters_returns_a_detached_value():
    z = implicit_fixed_point(lambda u: 0.5 * u + 1, torch.tensor(2.0), tol=1e-10, max_iter=10)
    assert not z.requires_grad and z.item() == 2.0


def test_a_map_without_parameters_is_evaluated_once_and_without_a_graph():
    # A graph built on theta alone, only to be dropped, killed the process once it was deep
    # (EP's sequential sweep at T = 1000 segfaulted freeing it): none may be built.
    seen = []

    def step(u):
        seen.append(u.requires_grad)
        return 0.5 * u + 1

    z = implicit_fixed_point(step, torch.tensor(2.0), tol=1e-10, max_iter=10)
    assert seen == [False] and not z.requires_grad


def test_depends_on_other_leaves():
    u, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    assert not depends_on_other_leaves(2 * u + 1, u)
    assert depends_on_other_leaves(u * w, u)
    assert depends_on_other_leaves(w, u) and not depends_on_other_leaves(u, u)
    assert not depends_on_other_leaves(torch.ones(2), u)
