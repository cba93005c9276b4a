"""``benchmarks/summarize.py``: every result file carries a valid summary record, the table is built
from the records alone (one row per script), ``--check``."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("benchmarks_summarize", BENCH / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main_results(summarize):
    """The files summarize.py reads: ``<stem>.json`` without a variant suffix."""
    return [p for p in sorted(summarize.RESULTS.glob("*.json")) if "." not in p.name[: -len(".json")]]


def test_every_result_file_has_a_valid_record(summarize):
    common = importlib.import_module("_common")  # on sys.path once summarize.py is loaded
    paths = main_results(summarize)
    assert len(paths) >= 15
    scripts = {p.name for p in BENCH.glob("bench_*.py")}
    for path in paths + sorted(summarize.RESULTS.glob("*.quick.json")):  # smoke runs write the same record
        record = json.loads(path.read_text()).get(common.SUMMARY_KEY)
        assert common.check_record(record) == [], path.name
        assert record["script"] in scripts, path.name
        assert record["run"].startswith(f"`results/{path.name}`"), path.name
        if path in paths:
            assert not record["ours"].startswith("unreadable"), path.name


def test_table_comes_from_the_records_alone(summarize, tmp_path):
    common = importlib.import_module("_common")
    rows = summarize.build_rows()
    by_script = {row.script: row for row in rows}
    for path in main_results(summarize):
        record = json.loads(path.read_text())[common.SUMMARY_KEY]
        row = by_script[record["script"]].cells_by_name
        for cell in common.SUMMARY_CELLS:
            if record[cell]:
                expected = f"{record['label']}: {record[cell]}" if record["label"] else record[cell]
                assert expected in row[cell].split("<br>"), (path.name, cell)
    # Strip every file down to its record: the table must not change.
    for path in main_results(summarize):
        record = json.loads(path.read_text())[common.SUMMARY_KEY]
        (tmp_path / path.name).write_text(json.dumps({common.SUMMARY_KEY: record}))
    stripped = summarize.build_rows(results=tmp_path)
    assert summarize.render_table(stripped) == summarize.render_table(rows)


def test_one_row_per_script(summarize):
    rows = summarize.build_rows()
    names = [row.script for row in rows]
    on_disk = sorted(p.name for p in BENCH.glob("bench_*.py"))
    assert len(names) == len(set(names))
    assert set(on_disk) <= set(names)
    assert names[: len(summarize.ORDER)] == [s for s in summarize.ORDER if s in names]
    table = summarize.render_table(rows)
    body = table.splitlines()[2:]
    assert len(body) == len(rows)
    assert [re.match(r"\| `([^`]+)`", line).group(1) for line in body] == names
    assert all(line.count(" | ") == len(summarize.COLUMNS) - 1 for line in body)


def test_not_run_and_unreadable(summarize, tmp_path):
    common = importlib.import_module("_common")
    (tmp_path / "bench_smcfilter.json").write_text("{ half written")
    (tmp_path / "bench_ot_cost.json").write_text(json.dumps({"command": "python x.py", "results": {}}))
    bad = common.summary_record("bench_ep_gp", {}, {"ours": "x"}, script="bench_ep_gp.py")
    bad["met"] = 3
    (tmp_path / "bench_ep_gp.json").write_text(json.dumps({common.SUMMARY_KEY: bad}))
    shutil.copy(summarize.RESULTS / "bnn_digits.quick.json", tmp_path)
    rows = {row.script: row.cells_by_name for row in summarize.build_rows(results=tmp_path)}
    assert rows["bench_sinkhorn.py"]["ours"] == "not run"
    assert rows["bench_bnn_digits.py"] == dict.fromkeys(common.SUMMARY_CELLS, "") | {
        "ours": "not run", "run": "only a smoke run, `results/bnn_digits.quick.json` (not summarised)"}
    assert rows["bench_smcfilter.py"]["ours"].startswith("unreadable (JSONDecodeError")
    assert rows["bench_ot_cost.py"]["ours"] == "unreadable (KeyError: \"no 'summary_record'\")"
    assert rows["bench_ot_cost.py"]["run"] == "`results/bench_ot_cost.json`"
    assert rows["bench_ep_gp.py"]["ours"].startswith("unreadable (ValueError: invalid 'summary_record': cell 'met'")
    assert set(rows) >= {p.name for p in BENCH.glob("bench_*.py")}


def test_record_of_a_failing_summary(summarize):
    """A script's summary function that meets an unexpected layout must not cost the run its file."""
    common = importlib.import_module("_common")
    record = common.summary_record("x", {"command": "python x.py", "finished": False}, lambda d: d["missing"], script="bench_x.py")
    assert common.check_record(record) == []
    assert record["ours"] == "unreadable (KeyError: 'missing')"
    assert record["run"] == "`results/x.json`; `python x.py`; **unfinished**"


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
