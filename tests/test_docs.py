"""The README example runs, every public name resolves, the tutorials run in smoke mode."""

import importlib
import pathlib
import re
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

PUBLIC = {
    "pyro_smc": ["SMC", "SMCELBO", "EPSmoother", "OnlineVariationalFilter"],
    "pyro_smc.resamplers": ["MultinomialResampler", "SystematicResampler", "StratifiedResampler", "SoftResampler", "OTResampler"],
    "pyro_smc.models": ["LinearGaussianSSM", "NonlinearGaussianSSM", "DiagonalLinearGaussianSSM", "ChaoticRNN"],
    "pyro_smc.gp": ["MultiOutputGP"],
    "pyro_smc.distributions": ["MatrixNormal"],
    "pyro_smc.guides": ["AutoKroneckerFlow", "StreamingFilterGuide"],
    "pyro_smc.arviz": ["to_inference_data"],
    "pyro_smc.distributed": ["DistributedELBO", "broadcast_params"],
    "pyro_smc.regression": ["QuadraticRegressor", "KernelRidgeRegressor", "MLPRegressor", "make_regressor"],
    "pyro_smc.infer": ["OnlineVariationalFilter", "extended_rts_smoother", "unscented_rts_smoother", "gp_adf", "gp_rtss", "GaussianSmootherResult"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_resolve(module):
    mod = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert hasattr(mod, name), f"{module}.{name}"
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{module}.__all__ lists missing {name}"


def test_readme_example_runs():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    torch.set_default_dtype(torch.float32)
    namespace = {}
    exec(code.replace("range(100):\n    svi", "range(2):\n    svi"), namespace)
    assert namespace["smc"].log_evidence.shape == (8,)
    # Data come from the model at theta = 0.8: the estimate is a finite log-evidence near the scale of T.
    assert torch.isfinite(namespace["smc"].log_evidence).all()


def test_readme_ep_example_runs():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    namespace = {}
    exec(code.replace("max_iter=50", "max_iter=3"), namespace)
    ep = namespace["ep"]
    assert ep.means.shape == (100, 1) and len(ep.history) == 3 and ep.first_sweep is not None


def test_readme_kronecker_example_runs():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[2]
    namespace = {}
    exec(code.replace("range(500)", "range(5)"), namespace)
    assert namespace["guide"].median(namespace["x"])["w"].shape == (5, 2)


def test_quickstart_demo_runs(capsys):
    from pyro_smc.__main__ import main

    main(["--num-particles", "20", "--num-filters", "2", "--steps", "10"])
    out = capsys.readouterr().out
    assert "exact" in out and "OT" in out


@pytest.mark.parametrize("notebook", sorted((ROOT / "tutorials").glob("*.ipynb")), ids=lambda p: p.name)
def test_tutorial_smoke(notebook, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("CI", "1")
    nb = nbformat.read(str(notebook), as_version=4)
    start = time.time()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
    assert time.time() - start < 600


def test_readme_streaming_example_runs():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[3]
    namespace = {}
    exec(code.replace("simulate(400)", "simulate(8)"), namespace)
    assert namespace["vf"].t == 8 and set(namespace["vf"].parameters()) == {"transition_diag", "emission_diag"}


def test_readme_torchrun_example_runs_in_one_process(monkeypatch):
    """Without torchrun the example is one rank of a one-process gloo group."""
    import torch.distributed as tdist

    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[4]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29531")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    namespace = {}
    try:
        exec(code.replace("range(200)", "range(3)"), namespace)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
    assert namespace["world"] == 1 and isinstance(namespace["loss"], float)
