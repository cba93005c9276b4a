import pyro.distributions as dist
import pytest
import torch

from pyro_smc.ops.kalman import kalman_filter, predict, rts_smoother, update
from tests.cases import ar1_ssm


def _random_model(d, dy, seed):
    g = torch.Generator().manual_seed(seed)
    A = 0.9 * torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    def spd(n):
        m = torch.randn(n, n, generator=g)
        return m @ m.T / n + 0.3 * torch.eye(n)
    C = torch.randn(dy, d, generator=g)
    return A, spd(d), C, spd(dy), torch.randn(d, generator=g), spd(d), g


def _dense_joint(A, Q, C, R, m0, P0, T):
    """Mean and covariance of (x_1..x_T, y_1..y_T) by brute-force linear algebra."""
    d = A.shape[0]
    # x = M (x_1-noise, w_2.., w_T) stacked; build the linear map from independent noises.
    Lx = torch.zeros(T * d, T * d)
    mean_x = torch.zeros(T * d)
    blocks_cov = torch.block_diag(P0, *[Q] * (T - 1))
    for t in range(T):
        for s in range(t + 1):
            Lx[t * d : (t + 1) * d, s * d : (s + 1) * d] = torch.linalg.matrix_power(A, t - s)
        mean_x[t * d : (t + 1) * d] = torch.linalg.matrix_power(A, t) @ m0
    cov_x = Lx @ blocks_cov @ Lx.T
    Cb = torch.block_diag(*[C] * T)
    cov_y = Cb @ cov_x @ Cb.T + torch.block_diag(*[R] * T)
    return mean_x, cov_x, Cb @ mean_x, cov_y, Cb @ cov_x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_and_smoother_match_dense_gaussian(seed):
    d, dy, T = 3, 2, 6
    A, Q, C, R, m0, P0, g = _random_model(d, dy, seed)
    ys = torch.randn(T, dy, generator=g)
    mx, Sx, my, Sy, Syx = _dense_joint(A, Q, C, R, m0, P0, T)
    out = kalman_filter(ys, A, Q, C, R, m0, P0)
    # Exact log evidence.
    exact = dist.MultivariateNormal(my, Sy).log_prob(ys.reshape(-1))
    assert torch.allclose(out.log_evidence, exact, rtol=1e-10)
    # Smoother = conditional of x on all y.
    K = torch.linalg.solve(Sy, Syx).T
    post_mean = mx + K @ (ys.reshape(-1) - my)
    post_cov = Sx - K @ Syx
    sm = rts_smoother(out, A)
    assert torch.allclose(sm.means.reshape(-1), post_mean, atol=1e-9)
    for t in range(T):
        assert torch.allclose(sm.covariances[t], post_cov[t * d : (t + 1) * d, t * d : (t + 1) * d], atol=1e-9)
    # Filter at t = conditional on y_{1:t}: the last filtered state equals the smoothed one, and
    # each filtered mean equals a dense conditional on the prefix.
    for t in range(T):
        k = (t + 1) * dy
        Kt = torch.linalg.solve(Sy[:k, :k], Syx[:k, t * d : (t + 1) * d]).T
        mean_t = mx[t * d : (t + 1) * d] + Kt @ (ys.reshape(-1)[:k] - my[:k])
        assert torch.allclose(out.means[t], mean_t, atol=1e-9)


def test_log_evidence_matches_pyro_gaussian_hmm():
    # Pyro's GaussianHMM starts from a state before the first transition: x_1 = A x_0 + w with
    # x_0 ~ N(mu, S). Choose our prior of x_1 to be that distribution.
    d, dy, T = 2, 2, 20
    A, Q, C, R, _, _, g = _random_model(d, dy, 7)
    mu, S = torch.randn(d, generator=g), torch.eye(d)
    m0, P0 = A @ mu, A @ S @ A.T + Q
    ys = torch.randn(T, dy, generator=g)
    hmm = dist.GaussianHMM(
        dist.MultivariateNormal(mu, S), A.T, dist.MultivariateNormal(torch.zeros(d), Q), C.T, dist.MultivariateNormal(torch.zeros(dy), R)
    )
    ours = kalman_filter(ys, A, Q, C, R, m0, P0).log_evidence
    assert torch.allclose(ours, hmm.log_prob(ys), rtol=1e-10)


def _by_hand(ys, A, Q, C, R, m0, P0):
    """The Kalman filter written out on the observed rows of C and the observed block of R."""
    m, P, means, covs, lls = m0, P0, [], [], []
    for t in range(ys.shape[0]):
        if t > 0:
            m, P = predict(m, P, A, Q)
        seen = ~torch.isnan(ys[t])
        ll = torch.zeros(())
        if seen.any():
            m, P, ll = update(m, P, ys[t][seen], C[seen], R[seen][:, seen])
        means.append(m)
        covs.append(P)
        lls.append(ll)
    return torch.stack(means), torch.stack(covs), torch.stack(lls)


@pytest.mark.parametrize("seed", [0, 1])
def test_nan_entries_condition_on_the_observed_components(seed):
    d, dy, T = 3, 3, 8
    A, Q, C, R, m0, P0, g = _random_model(d, dy, seed)
    ys = torch.randn(T, dy, generator=g)
    ys[2] = float("nan")  # predict only
    ys[4, 1] = float("nan")
    ys[5, [0, 2]] = float("nan")
    out = kalman_filter(ys, A, Q, C, R, m0, P0)
    means, covs, lls = _by_hand(ys, A, Q, C, R, m0, P0)
    torch.testing.assert_close(out.means, means, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.covariances, covs, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.log_evidence_increments, lls, rtol=0, atol=1e-10)
    assert out.log_evidence_increments[2] == 0
    torch.testing.assert_close(out.means[2], out.predicted_means[2], rtol=0, atol=0)
    # And the smoother on top of it is the dense conditional on the observed entries.
    mx, Sx, my, Sy, Syx = _dense_joint(A, Q, C, R, m0, P0, T)
    seen = ~torch.isnan(ys.reshape(-1))
    K = torch.linalg.solve(Sy[seen][:, seen], Syx[seen]).T
    post_mean = mx + K @ (ys.reshape(-1)[seen] - my[seen])
    torch.testing.assert_close(rts_smoother(out, A).means.reshape(-1), post_mean, rtol=0, atol=1e-9)
    exact = dist.MultivariateNormal(my[seen], Sy[seen][:, seen]).log_prob(ys.reshape(-1)[seen])
    torch.testing.assert_close(out.log_evidence, exact, rtol=1e-10, atol=0)


def test_nan_entries_with_a_batch_of_models():
    d, dy, T = 2, 2, 5
    A, Q, C, R, m0, P0, g = _random_model(d, dy, 3)
    ys = torch.randn(T, dy, generator=g)
    ys[1, 0] = float("nan")
    batch = torch.stack([A, 0.5 * A])  # (2, d, d): the results gain a batch dim after T
    out = kalman_filter(ys, batch, Q, C, R, m0.expand(2, d), P0.expand(2, d, d))
    for k in range(2):
        one = kalman_filter(ys, batch[k], Q, C, R, m0, P0)
        torch.testing.assert_close(out.means[:, k], one.means, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.log_evidence[k], one.log_evidence, rtol=0, atol=1e-12)


def test_inf_is_an_error_naming_the_step():
    A, Q, C, R, m0, P0, _ = _random_model(2, 2, 0)
    ys = torch.zeros(4, 2)
    ys[3, 1] = float("inf")
    with pytest.raises(ValueError, match="time step 3"):
        kalman_filter(ys, A, Q, C, R, m0, P0)


def test_the_evidence_is_the_sum_of_its_increments_and_the_smoother_keeps_it():
    A, Q, C, R, m0, P0, _ = _random_model(2, 2, 0)
    out = kalman_filter(torch.zeros(3, 2), A, Q, C, R, m0, P0)
    assert not hasattr(out, "log_likelihoods")  # the removed old name
    assert torch.equal(out.log_evidence, out.log_evidence_increments.sum(0))
    assert torch.equal(rts_smoother(out, A).log_evidence, out.log_evidence)


# =================================================================================================
# T = 10^4 in float64 and float32
# =================================================================================================
def test_kalman_filter_at_T_1e4_matches_pyro_gaussian_hmm():
    """10^4 sequential Kalman steps against Pyro's GaussianHMM (a parallel-scan computation of the
    same log-likelihood): agreement to 1e-9 relative, and finite, positive filter variances."""
    ssm = ar1_ssm()
    T = 10_000
    _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))
    kf = ssm.kalman_filter(ys)
    assert torch.isfinite(kf.means).all() and (kf.covariances > 0).all()
    one = torch.eye(1)
    # GaussianHMM starts one transition before the first observation: x_0 ~ N(0, s) with
    # 0.81 s + q = 1 gives x_1 ~ N(0, 1), our prior.
    hmm = dist.GaussianHMM(
        dist.MultivariateNormal(torch.zeros(1), (1 - 0.19) / 0.81 * one),
        ssm.A.T,
        dist.MultivariateNormal(torch.zeros(1), ssm.Q),
        ssm.C.T,
        dist.MultivariateNormal(torch.zeros(1), ssm.R),
    )
    exact = hmm.log_prob(ys)
    assert torch.allclose(kf.log_evidence, exact, rtol=1e-9)


def test_kalman_float32_at_T_1e4():
    ssm32 = ar1_ssm(torch.float32)
    _, ys = ar1_ssm().simulate(10_000, generator=torch.Generator().manual_seed(2))
    kf32 = ssm32.kalman_filter(ys.float())
    kf64 = ar1_ssm().kalman_filter(ys)
    assert torch.isfinite(kf32.log_evidence_increments).all()
    # Per-step rounding errors of relative size 1e-7 add up over 10^4 terms of size ~1.
    assert abs(float(kf32.log_evidence_increments.double().sum() - kf64.log_evidence)) < 1e-7 * 10_000 * 10
    assert (kf32.means.double() - kf64.means).abs().max() < 1e-4


# --- errors: a clear ValueError naming the argument or the time step, never a non-finite answer --
F32 = torch.float32


def test_no_time_steps_is_an_error_naming_ys():
    # Before: RuntimeError: stack expects a non-empty TensorList.
    A, Q, C, R, m0, P0, _ = _random_model(2, 2, 0)
    with pytest.raises(ValueError, match="ys.*at least one time step"):
        kalman_filter(torch.zeros(0, 2), A, Q, C, R, m0, P0)


def test_ys_of_another_dtype_is_an_error_saying_how_to_fix_it():
    # Before: RuntimeError: expected m1 and m2 to have the same dtype, but got: float != double.
    A, Q, C, R, m0, P0, _ = (x.to(F32) if isinstance(x, torch.Tensor) else x for x in _random_model(2, 2, 0))
    with pytest.raises(ValueError, match=r"ys has dtype torch.float64.*torch.float32.*\.to\("):
        kalman_filter(torch.zeros(3, 2, dtype=torch.float64), A, Q, C, R, m0, P0)


@pytest.mark.parametrize("name", ["A", "Q", "C", "R", "init_mean", "init_cov"])
def test_non_finite_model_matrices_are_an_error_naming_them(name):
    # Before: NaN means (A, C, init_mean) or a bare LinAlgError (the covariances).
    args = dict(zip(["A", "Q", "C", "R", "init_mean", "init_cov"], _random_model(2, 2, 0)[:6]))
    bad = args[name].flatten().clone()
    bad[0] = float("nan")
    args[name] = bad.reshape(args[name].shape)
    with pytest.raises(ValueError, match=rf"{name} has non-finite entries"):
        kalman_filter(torch.zeros(3, 2), **args)


@pytest.mark.parametrize("observed", [True, False], ids=["observed", "missing"])
def test_an_overflowing_float32_model_is_an_error_naming_the_step(observed):
    # x_t = 1e3 x_{t-1} predicts a covariance 1e6 times the last: unobserved, it overflows float32
    # (3.4e38) at step 7. Before: a bare LinAlgError (missing) or, observed, nothing is wrong.
    one = torch.ones(1, 1, dtype=F32)
    ys = torch.ones(12, 1, dtype=F32) if observed else torch.full((12, 1), float("nan"), dtype=F32)
    if observed:
        out = kalman_filter(ys, 1e3 * one, one, one, one, torch.zeros(1, dtype=F32), one)
        assert torch.isfinite(out.covariances).all() and torch.isfinite(out.log_evidence)
        return
    with pytest.raises(ValueError, match=r"kalman_filter: .*time step 7\b.*not finite"):
        kalman_filter(ys, 1e3 * one, one, one, one, torch.zeros(1, dtype=F32), one)


def test_rts_smoother_names_the_step_of_a_singular_prediction():
    # Q = 0 and A = 0: the prediction of x_1 is a point, its covariance singular, the gain undefined.
    one, zero = torch.ones(1, 1), torch.zeros(1, 1)
    filtered = kalman_filter(torch.zeros(3, 1), zero, zero, one, one, torch.zeros(1), one)
    with pytest.raises(ValueError, match=r"rts_smoother: .*time step 1\b"):
        rts_smoother(filtered, zero)


@pytest.mark.parametrize("shape", [(3, 2, 1), (3,), (3, 3)])
def test_ys_of_the_wrong_shape_is_an_error_naming_ys(shape):
    # Found by tests/ops/test_kalman_properties.py. Before: RuntimeError "stack expects each tensor
    # to be equal size" (or, for a scalar model, a wrong answer), IndexError, and RuntimeError "The
    # size of tensor a (3) must match ..." from inside the update.
    A, Q, C, R, m0, P0, _ = _random_model(2, 2, 0)
    with pytest.raises(ValueError, match=r"ys must have shape \(T, 2\)"):
        kalman_filter(torch.zeros(shape), A, Q, C, R, m0, P0)


def test_a_batch_in_one_matrix_alone_equals_a_loop():
    """Before: a batch of transition matrices with unbatched Q, C, R and prior failed with a raw
    ``stack expects each tensor to be equal size`` (the first step's moments lacked the batch),
    though the docstring says batch dimensions broadcast. Each batch member equals its own run."""
    g = torch.Generator().manual_seed(0)
    d, dy, T = 3, 2, 6
    A = 0.5 * torch.randn(4, d, d, generator=g, dtype=torch.float64)
    Q, R = 0.5 * torch.eye(d, dtype=torch.float64), 0.3 * torch.eye(dy, dtype=torch.float64)
    C = torch.randn(dy, d, generator=g, dtype=torch.float64)
    m0, P0 = torch.zeros(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)
    ys = torch.randn(T, dy, generator=g, dtype=torch.float64)
    batched = kalman_filter(ys, A, Q, C, R, m0, P0)
    smoothed = rts_smoother(batched, A)
    assert batched.means.shape == (T, 4, d) and smoothed.means.shape == (T, 4, d)
    for b in range(4):
        one = kalman_filter(ys, A[b], Q, C, R, m0, P0)
        assert torch.allclose(batched.means[:, b], one.means) and torch.allclose(batched.log_evidence[b], one.log_evidence)
        assert torch.allclose(smoothed.means[:, b], rts_smoother(one, A[b]).means)
