"""``benchmarks/summarize.py``: every result file carries a valid summary record, the tables (one per
engine folder) are built from the records alone (one row per script, one file per script), ``--check``;
``benchmarks/plot_results.py`` draws the figures of ``docs/benchmarks.md``."""

import importlib.util
import json
import os
import re
import subprocess
import sys
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
    """The files summarize.py reads: ``<group>/<stem>.json``, one per script (no variant files)."""
    paths = sorted(summarize.RESULTS.glob("*/*.json"))
    assert not list(summarize.RESULTS.glob("*.json")) and all("." not in p.stem for p in paths)
    return paths


def rel(path):
    return f"{path.parent.name}/{path.name}"


def test_every_result_file_has_a_valid_record(summarize):
    common = importlib.import_module("_common")  # on sys.path once summarize.py is loaded
    paths = main_results(summarize)
    assert len(paths) >= 15
    scripts = {f"{p.parent.name}/{p.name}" for p in BENCH.glob("*/bench_*.py")}
    for path in paths:
        record = json.loads(path.read_text()).get(common.SUMMARY_KEY)
        assert common.check_record(record) == [], path.name
        assert f"{path.parent.name}/{record['script']}" in scripts, path.name  # the file sits in its script's group
        assert f"`results/{rel(path)}`" in record["run"], path.name
        assert not record["ours"].startswith("unreadable"), path.name


def test_table_comes_from_the_records_alone(summarize, tmp_path):
    common = importlib.import_module("_common")
    rows = summarize.build_rows()
    by_script = {row.script: row for row in rows}
    for path in main_results(summarize):
        record = json.loads(path.read_text())[common.SUMMARY_KEY]
        row = by_script[record["script"]].cells_by_name
        for cell in common.SUMMARY_CELLS:
            assert row[cell] == record[cell], (path.name, cell)
    # Strip every file down to its record: the tables must not change.
    for path in main_results(summarize):
        record = json.loads(path.read_text())[common.SUMMARY_KEY]
        (tmp_path / path.parent.name).mkdir(exist_ok=True)
        (tmp_path / rel(path)).write_text(json.dumps({common.SUMMARY_KEY: record}))
    stripped = summarize.build_rows(results=tmp_path)
    assert summarize.render_tables(stripped) == summarize.render_tables(rows)


def test_a_file_of_several_runs_joins_their_records(summarize):  # loading it puts _common on sys.path
    """``write_results(..., run=...)``: one file per script, its record joining the runs' cells."""
    common = importlib.import_module("_common")
    a = common.summary_record("kronecker/x", {"command": "python a.py"}, {"ours": "1"}, label="MLP", script="bench_x.py")
    b = common.summary_record("kronecker/x", {"command": "python b.py"}, {"ours": "2", "met": "yes"}, label="conv", script="bench_x.py")
    joined = common.combine_records([a, b])
    assert common.check_record(joined) == []
    assert joined["ours"] == "MLP: 1<br>conv: 2" and joined["met"] == "conv: yes" and joined["label"] is None
    assert common.combine_records([a]) is a


def test_one_row_per_script(summarize):
    rows = summarize.build_rows()
    names = [row.script for row in rows]
    on_disk = {p.name: p.parent.name for p in BENCH.glob("*/bench_*.py")}
    assert not list(BENCH.glob("bench_*.py"))  # every script sits in its engine's folder
    assert len(names) == len(set(names))
    assert set(on_disk) <= set(names)
    assert all(on_disk[row.script] == row.group for row in rows if row.script in on_disk)
    groups = list(dict.fromkeys(row.group for row in rows))
    assert groups == [g for g in summarize.GROUPS if g in groups] + groups[len([g for g in summarize.GROUPS if g in groups]):]
    for group in groups:
        listed = [s for s in summarize.GROUPS.get(group, ("", []))[1] if s in names]
        in_group = [row.script for row in rows if row.group == group]
        assert in_group[: len(listed)] == listed
        table = summarize.render_table([row for row in rows if row.group == group])
        body = table.splitlines()[2:]
        assert [re.match(r"\| `([^`]+)`", line).group(1) for line in body] == in_group
        assert all(line.count(" | ") == len(summarize.COLUMNS) - 1 for line in body)
    assert summarize.render_tables(rows).count("| benchmark |") == len(groups)


def test_not_run_and_unreadable(summarize, tmp_path):
    common = importlib.import_module("_common")
    for group in ("smc", "resampling", "gaussian"):
        (tmp_path / group).mkdir()
    (tmp_path / "smc/bench_smcfilter.json").write_text("{ half written")
    (tmp_path / "resampling/bench_ot_cost.json").write_text(json.dumps({"command": "python x.py", "results": {}}))
    bad = common.summary_record("gaussian/bench_ep_gp", {}, {"ours": "x"}, script="bench_ep_gp.py")
    bad["met"] = 3
    (tmp_path / "gaussian/bench_ep_gp.json").write_text(json.dumps({common.SUMMARY_KEY: bad}))
    rows = {row.script: row.cells_by_name for row in summarize.build_rows(results=tmp_path)}
    assert rows["bench_sinkhorn.py"]["ours"] == "not run"
    assert rows["bench_bnn_digits.py"] == dict.fromkeys(common.SUMMARY_CELLS, "") | {"ours": "not run"}
    assert rows["bench_smcfilter.py"]["ours"].startswith("unreadable (JSONDecodeError")
    assert rows["bench_ot_cost.py"]["ours"] == "unreadable (KeyError: \"no 'summary_record'\")"
    assert rows["bench_ot_cost.py"]["run"] == "`results/resampling/bench_ot_cost.json`"
    assert rows["bench_ep_gp.py"]["ours"].startswith("unreadable (ValueError: invalid 'summary_record': cell 'met'")
    assert set(rows) >= {p.name for p in BENCH.glob("*/bench_*.py")}


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
    assert text.index("**Measurement conditions") < text.index(summarize.HEADING) < i < j
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


def test_figures_of_the_benchmarks_page(tmp_path):
    """``benchmarks/plot_results.py`` draws its figures from the committed results alone, and
    ``docs/benchmarks.md`` shows exactly those figures, each committed under ``docs/figures/``."""
    docs = BENCH.parent / "docs"
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(BENCH / "plot_results.py"), "--out", str(tmp_path)], check=True, env=env, capture_output=True, timeout=120)
    written = {p.name for p in tmp_path.glob("*.png")}
    page = (docs / "benchmarks.md").read_text()
    shown = set(re.findall(r"figures/benchmarks/([\w-]+\.png)", page))
    assert len(written) >= 5 and shown == written, (sorted(shown), sorted(written))
    assert len(re.findall(r"^```\{figure\} figures/benchmarks/", page, re.M)) == len(shown)
    committed = docs / "figures" / "benchmarks"
    assert {p.name for p in committed.glob("*.png")} == written  # no figure left over from an older script
    assert all((committed / name).stat().st_size < 150_000 for name in shown)  # small enough for the site
