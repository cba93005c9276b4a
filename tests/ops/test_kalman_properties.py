"""Properties of the Kalman oracle (``ops.kalman``) over drawn linear-Gaussian problems (hypothesis).

The invariant: a clear ``ValueError`` naming the argument or the time step, or a finite answer
(symmetric positive semi-definite covariances) that equals the dense joint Gaussian, in float64,
to a tolerance derived from the dtype and the conditioning. The problems are drawn: state and
observation dimensions 1-3, float32 and float64, T in {1, 2, 5}, missing rows and entries, and
each covariance (Q, R, P0) at its own scale in 1e-6 .. 1e6, so their ratio (the conditioning) goes
up to 1e12. This module also holds the strategy and the oracle the Gaussian engines' suites use.

Tolerance. With covariances of scale up to ``M`` and ratio ``kappa`` between the largest and the
smallest, one update's rounding error in a covariance is about ``eps kappa`` relative to ``M``
(the innovation covariance is factorised with condition up to ``kappa``), and in a mean about
``eps kappa`` relative to ``sqrt(M)``. The checks allow ``TOL_FACTOR`` times that (T <= 5 steps of
dimension <= 3); where it exceeds 1e-2 the value is only required to be finite, PSD and in range.
"""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from pyro_smc.ops.kalman import kalman_filter, rts_smoother
from tests.property_cases import ENGINE, FLOAT_DTYPES, SEEDS, assert_clear_error, assert_finite, eps, gen

F64 = torch.float64
SCALES = st.sampled_from([1e-6, 1e-3, 1.0, 1e3, 1e6])
MISSING = st.sampled_from(["none", "rows", "entries", "all"])
STEPS = st.sampled_from([1, 2, 5])
TOL_FACTOR = 1e3


def _spd(n, g):
    """A covariance of condition number below about 30, unit scale."""
    L = torch.randn(n, n, generator=g, dtype=F64)
    return L @ L.T / n + 0.3 * torch.eye(n, dtype=F64)


@st.composite
def linear_problems(draw, steps=STEPS, scales=SCALES, dtypes=FLOAT_DTYPES):
    """``dict(A, Q, C, R, m0, P0, ys, dtype, scale, kappa)``: the model in float64 (``ys`` too,
    NaN where missing) with its drawn dtype beside it; ``scale`` the largest covariance scale,
    ``kappa`` the ratio of the largest to the smallest (times the covariances' own conditioning)."""
    dtype, d, e, T = draw(dtypes), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(steps)
    q, r, p = draw(scales), draw(scales), draw(scales)
    missing, g = draw(MISSING), gen(draw(SEEDS))
    A = torch.randn(d, d, generator=g, dtype=F64)
    A = 1.1 * A / torch.linalg.eigvals(A).abs().max().clamp_min(1e-3)  # spectral radius 1.1: growth stays in range
    C = torch.randn(e, d, generator=g, dtype=F64)
    Q, R, P0 = q * _spd(d, g), r * _spd(e, g), p * _spd(d, g)
    m0 = math.sqrt(p) * torch.randn(d, generator=g, dtype=F64)
    x = m0 + torch.linalg.cholesky(P0) @ torch.randn(d, generator=g, dtype=F64)
    ys = []
    for t in range(T):
        if t:
            x = A @ x + torch.linalg.cholesky(Q) @ torch.randn(d, generator=g, dtype=F64)
        ys.append(C @ x + torch.linalg.cholesky(R) @ torch.randn(e, generator=g, dtype=F64))
    ys = torch.stack(ys)
    if missing == "rows":
        ys[torch.rand(T, generator=g) < 0.4] = float("nan")
    elif missing == "entries":
        ys[torch.rand(T, e, generator=g) < 0.4] = float("nan")
    elif missing == "all":
        ys[:] = float("nan")
    scale, kappa = max(q, r, p), 30 * max(q, r, p) / min(q, r, p)
    return dict(A=A, Q=Q, C=C, R=R, m0=m0, P0=P0, ys=ys, dtype=dtype, scale=scale, kappa=kappa)


def tolerance(problem) -> float:
    """Relative tolerance of a ``problem``'s answers in its dtype (module docstring)."""
    return TOL_FACTOR * eps(problem["dtype"]) * problem["kappa"]


def model_args(problem, dtype=None):
    dtype = problem["dtype"] if dtype is None else dtype
    return [problem[k].to(dtype) for k in ("A", "Q", "C", "R", "m0", "P0")]


def dense_oracle(problem):
    """Filtering and smoothing means and covariances and the log-evidence from the dense joint
    Gaussian of the states and the observed entries, in float64."""
    A, Q, C, R, m0, P0 = model_args(problem, F64)
    ys = problem["ys"]
    T, d, e = ys.shape[0], A.shape[0], C.shape[0]
    mean_x, cov_x = [m0], [[P0]]
    for _ in range(1, T):  # Cov[x_t, x_s] = A^(t-s) P_s for s <= t
        mean_x.append(A @ mean_x[-1])
        cov_x.append([A @ c for c in cov_x[-1]] + [A @ cov_x[-1][-1] @ A.T + Q])
    mx = torch.cat(mean_x)
    Sx = torch.zeros(T * d, T * d, dtype=F64)
    for t in range(T):
        for s in range(t + 1):
            Sx[t * d : (t + 1) * d, s * d : (s + 1) * d] = cov_x[t][s]
            Sx[s * d : (s + 1) * d, t * d : (t + 1) * d] = cov_x[t][s].T
    Cb = torch.block_diag(*[C] * T)
    my, Sy = Cb @ mx, Cb @ Sx @ Cb.T + torch.block_diag(*[R] * T)
    Sxy = Sx @ Cb.T
    y = ys.reshape(-1)
    observed = ~torch.isnan(y)

    def condition(upto):
        """``(means (T, d), covs (T, d, d))`` given the observed entries of ``y_{0:upto}``."""
        idx = (observed & (torch.arange(T * e) < (upto + 1) * e)).nonzero().squeeze(-1)
        if idx.numel() == 0:
            return mx, Sx
        gain = torch.linalg.solve(Sy[idx][:, idx], Sxy[:, idx].T).T
        return mx + gain @ (y[idx] - my[idx]), Sx - gain @ Sxy[:, idx].T

    filt = [condition(t) for t in range(T)]
    f_means = torch.stack([m[t * d : (t + 1) * d] for t, (m, _) in enumerate(filt)])
    f_covs = torch.stack([S[t * d : (t + 1) * d, t * d : (t + 1) * d] for t, (_, S) in enumerate(filt)])
    m, S = condition(T - 1)
    s_means = m.reshape(T, d)
    s_covs = torch.stack([S[t * d : (t + 1) * d, t * d : (t + 1) * d] for t in range(T)])
    idx = observed.nonzero().squeeze(-1)
    if idx.numel():
        log_z = torch.distributions.MultivariateNormal(my[idx], Sy[idx][:, idx]).log_prob(y[idx])
    else:
        log_z = torch.zeros((), dtype=F64)
    return dict(filter=(f_means, f_covs), smoother=(s_means, s_covs), log_evidence=log_z)


def assert_gaussian_close(means, covs, oracle, problem, what):
    """``means (T, d)`` and ``covs (T, d, d)`` are finite, the covariances symmetric PSD, and both
    within the problem's tolerance of the oracle's (module docstring)."""
    assert_finite((means, covs), what)
    scale, tol = problem["scale"], tolerance(problem)
    means, covs = means.double(), covs.double()
    o_means, o_covs = oracle
    asym = (covs - covs.mT).abs().max()
    assert asym <= 10 * eps(problem["dtype"]) * covs.abs().max().clamp_min(1e-300), f"{what}: covariances not symmetric ({asym})"
    low = torch.linalg.eigvalsh(covs).min()
    assert low >= -max(tol, 1e-6) * scale, f"{what}: covariance with eigenvalue {low} (scale {scale})"
    if tol > 1e-2:  # rounding may be as large as the answer: finite, PSD and in range is all
        assert covs.abs().max() <= 1e3 * scale * problem["kappa"], f"{what}: covariance out of range"
        return
    dm = (means - o_means).abs().max() / math.sqrt(scale)
    dc = (covs - o_covs).abs().max() / scale
    assert dm <= tol and dc <= tol, f"{what}: mean error {dm:.3g}, covariance error {dc:.3g} (relative), tolerance {tol:.3g}"


def assert_evidence_close(value, oracle, problem, what):
    assert_finite(value, what)
    tol = tolerance(problem)
    if tol > 1e-2:
        return
    T, e = problem["ys"].shape
    # log|S| and the quadratic forms move by about e (1 + z^2) times S's relative error.
    z2 = max(1.0, abs(float(oracle)))
    assert abs(float(value) - float(oracle)) <= 10 * tol * T * e * z2, f"{what}: {float(value)} vs {float(oracle)} (tolerance {tol:.3g})"


@ENGINE
@given(linear_problems())
def test_property_kalman_filter_and_smoother_equal_the_dense_gaussian(problem):
    A, Q, C, R, m0, P0 = model_args(problem)
    ys = problem["ys"].to(problem["dtype"])
    oracle = dense_oracle(problem)
    try:
        filtered = kalman_filter(ys, A, Q, C, R, m0, P0)
        smoothed = rts_smoother(filtered, A)
    except ValueError as error:
        assert_clear_error(error, "time step")
        return
    assert_gaussian_close(filtered.means, filtered.covariances, oracle["filter"], problem, "filter")
    assert_gaussian_close(smoothed.means, smoothed.covariances, oracle["smoother"], problem, "smoother")
    assert_evidence_close(filtered.log_evidence, oracle["log_evidence"], problem, "log_evidence")


BAD_INPUTS = st.sampled_from(["T=0", "ys dtype", "model dtype", "nan", "inf ys", "ys shape"])


@ENGINE
@given(linear_problems(), BAD_INPUTS, st.sampled_from(["A", "Q", "C", "R", "init_mean", "init_cov"]))
def test_property_bad_inputs_are_refused_by_name(problem, bad, name):
    args = dict(zip(["A", "Q", "C", "R", "init_mean", "init_cov"], model_args(problem)))
    ys = problem["ys"].to(problem["dtype"])
    other = torch.float32 if problem["dtype"] == F64 else F64
    expected = {"T=0": "ys", "ys dtype": "ys", "model dtype": name, "nan": name, "inf ys": "time step", "ys shape": "ys"}[bad]
    if bad == "T=0":
        ys = ys[:0]
    elif bad == "ys dtype":
        ys = ys.to(other)
    elif bad == "model dtype":
        if name == "A":  # A sets the dtype: another A makes every other tensor the odd one
            expected = "Q"
        args[name] = args[name].to(other)
    elif bad == "nan":
        value = args[name].flatten().clone()
        value[0] = float("nan")
        args[name] = value.reshape(args[name].shape)
    elif bad == "inf ys":
        ys = ys.clone()
        ys[-1, 0] = float("inf")
    elif bad == "ys shape":
        ys = ys[..., None]
    try:
        kalman_filter(ys, **args)
    except Exception as error:  # noqa: BLE001 - the property is about which errors
        assert_clear_error(error, expected)
    else:
        raise AssertionError(f"{bad} ({name}) was accepted")
