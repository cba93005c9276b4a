"""Shared helpers for the benchmark scripts: timing, machine info, result files.

Not a benchmark itself. Every script in this folder imports it as ``_common`` (the folder is
``sys.path[0]`` when a script is run as ``python benchmarks/<name>.py``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


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
    torch.set_num_threads(args.threads)
    _NO_PROGRESS = bool(getattr(args, "no_progress", False))


def machine_info(dtype: torch.dtype | None = None) -> dict:
    import pyro

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


def merge_timing(path: Path, timing: dict, compute_goals, new: dict) -> dict:
    """Puts a fresh interleaved ``timing`` (and the goals recomputed from the stored ``"summary"``)
    into the result file ``path``, created from ``new`` if missing; returns the file's content."""
    data = json.loads(path.read_text()) if path.exists() else dict(new)
    data["timing_interleaved"] = dict(timing, machine=machine_info())
    data["goals"] = compute_goals(data.get("summary"), timing)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return data


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:  # pragma: no cover
        return None


def write_results(name: str, payload: dict, dtype: torch.dtype | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    if "--quick" in sys.argv:
        name = f"{name}.quick"  # smoke runs never overwrite the full results
    out = {"benchmark": name, "command": command(), "machine": machine_info(dtype), **payload}
    path = RESULTS / f"{name}.json"
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

        t = self._t
        if "x" in state:
            proposal = dist.Normal(self.transition_mean(state["x"]), self.scale).to_event(1)
        else:
            proposal = dist.Normal(torch.zeros(self.dim), self.init_scale).to_event(1)
        pyro.sample(f"x_{t}", proposal)
        self._t = t + 1
