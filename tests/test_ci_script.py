"""``.ci/run`` runs the README's Quick start test command as printed, and fails loudly without it."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(root, *args):
    return subprocess.run(["bash", str(root / ".ci" / "run"), *args], capture_output=True, text=True, timeout=60)


def test_ci_reads_the_readme_test_line():
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.rstrip().endswith("# tests")]
    assert len(lines) == 1
    result = _run(ROOT, "--print-command")
    assert result.returncode == 0, result.stderr
    assert result.stdout == lines[0] + "\n"
    assert '-e ".[test]"' in lines[0] and "python -m pytest" in lines[0]


@pytest.mark.parametrize(
    "readme",
    [
        "# x\n\n## Quick start\n\n```bash\npip install -e .   # demo\n```\n",
        "# x\n\n## Quick start\n\n```bash\npytest   # tests\npytest -x   # tests\n```\n",
        "# x\n\n## Other\n\n```bash\npytest   # tests\n```\n",
    ],
    ids=["missing", "twice", "outside-quick-start"],
)
def test_ci_fails_loudly_without_one_readme_test_line(tmp_path, readme):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    result = _run(tmp_path)
    assert result.returncode != 0
    assert "# tests" in result.stderr
    assert not (tmp_path / ".venv-ci").exists()
