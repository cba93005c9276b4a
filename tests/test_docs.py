"""The README and docs examples run, every public name resolves, the tutorials run in smoke mode."""

import importlib
import os
import pathlib
import re
import time
import warnings

import pytest
import torch

from pyro_smc.infer import EPConvergenceWarning
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning

ROOT = pathlib.Path(__file__).resolve().parents[1]

PUBLIC = {
    "pyro_smc": ["SMC", "SMCELBO", "EPSmoother", "OnlineVariationalFilter", "PMMH", "ParticleGibbs", "SMC2"],
    "pyro_smc.infer.pmcmc": ["PMMH", "ParticleGibbs", "AdaptiveRandomWalk", "ConditionalSMC", "Trajectory", "trajectory_log_density"],
    "pyro_smc.infer.smc2": ["SMC2", "SMC2Result"],
    "pyro_smc.infer.static_parameters": ["StaticParameters"],
    "pyro_smc.resamplers": ["MultinomialResampler", "ResidualResampler", "SystematicResampler", "StratifiedResampler", "SoftResampler", "OTResampler"],
    "pyro_smc.models": ["LinearGaussianSSM", "NonlinearGaussianSSM", "DiagonalLinearGaussianSSM", "ChaoticRNN", "NeuralSSM", "NeuralProposal", "Lorenz96SSM"],
    "pyro_smc.gp": ["MultiOutputGP"],
    "pyro_smc.distributions": ["MatrixNormal"],
    "pyro_smc.guides": ["AutoKroneckerFlow", "StreamingFilterGuide"],
    "pyro_smc.arviz": ["to_inference_data"],
    "pyro_smc.distributed": ["DistributedELBO", "broadcast_params"],
    "pyro_smc.regression": ["QuadraticRegressor", "KernelRidgeRegressor", "MLPRegressor", "make_regressor"],
    "pyro_smc.infer": [
        "OnlineVariationalFilter",
        "extended_rts_smoother",
        "unscented_rts_smoother",
        "gp_adf",
        "gp_rtss",
        "GaussianSmootherResult",
        "iterated_extended_rts_smoother",
        "NominalLinearization",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_resolve(module):
    mod = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert hasattr(mod, name), f"{module}.{name}"
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{module}.__all__ lists missing {name}"


_EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)```", re.S)


def example_pages() -> list[pathlib.Path]:
    """The README and the documentation's own pages (not the build, nor the copied tutorials)."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if not p.relative_to(ROOT / "docs").parts[0].startswith(("_build", "tutorials")))
    return [ROOT / "README.md"] + pages


def readme_example(name: str) -> str:
    """The python block marked ``<!-- example: name -->`` in the README or a page of ``docs/``
    (markers, not positions, so that adding a block does not renumber the others)."""
    examples = {}
    for page in example_pages():
        examples.update(_EXAMPLE.findall(page.read_text()))
    return examples[name]


def test_every_readme_and_docs_python_block_is_marked_and_tested():
    """Examples run as printed: every python block of the README and the docs pages has a marker
    and a test that runs it."""
    names = []
    for page in example_pages():
        text = page.read_text()
        marked = [name for name, _ in _EXAMPLE.findall(text)]
        assert len(marked) == text.count("```python"), f"a python block in {page.relative_to(ROOT)} has no <!-- example: name --> marker"
        names += marked
    assert len(set(names)) == len(names), names
    tested = set(re.findall(r'readme_example\("([\w-]+)"\)', pathlib.Path(__file__).read_text()))
    assert set(names) <= tested, f"examples without a test: {set(names) - tested}"


# The site's content column holds about 88 characters of code at a 1400-pixel window (furo);
# tutorials/ruff.toml holds the notebooks' cells to the same limit in the lint.
CODE_WIDTH = 88
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def test_code_blocks_and_tutorial_cells_fit_the_page():
    """No line of a fenced block of the README and the docs pages, nor of a tutorial's code
    cell, is wider than CODE_WIDTH (a wider one scrolls sideways on the site)."""
    import json

    wide = []
    for page in example_pages():
        for block in _FENCE.findall(page.read_text()):
            wide += [f"{page.relative_to(ROOT)}: {len(line)}: {line}" for line in block.splitlines() if len(line) > CODE_WIDTH]
    for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
        for k, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            if cell["cell_type"] == "code":
                lines = "".join(cell["source"]).splitlines()
                wide += [f"{notebook.name} cell {k}: {len(line)}: {line}" for line in lines if len(line) > CODE_WIDTH]
    assert not wide, "\n".join(wide)


def test_tutorial_printed_outputs_fit_the_page():
    """No line a committed tutorial prints (a stdout stream, or the text/plain form of a cell's
    result) is wider than CODE_WIDTH: the site shows them in the same column as the code, and
    a wider table scrolls sideways. Before: 138 such lines in 01, 02, 03, 04 and 06, up to 256
    columns. stderr is left out: the site wraps warnings (CSS), and the tutorials show a few
    on purpose."""
    import json

    wide = []
    for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
        for k, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            for output in cell.get("outputs", []):
                if output["output_type"] == "stream" and output["name"] == "stdout":
                    text = "".join(output["text"])
                elif output["output_type"] == "execute_result":
                    text = "".join(output["data"].get("text/plain", ""))
                else:
                    continue
                lines = text.splitlines()
                wide += [f"{notebook.name} cell {k}: {len(line)}: {line}" for line in lines if len(line) > CODE_WIDTH]
    assert not wide, "\n".join(wide)


def test_docstring_examples_fit_the_page():
    """No ``>>>`` or ``...`` line of a docstring example in the package is wider than CODE_WIDTH
    as the API pages show it (prompt included, docstring indentation not). Before: 176 lines, up
    to 140 columns. Expected outputs are not checked: a few are error messages printed whole."""
    wide = []
    for module in sorted((ROOT / "pyro_smc").rglob("*.py")):
        for number, line in enumerate(module.read_text().splitlines(), 1):
            shown = line.strip()
            if shown.startswith((">>>", "...")) and len(shown) > CODE_WIDTH:
                wide.append(f"{module.relative_to(ROOT)}:{number}: {len(shown)} columns")
    assert not wide, "\n".join(wide)


def _readme_ar1_mle(ys):
    """Exact maximum-likelihood theta of the README's AR(1) (Kalman log-likelihood on a grid)."""
    from pyro_smc.models import LinearGaussianSSM

    one = torch.ones(1, 1, dtype=torch.float64)
    grid = torch.linspace(-0.99, 0.99, 199, dtype=torch.float64)
    ys = ys.double().reshape(-1, 1)
    loglik = [LinearGaussianSSM(th * one, one, one, 0.09 * one, torch.zeros(1, dtype=torch.float64), one).log_evidence(ys) for th in grid]
    return float(grid[torch.stack(loglik).argmax()])


# The README's SVI example, as printed (Adam at lr 0.1, 100 steps), learns theta on every data seed
# tried: final theta against the exact MLE on data seeds 0-7 (numbers and command in
# docs/advice.md). The default run checks the first 20 steps of seed 0 (MLE 0.76: |theta - MLE| is
# 0.178 after 10 steps, 0.076 after 15, 0.016 after 20; seeds 3 and 5 0.023 and 0.000 after 20);
# PYRO_SMC_FULL=1 runs the printed 100 steps on eight seeds.
FULL = os.environ.get("PYRO_SMC_FULL") == "1"


@pytest.mark.parametrize("data_seed", list(range(8)) if FULL else [0])
def test_readme_example_learns(data_seed):
    code = readme_example("smc-svi")
    assert "range(100):\n    svi" in code
    steps = 100 if FULL else 20
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(data_seed)  # the README draws its data from the global generator
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        exec(code.replace("range(100):\n    svi", f"range({steps}):\n    svi"), namespace)
    assert namespace["smc"].log_evidence.shape == (8,)
    assert torch.isfinite(namespace["smc"].log_evidence).all()
    theta, mle = float(namespace["model"].theta.detach()), _readme_ar1_mle(namespace["ys"])
    # Measured |theta - MLE| on seeds 0-7 (torch 2.13's generator): after 30 steps at most 0.048
    # (seed 2, still climbing), after 100 at most 0.052 (seed 1; the others 0.017); 20 steps above. Adam at lr 0.1
    # keeps moving by a few hundredths around the optimum (up to 0.059 along these runs), and the
    # MLE's own standard error at T = 100 is about 0.07, so 0.08 is "learned", 0.6 away is not.
    assert abs(theta - mle) < 0.08, (theta, mle)


def test_readme_smoothing_example_runs_and_agrees_with_rts():
    """The README's smoothing example as printed: the smoothed means lie within half a posterior
    standard deviation of the RTS smoother's (missing steps and the missing entry included), and
    closer to them than the filtering means are (so the backward pass did something)."""
    code = readme_example("particle-smoothing")
    namespace = {}
    exec(code, namespace)
    paths, ssm, ys, smc = namespace["paths"], namespace["ssm"], namespace["ys"], namespace["smc"]
    assert paths.shape == (200, 50, 4, 2)
    rts = ssm.rts_smoother(ys)
    sd = rts.covariances.diagonal(dim1=-2, dim2=-1).sqrt()
    smoothed = namespace["smoothed_means"].mean(1)
    assert bool(((smoothed - rts.means).abs() < 0.5 * sd).all())
    filtered = smc.filtering_means["x"].mean(1)
    assert (smoothed - rts.means).abs().mean() < 0.5 * (filtered - rts.means).abs().mean()


def test_readme_ep_example_runs():
    code = readme_example("ep-smoother")
    namespace = {}
    # Cut to 3 sweeps, EP has not converged, and says so.
    with pytest.warns(EPConvergenceWarning, match="max_iter=3"):
        exec(code.replace("max_iter=50", "max_iter=3"), namespace)
    ep = namespace["ep"]
    assert ep.means.shape == (100, 1) and len(ep.history) == 3 and ep.first_sweep is not None


def test_ep_learning_example_learns():
    """docs/engines/ep.md's learning example. The default run takes 3 of its 40 Adam steps (they
    must lower the loss); PYRO_SMC_FULL=1 runs it as printed on the printed data seed and two more
    and checks that the fit reaches the evidence of the true parameters to 0.2 nats (measured: seed
    2 exceeds it by 1.1 nats; g 9.47 / 10.26 / 10.96, r 0.117 / 0.098 / 0.101: the spread in g is
    the data's; 19 s for the three fits)."""
    code = readme_example("ep-learning")
    assert "num_steps=40" in code and "manual_seed(0)" in code
    old = torch.get_default_dtype()
    try:
        for seed in (0, 1, 2) if FULL else (0,):
            namespace = {}
            run = code.replace("manual_seed(0)", f"manual_seed({seed})")
            exec(run if FULL else run.replace("num_steps=40", "num_steps=3"), namespace)
            losses, ssm = namespace["losses"], namespace["ssm"]
            assert losses[-1] < losses[0]
            if FULL:
                EPSmoother, pyro = namespace["EPSmoother"], namespace["pyro"]
                with torch.no_grad():
                    pyro.clear_param_store()  # the truth's own parameters, not the fitted ones
                    truth = namespace["NonlinearGaussianSSM"](
                        namespace["Pendulum"](9.81), namespace["Q"], namespace["sensor"], 0.1 * torch.eye(1), torch.tensor([1.5, 0.0]), 0.1 * torch.eye(2)
                    )
                    at_truth = float(EPSmoother(truth, projection="unscented", max_iter=100).smooth(namespace["ys"]).log_evidence) / len(namespace["ys"])
                assert -losses[-1] > at_truth - 2e-3, (losses[-1], at_truth)
                assert abs(ssm.transition.g.item() - 9.81) < 1.5 and abs(ssm.observation_cov.item() - 0.1) < 0.03
    finally:
        torch.set_default_dtype(old)


def test_first_filter_example_runs():
    """docs/getting_started.md's first filter, as printed: the shapes its comments state."""
    namespace = {}
    exec(readme_example("first-filter"), namespace)
    smc = namespace["smc"]
    assert smc.log_evidence.shape == (4,) and bool(torch.isfinite(smc.log_evidence).all())
    assert smc.filtering_means["x"].shape == (50, 4)


# docs/getting_started.md's first fit, as printed, learns the exact maximum-likelihood r (a Kalman
# grid of step 0.01). Measured |learned - MLE| on data seeds 0-5: at most 0.012 (seed 2); the
# bootstrap filter (no guide) is 0.15-0.18 too high on seeds 0-2, so the bound below catches a
# proposal that stops reaching the filter. The default run is the printed seed (10 s);
# PYRO_SMC_FULL=1 runs seeds 0-3.
@pytest.mark.parametrize("data_seed", [0, 1, 2, 3] if FULL else [0])
def test_first_fit_example_learns_the_mle(data_seed):
    code = readme_example("first-fit")
    assert "torch.manual_seed(0)" in code and "range(100)" in code
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        namespace = {}
        with warnings.catch_warnings():
            warnings.simplefilter("error", SinkhornConvergenceWarning)
            exec(code.replace("torch.manual_seed(0)", f"torch.manual_seed({data_seed})"), namespace)
    finally:
        torch.set_default_dtype(old)
    learned = namespace["pyro"].param("r").item()
    grid, log_p = namespace["grid"], namespace["log_p"]
    mle = float(grid[log_p.argmax()])
    assert abs(learned - mle) < 0.03, (learned, mle)
    # the estimate lies below the exact maximum: Jensen, plus the OT bias (measured 0.2-1.0 nats)
    assert -namespace["loss"] < float(log_p.max()) + 0.5


def test_readme_kronecker_example_runs():
    code = readme_example("kronecker-flow")
    namespace = {}
    exec(code.replace("range(500)", "range(5)"), namespace)
    assert namespace["guide"].median(namespace["x"])["w"].shape == (5, 2)


def test_quickstart_demo_runs(capsys):
    from pyro_smc.__main__ import main

    main(["--num-particles", "20", "--num-filters", "2", "--steps", "10"])
    captured = capsys.readouterr()
    out = captured.out
    assert "exact" in out and "OT" in out
    # The table is printed in one piece after the runs: stdout holds no progress-bar text, and
    # the bars (stderr) are all written before the table's first line.
    assert "it/s" not in out and "\r" not in out
    lines = out.splitlines()
    assert lines[1].startswith("resampler") and lines[2].startswith("OT") and lines[3].startswith("systematic")


@pytest.mark.parametrize("notebook", sorted((ROOT / "tutorials").glob("*.ipynb")), ids=lambda p: p.name)
def test_tutorial_smoke(notebook, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("CI", "1")
    # The kernel is a process of its own: one intra-op thread, as the suite's (conftest.py) and
    # the README's advice for small problems; with torch's default a kernel beside a busy test
    # worker waits on its threads several times over.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(str(notebook), as_version=4)
    start = time.time()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
    assert time.time() - start < 600


def test_readme_streaming_example_runs():
    code = readme_example("online-filter")
    namespace = {}
    exec(code.replace("simulate(400)", "simulate(8)"), namespace)
    assert namespace["vf"].t == 8 and set(namespace["vf"].parameters()) == {"transition_diag", "emission_diag"}


def test_readme_torchrun_example_runs_in_one_process(monkeypatch):
    """Without torchrun the example is one rank of a one-process gloo group."""
    import torch.distributed as tdist

    code = readme_example("torchrun")
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


def test_pmmh_examples_run():
    """The PMMH page's examples, as printed (about 150 filter runs of T = 20, N = 50)."""
    namespace = {}
    exec(readme_example("pmmh"), namespace)
    assert set(namespace["samples"]) == {"rho", "sigma"}
    assert 0.0 <= namespace["rate"] <= 1.0
    exec(readme_example("pmmh-noise"), namespace)
    assert namespace["noise_sd"] > 0


def test_particle_gibbs_example_runs():
    """docs/engines/pmcmc.md's particle Gibbs example, cut to 10 samples (the posterior itself
    is checked against the exact grid posterior in tests/infer/pmcmc/test_gibbs.py)."""
    code = readme_example("particle-gibbs")
    assert "num_samples=200, warmup_steps=100" in code
    namespace = {}
    exec(code.replace("num_samples=200, warmup_steps=100", "num_samples=10, warmup_steps=5, disable_progbar=True"), namespace)
    assert namespace["A"].shape == (10, 1, 1) and bool((namespace["A"].abs() < 1).all())
    assert namespace["paths"].shape == (10, 50, 1)
    assert 0 <= namespace["rate"] <= 1


def test_smc2_example_runs():
    """docs/engines/smc2.md's example, as printed: a finite evidence and a posterior mean of rho
    near the simulated 0.7 (the posterior sd at T = 40 is about 0.12)."""
    namespace = {}
    exec(readme_example("smc2"), namespace)
    smc2 = namespace["smc2"]
    assert bool(torch.isfinite(smc2.log_evidence))
    assert abs(float(smc2.posterior_mean()["rho"]) - 0.7) < 0.5
    assert smc2.result.rejuvenated.any()
