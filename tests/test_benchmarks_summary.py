"""``benchmarks/summarize.py``: extractors on the stored results, one row per script, ``--check``."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("benchmarks_summarize", BENCH / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extractors_run_on_stored_results(summarize):
    checked = 0
    for stem, extractor in summarize.EXTRACTORS.items():
        path = summarize.RESULTS / f"{stem}.json"
        if not path.exists():  # not run yet: its smoke run has the same layout
            path = summarize.RESULTS / f"{stem}.quick.json"
        if not path.exists():
            continue
        cells = extractor(json.loads(path.read_text()))
        assert set(summarize.FIELDS) <= cells.keys(), stem
        assert all(isinstance(cells[f], str) and cells[f] for f in summarize.FIELDS), stem
        checked += 1
    assert checked >= 10
    for stem in summarize.EXTRACTORS:
        assert not summarize.extract(stem)["headline"].startswith("unreadable"), stem


def test_one_row_per_script(summarize):
    rows = summarize.build_rows()
    names = [row.script for row in rows]
    on_disk = sorted(p.name for p in BENCH.glob("bench_*.py"))
    assert len(names) == len(set(names))
    assert set(on_disk) <= set(names)
    for name in set(names) - set(on_disk):  # a known benchmark whose results exist without its script
        assert any((summarize.RESULTS / f"{stem}.json").exists() for stem in summarize.SCRIPTS[name])
    table = summarize.render_table(rows)
    body = table.splitlines()[2:]
    assert len(body) == len(rows)
    assert [re.match(r"\| `([^`]+)`", line).group(1) for line in body] == names
    assert all(line.count(" | ") == len(summarize.COLUMNS) - 1 for line in body)


def test_not_run_and_unreadable(summarize, tmp_path):
    (tmp_path / "bench_smcfilter.json").write_text("{ half written")
    (tmp_path / "bench_ot_cost.json").write_text(json.dumps({"command": "python x.py", "results": {}}))
    assert summarize.extract("bench_sinkhorn", tmp_path)["headline"] == "not run"
    assert summarize.extract("bench_smcfilter", tmp_path)["headline"].startswith("unreadable (JSONDecodeError")
    cells = summarize.extract("bench_ot_cost", tmp_path)
    assert cells["headline"].startswith("unreadable (KeyError")
    assert "`python x.py`" in cells["run"]
    rows = summarize.build_rows(results=tmp_path)
    assert {row.script for row in rows} >= {p.name for p in BENCH.glob("bench_*.py")}


def test_check_mode(summarize, tmp_path, capsys):
    readme = tmp_path / "README.md"
    original = (BENCH / "README.md").read_text()
    start, end = original.find(summarize.START), original.find(summarize.END)
    if start >= 0:  # strip the generated section to test the one-time insertion too
        head = original.rfind("\n\n" + summarize.HEADING, 0, start)
        original = original[:head] + original[end + len(summarize.END):]
    readme.write_text(original)
    assert summarize.main(["--check", "--readme", str(readme)]) == 1  # no markers yet
    assert summarize.main(["--readme", str(readme)]) == 0
    text = readme.read_text()
    i, j = text.index(summarize.START), text.index(summarize.END) + len(summarize.END)
    assert text.index("**Measurement conditions") < text.index(summarize.HEADING) < i < j < text.index("## 1.")
    head = text.rfind("\n\n" + summarize.HEADING, 0, i)
    assert text[:head] + text[j:] == original  # everything outside the generated section unchanged
    assert summarize.main(["--check", "--readme", str(readme)]) == 0
    assert summarize.main(["--readme", str(readme)]) == 0 and readme.read_text() == text  # idempotent
    row = next(line for line in text[i:j].splitlines() if line.startswith("| `"))
    edited = row.replace(" | ", " | edited by hand ", 1)  # one cell changed
    readme.write_text(text.replace(row, edited, 1))
    assert summarize.main(["--check", "--readme", str(readme)]) == 1
    assert summarize.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == text
    assert "| benchmark |" in capsys.readouterr().out
