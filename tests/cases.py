"""Parametrisation grids and small models shared by the tests of several modules: float32 and
float64 runs, extreme log-weights, OT at small epsilon and long sequences."""

import torch

from pyro_smc.models import LinearGaussianSSM

DTYPES = [torch.float32, torch.float64]
DTYPE_IDS = ["float32", "float64"]
# OT with epsilon down to 0.01.
EPSILONS = [0.1, 0.03, 0.01]


def isotropic_lgssm(dtype, d=2, a=0.5, q=1.0, r=0.5):
    eye = torch.eye(d, dtype=dtype)
    return LinearGaussianSSM(a * eye, q * eye, eye, r * eye, torch.zeros(d, dtype=dtype), eye)


def as_float64(ssm):
    """The same model in float64: the exact (Kalman) reference for float32 runs."""
    return LinearGaussianSSM(*(t.double() for t in (ssm.A, ssm.Q, ssm.C, ssm.R, ssm.init_mean, ssm.init_cov)))


def ulp(dtype, magnitude):
    """Spacing of floating-point numbers of size ``magnitude``: the rounding any op must accept."""
    return torch.finfo(dtype).eps * magnitude


def ot_threshold(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-7


def ar1_ssm(dtype=torch.float64, q=0.19, r=1.0):
    """x_t = 0.9 x_{t-1} + N(0, q) with stationary variance 1 (q = 0.19), y_t = x_t + N(0, r)."""
    one = torch.eye(1, dtype=dtype)
    return LinearGaussianSSM(0.9 * one, q * one, one, r * one, torch.zeros(1, dtype=dtype), one)


def assert_same_marginals(out, exact, atol: float = 1e-8, evidence: bool = True) -> None:
    """``out`` has the means and covariances of ``exact`` (a Kalman filter or RTS result), and
    with ``evidence`` also its log-evidence and per-step increments, to ``atol``."""
    torch.testing.assert_close(out.means, exact.means, rtol=0, atol=atol)
    torch.testing.assert_close(out.covariances, exact.covariances, rtol=0, atol=atol)
    if evidence:
        torch.testing.assert_close(out.log_evidence_increments, exact.log_evidence_increments, rtol=0, atol=atol)
        torch.testing.assert_close(out.log_evidence, exact.log_evidence, rtol=0, atol=atol)
