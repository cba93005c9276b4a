"""The release artefacts: ``python -m build`` makes an sdist and a wheel, and the wheel installs
into a fresh virtual environment and runs from there.

The fresh environment gets the wheel alone (``--no-deps``); its dependencies (torch, pyro) come
from the running environment through a ``.pth`` file, so the test needs no download and still
proves that ``pyro_smc`` is imported from the installed wheel, not from this checkout.
"""

import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pyro_smc

ROOT = pathlib.Path(__file__).resolve().parents[1]

SMOKE = textwrap.dedent(
    """
    import pathlib, sys
    import torch
    import pyro_smc
    from pyro_smc import SMC
    from pyro_smc.models import LinearGaussianSSM
    assert pathlib.Path(pyro_smc.__file__).resolve().is_relative_to(pathlib.Path(sys.prefix).resolve()), pyro_smc.__file__
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, eye, torch.zeros(2), eye)
    print(pyro_smc.__version__, SMC(ssm, None, 20, 0).run(ssm.simulate(5)[1]).log_evidence.shape)
    """
)


def _run(*args, **kwargs):
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
    return result


def test_sdist_and_wheel_build_install_and_run(tmp_path):
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT)
    version = pyro_smc.__version__
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name == f"pyro_smc-{version}-py3-none-any.whl" and sdist.name == f"pyro_smc-{version}.tar.gz"

    names = zipfile.ZipFile(wheel).namelist()
    assert "pyro_smc/py.typed" in names and f"pyro_smc-{version}.dist-info/licenses/LICENSE" in names
    assert not any(name.startswith(("tests/", "benchmarks/", "docs/", "tutorials/")) for name in names)
    metadata = zipfile.ZipFile(wheel).read(f"pyro_smc-{version}.dist-info/METADATA").decode()
    assert f"Version: {version}" in metadata and "License-Expression: Apache-2.0" in metadata
    members = {pathlib.PurePosixPath(m).relative_to(f"pyro_smc-{version}").as_posix() for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"LICENSE", "README.md", "pyproject.toml", "pyro_smc/py.typed"} <= members
    # No test suite by halves (it once shipped 18 of 68 test files, without conftest.py).
    assert not any(m.startswith(("tests/", "benchmarks/", "tutorials/", "docs/")) for m in members), sorted(members)
    assert "Requires-Python: >=3.9" in metadata and "Author: The pyro_smc developers" in metadata

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel)
    target = pathlib.Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (target / "outer_dependencies.pth").write_text("\n".join(sorted(outer)) + "\n")
    out = _run(python, "-c", SMOKE, cwd=tmp_path).stdout
    assert out.split()[0] == version and "torch.Size([1])" in out
