"""The import rules of ARCHITECTURE.md hold: its layer table is read here and every module checked.
And the tests mirror the package: the tests of ``pyro_smc/<path>/<module>.py`` live in
``tests/<path>/test_<module>.py`` (or ``test_<module>_<aspect>.py`` for one aspect of a big module).

A rule is only as true as its check, so the table in ARCHITECTURE.md is the single source: changing
a layer means changing that table, and this test then enforces the new rule.
"""

import ast
import fnmatch
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pyro_smc"


def _layers() -> list[dict]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    rows = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    layers = []
    for row in rows:
        name, modules, may, may_not = (cell.strip() for cell in row.strip("|").split("|"))
        layers.append({
            "name": name,
            "patterns": re.findall(r"`([\w.*]+)`", modules),
            "may": {m.strip() for m in may.split(",") if m.strip()},
            "forbidden": re.findall(r"`([\w.]+)`", may_not),
        })
    return layers


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer_of(module: str, layers: list[dict]) -> str:
    for layer in layers:
        if any(module == p or fnmatch.fnmatchcase(module, p) for p in layer["patterns"]):
            return layer["name"]
    raise AssertionError(f"{module} is in no layer of ARCHITECTURE.md")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_layer_table_parses():
    layers = _layers()
    assert [layer["name"] for layer in layers] == ["ops", "blocks", "guides", "infer", "front"]
    assert all(layer["patterns"] and layer["name"] in layer["may"] for layer in layers)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_module_imports_follow_the_layers(path):
    layers = _layers()
    by_name = {layer["name"]: layer for layer in layers}
    module = _module_name(path)
    layer = by_name[_layer_of(module, layers)]
    for imported in _imports(path):
        top = imported.split(".")[0]
        assert top not in layer["forbidden"], f"{module} ({layer['name']}) imports {imported}"
        if top == "pyro_smc":
            target = _layer_of(imported, layers)
            assert target in layer["may"], f"{module} ({layer['name']}) imports {imported} ({target})"


def test_the_rules_forbid_pyro_in_ops_and_engines_in_guides():
    # The two rules the design most relies on; checked by hand once (an `import pyro` in
    # ops/weights.py, an import of infer.smc in guides/streaming.py each failed the test above).
    layers = _layers()
    ops, guides = (next(la for la in layers if la["name"] == n) for n in ("ops", "guides"))
    assert "pyro" in ops["forbidden"]
    assert _layer_of("pyro_smc.infer.smc", layers) not in guides["may"]


# -------------------------------------------------------------------------------------------------
# Tests mirror the package
# -------------------------------------------------------------------------------------------------
TESTS = ROOT / "tests"
# The only test files that test no single module: checks of the whole project.
CROSS_CUTTING = {
    "test_architecture.py",  # this file: import rules and test layout
    "test_benchmarks_summary.py",
    "test_ci_script.py",
    "test_device.py",  # every engine on a --device
    "test_docs.py",
    "test_lint.py",  # ruff over the whole repository
    "test_packaging.py",  # sdist and wheel build, install into a fresh environment
    "test_docs_build.py",  # the Sphinx build of docs/ and the docstring coverage of every public name
    "test_docs_claims.py",  # each checkable claim of the docs pages about saving, gradients, approximations
    "test_math_docs.py",
    "guides/test_autoguide_conformance.py",  # every guide against Pyro's AutoGuide contract
}


def _tested_module(test_file: str, package: pathlib.Path = PACKAGE) -> pathlib.Path | None:
    """The module ``pyro_smc/<path>/<module>.py`` that ``tests/<path>/test_<module>[_<aspect>].py``
    tests (the longest module name that matches), or None."""
    rel = pathlib.PurePosixPath(test_file)
    name = rel.stem.removeprefix("test_")
    folder = package.joinpath(*rel.parts[:-1])
    matches = [m for m in folder.glob("*.py") if m.stem != "__init__" and (name == m.stem or name.startswith(m.stem + "_"))]
    return max(matches, key=lambda m: len(m.stem), default=None)


def _misplaced(test_files) -> list[str]:
    return sorted(f for f in test_files if f not in CROSS_CUTTING and _tested_module(f) is None)


TEST_FILES = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def test_every_test_file_is_named_after_the_module_it_tests():
    assert _misplaced(TEST_FILES) == [], "move each to tests/<path>/test_<module>[_<aspect>].py of its module"


def test_a_misplaced_test_file_is_reported():
    # Checked by hand once as well: a copy of tests/ops/test_weights.py saved as
    # tests/infer/test_weights.py failed the test above.
    wrong = ["ops/test_smc.py", "infer/test_weights.py", "ops/test_resampled.py", "test_misc.py", "guides/test_properties.py"]
    assert _misplaced(wrong) == sorted(wrong)
    right = ["ops/test_resample.py", "ops/test_weights.py", "infer/smc/test_step_numerics.py", "infer/smc/test_elbo.py", "resamplers/test_ot_discrete_state.py"]
    assert _misplaced(right) == []
    assert _tested_module("infer/smc/test_engine_ot_gradients.py") == PACKAGE / "infer" / "smc" / "engine.py"  # the longest match wins


def test_the_cross_cutting_files_exist_and_test_folders_are_packages():
    assert all((TESTS / f).is_file() for f in CROSS_CUTTING)
    for folder in {(TESTS / f).parent for f in TEST_FILES}:
        assert (folder / "__init__.py").is_file(), f"{folder} needs an __init__.py (tests import each other as tests.<path>.<module>)"
