"""Hypothesis settings, strategies and random inputs of the property tests (randomised tests of the
public numerical boundaries: random shapes, float32 and float64, extreme and invalid values; each
property demands a correct result or a clear ``ValueError``, never NaN, never a silent wrong answer).

Random tensors come from a ``torch.Generator`` seeded by a hypothesis-drawn integer (so shrinking
works on shapes, dtypes and special values, and every example is reproducible). Examples are
derandomised, so a run is deterministic. The library bugs the properties found (since fixed) are
pinned by regression properties run under ``BUG``, in the test file of each module.
"""

import math
import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from pyro_smc.ops import resample
from pyro_smc.ops.weights import normalize

# The autouse fixture of conftest.py (float64 default dtype, seeds) runs once per test, not per
# example; every property passes its dtype explicitly, so that is harmless.
# No example database and no explain phase: nothing is written under .hypothesis/.
PROPERTY = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# For the regression properties of fixed bugs: report the first failing example as it is (no
# shrinking, no explanation phase, a single exception), so a regression is reported fast.
BUG = settings(PROPERTY, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)

F32, F64 = torch.float32, torch.float64
FLOAT_DTYPES = st.sampled_from([F32, F64])
SEEDS = st.integers(0, 2**31 - 1)
BATCH = st.lists(st.integers(1, 3), max_size=2).map(tuple)
RESAMPLING_SCHEMES = st.sampled_from([resample.systematic, resample.stratified, resample.multinomial, resample.residual])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def eps(dtype):
    return torch.finfo(dtype).eps


def random_tril(shape, d, g, dtype, garbage=False):
    """Lower triangular, diagonal in [0.5, 1.5], off-diagonal N(0, 0.3^2); ``garbage`` fills the
    strict upper triangle with noise (for functions documented to read one triangle only)."""
    lower = (0.3 * torch.randn(*shape, d, d, generator=g, dtype=dtype)).tril(-1)
    out = lower + torch.diag_embed(0.5 + torch.rand(*shape, d, generator=g, dtype=dtype))
    if garbage:
        out = out + torch.randn(*shape, d, d, generator=g, dtype=dtype).triu(1)
    return out


def random_log_weights(shape, g, dtype, scale, zero_fraction):
    """Normalised log-weights with a fraction of -inf entries (never a whole row)."""
    lw = (scale * torch.randn(shape, generator=g, dtype=F64)).to(dtype)
    zero = torch.rand(shape, generator=g) < zero_fraction
    keep = torch.randint(shape[-1], shape[:-1] + (1,), generator=g)
    zero.scatter_(-1, keep, False)
    return normalize(lw.masked_fill(zero, -math.inf))[0]


def dense_kron(b, a):
    """``B^T kron A`` in float64 by torch.kron, batch by batch."""
    n, p = a.shape[-1], b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    aa, bb = a.double().expand(batch + (n, n)).reshape(-1, n, n), b.double().expand(batch + (p, p)).reshape(-1, p, p)
    return torch.stack([torch.kron(y.T.contiguous(), x.contiguous()) for x, y in zip(aa, bb)]).reshape(batch + (n * p, n * p))


# --- Engine properties ----------------------------------------------------------------------------
# The property suites of the engines (tests/**/test_*_properties.py) draw whole models and inputs
# and hold every public entry point to one invariant: a clear error naming the argument or time
# step, or a finite answer that agrees with the oracle where there is one. The default run tries a
# few examples per property; a long run sets PYRO_SMC_PROPERTY_EXAMPLES, e.g.
#   PYRO_SMC_PROPERTY_EXAMPLES=500 python -m pytest tests -k properties --hypothesis-show-statistics
# Runs are derandomised (the same examples every time); PYRO_SMC_PROPERTY_RANDOM=1 draws new ones,
# seeded by pytest's --hypothesis-seed=N, to try the properties on other examples.
ENGINE_EXAMPLES = int(os.environ.get("PYRO_SMC_PROPERTY_EXAMPLES", "8"))
ENGINE = settings(PROPERTY, max_examples=ENGINE_EXAMPLES, derandomize=not os.environ.get("PYRO_SMC_PROPERTY_RANDOM"))

#: The exception types a public entry point may raise for bad input.
CLEAR_ERRORS = (ValueError, TypeError)


def assert_clear_error(error: BaseException, *names: str) -> None:
    """``error`` is a ``ValueError``/``TypeError`` whose message names one of ``names`` (an argument,
    ``"time step"``, a site): the invariant's error half. Raises the original error otherwise, so a
    property that meets an obscure error reports it with its traceback."""
    message = str(error)
    if not isinstance(error, CLEAR_ERRORS) or not any(name in message for name in names):
        raise AssertionError(f"not a clear error (expected a ValueError naming one of {names}): {type(error).__name__}: {message}") from error


def assert_finite(value, what: str) -> None:
    """Every tensor in ``value`` (a tensor, or a dict/tuple/list of them, nested) is finite."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise AssertionError(f"{what} is not finite: {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            assert_finite(item, f"{what}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            assert_finite(item, f"{what}[{i}]")
