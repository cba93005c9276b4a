"""The repository passes ``ruff check`` with the rules configured in ``pyproject.toml``.

Part of the default test run, so CI (``.ci/run``) lints every change: the package, the tests,
the benchmarks, the docs configuration and the tutorials (ruff reads notebooks).
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
