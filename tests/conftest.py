"""Shared test configuration: float64 by default, fixed seeds, ``--device``, the ``slow`` marker."""

import os

import pyro
import pytest
import torch

from pyro_smc.infer.smc.compiled import _SHARED


# The suite is dominated by small tensor ops, for which intra-op threads only add barrier waits:
# on a loaded 2-core machine a 2 x 2 Cholesky took 12 ms with two threads and 12 us with one.
torch.set_num_threads(1)


# Slow cases (long series, several data seeds, learning runs at full length) are opt-in: mark a
# test ``@pytest.mark.slow`` and it runs only under PYRO_SMC_FULL=1, with the rest of the full run.
FULL = os.environ.get("PYRO_SMC_FULL") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slow case, run only under PYRO_SMC_FULL=1 (the full run)")


# The longest tests of the default run, longest first (tens of seconds each). pytest-xdist hands
# tests to its workers in collection order, and these are collected last (tests/test_docs*.py):
# left there, one worker ran a notebook or the documentation build while the other sat idle.
# Collected first, they are spread over the workers at the start and the short tests fill in.
LONG_FIRST = (
    "tests/test_docs_build.py::test_docs_build",
    "tests/test_docs.py::test_tutorial_smoke",
    "tests/test_docs.py::test_readme_example_learns",
    "tests/test_docs.py::test_first_fit_example_learns_the_mle",
    "tests/models/test_neural_ssm.py::test_svi_learns_the_noise_scales_and_a_proposal",
    "tests/infer/test_model_state.py::test_killed_stream_resumes_bit_identically",
    "tests/test_distributed.py",
    "tests/test_packaging.py",
)


def _long_first_rank(item) -> int:
    return next((rank for rank, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_first_rank)  # stable: the rest keep their order
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow: PYRO_SMC_FULL=1 runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="torch device for tests that accept one (cpu, cuda)")


@pytest.fixture(autouse=True)
def _defaults():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    # Each test starts without SMC recordings shared by class from earlier tests (a test that
    # counts its replayed steps expects its own first run to record).
    _SHARED.clear()
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def device(request):
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device(name)
