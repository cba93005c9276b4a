"""Shared helpers for the benchmark scripts: timing, machine info, result files, the summary record.

Not a benchmark itself. The scripts live in one folder per engine (``benchmarks/<group>/bench_*.py``)
and import it as ``benchmarks._common``: each puts the repository root on ``sys.path`` first, so
``python benchmarks/<group>/<name>.py`` works from any directory. A script writes one result file,
``results/<group>/<name>.json`` (``--quick`` runs go to a scratch folder instead, never into git).
``summarize.py`` imports this module too, for the summary record; torch is therefore imported inside
the functions that need it, so the summary table is built without loading torch.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# --quick (smoke) runs write here: outside the repository, so they never overwrite or sit beside a full run.
SCRATCH = Path(tempfile.gettempdir()) / "pyro_smc_benchmarks"


def group() -> str:
    """The engine folder of the running script (``"smc"`` for ``benchmarks/smc/bench_smcfilter.py``)."""
    folder = Path(sys.argv[0]).resolve().parent
    return folder.name if folder.parent == HERE else ""


def result_path(name: str, quick: bool | None = None) -> Path:
    """``results/<group>/<name>.json`` of the running script; under ``--quick`` the same path below
    :data:`SCRATCH` instead."""
    quick = "--quick" in sys.argv if quick is None else quick
    return (SCRATCH if quick else RESULTS) / group() / f"{name}.json"


def result_stem(path: Path) -> str:
    """``"<group>/<name>"`` of a result path, as the summary record's run cell names it."""
    return f"{path.parent.name}/{path.stem}" if path.parent.parent in (RESULTS, SCRATCH) else path.stem


def add_common_args(parser) -> None:
    """``--quick`` and ``--threads`` (default 1: on a shared, oversubscribed machine multi-threaded
    torch makes even 2x2 ops stall on thread barriers, which swamps what is being measured)."""
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (they go to stderr)")


_NO_PROGRESS = False  # set from ``--no-progress`` by :func:`setup`, for bars made without ``args``


def progress(iterable, desc: str, args=None, total: int | None = None):
    """A tqdm progress bar over the long loops of a benchmark (off with ``--no-progress``)."""
    from tqdm.auto import tqdm

    disable = _NO_PROGRESS or bool(getattr(args, "no_progress", False))
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False)


def setup(args) -> None:
    global _NO_PROGRESS
    import torch

    torch.set_num_threads(args.threads)
    _NO_PROGRESS = bool(getattr(args, "no_progress", False))


def machine_info(dtype: torch.dtype | None = None) -> dict:
    import pyro
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyro": pyro.__version__,
        "dtype": str(dtype if dtype is not None else torch.get_default_dtype()),
        "device": "cpu",
        "load_average_at_write": load_average(),
    }
    try:
        import ot

        info["pot"] = ot.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def command() -> str:
    return " ".join(["python"] + sys.argv)


def timeit(fn, repeats: int = 5, warmup: int = 1) -> dict:
    """Median (and min/max) wall time of ``fn()`` in seconds over ``repeats`` runs after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats}


def timeit_interleaved(fns: dict, repeats: int = 5, warmup: int = 1, desc: str | None = None, args=None) -> dict:
    """Like :func:`timeit` for several functions, alternating them within each repeat.

    Interleaving spreads slow drifts of machine load (other processes) evenly over the
    contenders, so their ratios stay meaningful on a shared machine. With ``desc``, a
    :func:`progress` bar (``args`` as there) counts the rounds; it advances between timed calls,
    never inside one.
    """

    def rounds(n: int, what: str):
        return range(n) if desc is None else progress(range(n), f"{desc} ({what})", args)

    for _ in rounds(warmup, "warm-up"):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in rounds(repeats, "repeats"):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "repeats": repeats}
        for name, ts in times.items()
    }


def rotated_step_timing(steps: dict, rounds: int, warmup: int, baseline: str, round_args=None, n_params: dict | None = None) -> dict:
    """Times one call of every ``steps[name](*round_args())`` per round, the order rotated by one each round.

    For SVI steps of several guides: alternating them step by step spreads drifts of machine load
    evenly over them, so their ratios to ``baseline`` stay meaningful on a shared machine.
    ``round_args`` (optional) draws the arguments of a round, shared by every contender (e.g. one
    minibatch). The first ``warmup`` rounds are not timed. ``n_params`` (optional) is stored per guide.

    Returns:
        ``{"rounds", "warmup_steps", "guides": {name: {step_s_median, step_s_q25, step_s_q75,
        ratio_vs_autonormal, paired_ratio_median, finite[, n_params]}}, "wall_s",
        "load_average_before", "load_average_after"}``, the ratios taken to ``baseline`` (the key
        keeps its historical name).
    """
    names = list(steps)
    times = {g: [] for g in names}
    finite = {g: True for g in names}
    load_before = load_average()
    t_start = time.perf_counter()
    for r in range(warmup + rounds):
        args = round_args() if round_args is not None else ()
        k = r % len(names)
        for g in names[k:] + names[:k]:
            t0 = time.perf_counter()
            loss = steps[g](*args)
            dt = time.perf_counter() - t0
            finite[g] = finite[g] and bool(math.isfinite(loss))
            if r >= warmup:
                times[g].append(dt)
    wall = time.perf_counter() - t_start
    base = statistics.median(times[baseline])
    guides = {}
    for g in names:
        ts = times[g]
        q1, _, q3 = statistics.quantiles(ts, n=4)
        guides[g] = {
            "step_s_median": statistics.median(ts), "step_s_q25": q1, "step_s_q75": q3,
            "ratio_vs_autonormal": statistics.median(ts) / base,
            "paired_ratio_median": statistics.median(t / b for t, b in zip(ts, times[baseline])),
            "finite": finite[g],
        }
        if n_params is not None:
            guides[g]["n_params"] = n_params[g]
    return {"rounds": rounds, "warmup_steps": warmup, "guides": guides, "wall_s": wall, "load_average_before": load_before,
            "load_average_after": load_average()}


def print_rotated_timing(timing: dict, title: str, block: dict | None = None) -> None:
    """Table of a :func:`rotated_step_timing` result (with ``n_params`` added per guide).

    ``block`` (optional) maps each guide to its block-timing cells ``(ms / step, ratio)``, shown for
    reference beside the interleaved numbers.
    """
    rows = []
    for g, t in timing["guides"].items():
        row = [g, f"{1e3 * t['step_s_median']:.2f}", f"{1e3 * t['step_s_q25']:.2f} - {1e3 * t['step_s_q75']:.2f}",
               f"{t['ratio_vs_autonormal']:.2f}", f"{t['paired_ratio_median']:.2f}"]
        rows.append(row + (list(block[g]) if block is not None else []) + [t["n_params"]])
    headers = ["guide", "interleaved ms / step", "IQR", "x AutoNormal", "paired x AN"]
    if block is not None:
        headers += ["block ms / step", "block x AN"]
    la = [f"{v[0]:.2f}" if v else "?" for v in (timing["load_average_before"], timing["load_average_after"])]
    print_table(headers + ["# var. params"], rows,
                title=f"{title}: interleaved timing, {timing['rounds']} rounds after {timing['warmup_steps']} warm-up steps "
                      f"({timing['wall_s']:.0f} s; 1-min load average {la[0]} -> {la[1]})")


def merge_timing(path: Path, timing: dict, compute_goals, new: dict, summary=None, label: str | None = None, run: str | None = None) -> dict:
    """Puts a fresh interleaved ``timing`` (and the goals recomputed from the stored ``"summary"``)
    into the result file ``path``, created from ``new`` if missing; returns the (run's) content.
    With ``summary`` (as in :func:`write_results`) the summary record is recomputed too, since the
    table's time ratios come from ``timing``. With ``run``, the timing goes into that run of a
    file holding several (:func:`write_results`)."""
    whole = json.loads(path.read_text()) if path.exists() else None
    if run is None:
        data = whole if whole is not None else dict(new)
    else:
        whole = whole if whole is not None and "runs" in whole else {"benchmark": path.stem, "runs": {}}
        data = whole["runs"].setdefault(run, dict(new))
    data["timing_interleaved"] = dict(timing, machine=machine_info())
    data["goals"] = compute_goals(data.get("summary"), timing)
    if summary is not None:
        data[SUMMARY_KEY] = summary_record(result_stem(path), data, summary, label=label)
    if run is not None:
        whole[SUMMARY_KEY] = combine_records([r[SUMMARY_KEY] for r in whole["runs"].values() if SUMMARY_KEY in r])
        out = whole
    else:
        out = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    return data


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:  # pragma: no cover
        return None


def write_results(name: str, payload: dict, dtype: torch.dtype | None = None, summary=None, label: str | None = None,
                  run: str | None = None, scratch: bool = False) -> Path:
    """Writes ``results/<group>/<name>.json`` (:func:`result_path`; a scratch file under ``--quick``):
    the run's command and machine, then ``payload``, then (given ``summary``, the script's
    ``data -> cells`` function) its :func:`summary_record` under :data:`SUMMARY_KEY`, computed from
    exactly what is written.

    A script whose modes each make a row of the table (the MLP and the conv net of the digits BNN)
    passes ``run`` (and ``label``): the file then holds ``{"benchmark", "runs": {run: content}}``,
    this call replacing only its own run, and its summary record joins the runs' records
    (:func:`combine_records`). ``scratch`` sends a diagnostic mode that no document cites to the
    scratch folder, as ``--quick`` does."""
    path = result_path(name, quick=True if scratch else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": name, "command": command(), "machine": machine_info(dtype), **payload}
    if summary is not None:
        out[SUMMARY_KEY] = summary_record(result_stem(path), out, summary, label=label)
    if run is not None:
        whole = json.loads(path.read_text()) if path.exists() else {}
        if "runs" not in whole:
            whole = {"benchmark": name, "runs": {}}
        whole["runs"][run] = out
        whole[SUMMARY_KEY] = combine_records([r[SUMMARY_KEY] for r in whole["runs"].values() if SUMMARY_KEY in r])
        out = whole
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(f"\nwrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return f"{value:.2e}"
    return str(value)


# --------------------------------------------------------------------------------------------------
# The summary record: one row of the table in benchmarks/README.md, stored in every result file so
# that summarize.py needs no knowledge of any script's layout. Each script turns its own numbers into
# the row's cells (its ``summary_cells(data)``), right where it writes them.

SUMMARY_KEY = "summary_record"
SUMMARY_SCHEMA = 1
SUMMARY_CELLS = ("ours", "anchor", "comparison", "goal", "met", "run")


def summary_record(stem: str, data: dict, cells, label: str | None = None, script: str | None = None) -> dict:
    """The summary record of the result file ``results/<stem>.json`` whose content is ``data``.

    Args:
        stem: the file's path below ``results/`` without ``.json`` (``"kronecker/bnn_digits"``).
        data: the whole JSON object written to that file (the run cell reads its ``command``,
            date, ``git_head``, ``device`` and ``finished``).
        cells: ``data -> {"ours", "anchor", "comparison", "goal", "met"}`` (strings; ``ours`` is the
            table's "ours (latest)" cell), or such a dict. When the function raises, the record
            says ``unreadable (...)`` instead: a summary must never cost a finished run its file.
        label: prefix of this file's cells when a script writes several main files (``"MLP"``).
        script: the script that wrote it; by default the running one (``sys.argv[0]``).

    Returns:
        ``{"schema", "script", "label", "ours", "anchor", "comparison", "goal", "met", "run"}``,
        every cell a string (empty for none), accepted by :func:`check_record`.

    Example:
        >>> rec = summary_record("x", {"command": "python x.py"}, {"ours": "1 s", "anchor": "2 s",
        ...                      "comparison": "0.50x", "goal": "<= 1x", "met": "yes"}, script="bench_x.py")
        >>> rec["run"], check_record(rec)
        ('`results/x.json`; `python x.py`', [])
    """
    try:
        got = cells(data) if callable(cells) else dict(cells)
    except Exception as error:  # noqa: BLE001 - a layout the function did not expect must not stop the write
        got = {"ours": f"unreadable ({type(error).__name__}: {short_error(error)})"}
    record = {"schema": SUMMARY_SCHEMA, "script": script or Path(sys.argv[0]).name, "label": label}
    record.update({c: str(got.get(c, "")) for c in SUMMARY_CELLS[:-1]})
    record["run"] = run_cell(data, stem)
    return record


def check_record(record) -> list[str]:
    """What is wrong with a summary record (an empty list when it is valid)."""
    if not isinstance(record, dict):
        return [f"not an object but {type(record).__name__}"]
    problems = [] if record.get("schema") == SUMMARY_SCHEMA else [f"schema {record.get('schema')!r}, expected {SUMMARY_SCHEMA}"]
    script = record.get("script")
    if not (isinstance(script, str) and script.endswith(".py") and "/" not in script):
        problems.append(f"script {script!r} is not a file name ending in .py")
    if record.get("label") is not None and not isinstance(record["label"], str):
        problems.append("label is neither null nor a string")
    problems += [f"cell {c!r} is not a string" for c in SUMMARY_CELLS if not isinstance(record.get(c), str)]
    if isinstance(record.get("ours"), str) and not record["ours"]:
        problems.append("cell 'ours' is empty")
    return problems


def combine_records(records: list[dict]) -> dict:
    """One record for a file holding several runs: each cell joins the runs' cells, ``label: cell``,
    with ``<br>`` (one record is returned as it is)."""
    if len(records) == 1:
        return records[0]
    out = {"schema": SUMMARY_SCHEMA, "script": records[0]["script"], "label": None}
    for c in SUMMARY_CELLS:
        out[c] = "<br>".join(f"{r.get('label') or '?'}: {r[c]}" for r in records if r.get(c))
    return out


def run_cell(data: dict, stem: str) -> str:
    """Which file and run the numbers come from: file, command, date, git commit, device, unfinished."""
    bits = [f"`results/{stem}.json`"]
    if data.get("command"):
        bits.append(f"`{data['command']}`")
    for key in ("date", "timestamp", "started", "finished_at", "time_utc"):
        if data.get(key):
            bits.append(f"{key} {data[key]}")
            break
    if data.get("git_head"):
        bits.append(f"git {str(data['git_head'])[:7]}")
    if data.get("device") and data.get("device") != "cpu":
        bits.append(f"device {data['device']}")
    if data.get("finished") is False:
        bits.append("**unfinished**")
    return "; ".join(bits)


def short_error(error: Exception) -> str:
    text = str(error).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


# Formatting of the cells, shared so that every row reads alike.


def num(x) -> float:
    """A float from a number or from a ``[mean, sd]`` / ``[mean, se]`` pair."""
    if isinstance(x, (list, tuple)):
        x = x[0]
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {type(x).__name__}")
    return float(x)


def g3(x) -> str:
    """Three significant digits."""
    return f"{num(x):.3g}"


def f2(x) -> str:
    return f"{num(x):.2f}"


def f3(x) -> str:
    return f"{num(x):.3f}"


def f4(x) -> str:
    return f"{num(x):.4f}"


def ratio(x) -> str:
    """A speed or cost ratio with the digits that matter at its size (``637x``, ``12.3x``, ``0.67x``)."""
    x = num(x)
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def yn(ok: bool) -> str:
    """``yes`` or a bold ``**no**``, so that a missed goal stands out in the table."""
    return "yes" if ok else "**no**"


def met_summary(parts: dict[str, bool]) -> str:
    """``yes`` when every part holds, ``**no**`` when none does, else ``partly (...)``."""
    if all(parts.values()):
        return "yes"
    if not any(parts.values()):
        return "**no**"
    return "partly (" + "; ".join(f"{k}: {yn(v)}" for k, v in parts.items()) + ")"


def plural(n, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def slash(values, fmt=f3) -> str:
    return " / ".join(fmt(v) for v in values)


_METRIC = re.compile(r"rmse|mse|mae|nll|elbo|error|kl", re.I)
_OURS = re.compile(r"^vf|variational|ours|online", re.I)


def generic_cells(d: dict) -> dict:
    """Cells for a result file with a method -> metrics table and no bespoke summary: per-method
    metrics from ``mean_over_seeds``, ``summary`` or ``results`` (method -> {metric: number}), ours =
    methods named ``vf*`` / ``*variational*`` (else the first), compared on the first metric."""
    table = None
    for key in ("mean_over_seeds", "summary", "results"):
        t = d.get(key)
        if isinstance(t, dict) and t and all(isinstance(v, dict) for v in t.values()):
            table = t
            break
    if table is None:
        raise ValueError("no method -> metrics table in mean_over_seeds / summary / results")

    def metrics(v: dict) -> dict:
        out = {}
        for k, x in v.items():
            if _METRIC.search(k) and not k.endswith(("_se", "_sd", "_std")):
                try:
                    out[k] = num(x)
                except TypeError:
                    continue
        return out

    mets = {m: metrics(v) for m, v in table.items()}
    mets = {m: v for m, v in mets.items() if v}
    if not mets:
        raise ValueError("no rmse / mae / nll / elbo metrics per method")
    ours = [m for m in mets if _OURS.search(m)] or [next(iter(mets))]
    others = [m for m in mets if m not in ours]
    key = next(iter(mets[ours[0]]))
    show = lambda ms: "; ".join(f"{m} " + ", ".join(f"{k} {g3(x)}" for k, x in list(mets[m].items())[:3]) for m in ms)  # noqa: E731
    comp = ""
    common = [m for m in others if key in mets[m] and mets[m][key] != 0 and math.isfinite(mets[m][key])]
    if common:
        best = min(common, key=lambda m: mets[m][key])
        comp = f"{key}: {ours[0]} / {best} (best anchor) {f2(mets[ours[0]][key] / mets[best][key])}"
    goal = d.get("goal")
    if isinstance(goal, dict):
        goal_text = str(goal.get("text") or goal.get("description") or goal.get("goal") or ", ".join(f"{k}" for k in goal if k != "met"))
        met = yn(bool(goal["met"])) if "met" in goal else "n/a"
    else:
        goal_text, met = (str(goal), "n/a") if goal else ("none stored", "n/a")
    if d.get("finished") is False:
        met += " (run unfinished)"
    return {"ours": show(ours), "anchor": show(others) or "none found", "comparison": comp or "n/a", "goal": goal_text, "met": met}


class BootstrapGuide:
    """``pyro.infer.SMCFilter`` needs a guide: this one proposes ``x_t`` from a Gaussian transition
    ``N(transition_mean(x_{t-1}), scale^2 I)`` (``N(0, init_scale^2 I)`` at ``t = 0``) under the
    model's site names ``x_t``, i.e. the bootstrap filter."""

    def __init__(self, transition_mean, scale: float, dim: int, init_scale: float = 1.0):
        self.transition_mean, self.scale, self.dim, self.init_scale = transition_mean, scale, dim, init_scale
        self._t = 0

    def init(self, state):
        self._t = 0

    def step(self, state, y=None):
        import pyro
        import pyro.distributions as dist
        import torch

        t = self._t
        if "x" in state:
            proposal = dist.Normal(self.transition_mean(state["x"]), self.scale).to_event(1)
        else:
            proposal = dist.Normal(torch.zeros(self.dim), self.init_scale).to_event(1)
        pyro.sample(f"x_{t}", proposal)
        self._t = t + 1
