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


def pytest_collection_modifyitems(config, items):
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
