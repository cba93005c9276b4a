"""Figures of the committed benchmark results, for ``docs/benchmarks.md``.

Reads the JSON files that the benchmark scripts wrote under ``benchmarks/results/<group>/`` (it
runs no benchmark and imports neither torch nor ``pyro_smc``) and writes one PNG per figure:

* ``smc_speed.png``: ``pyro_smc.SMC`` against ``pyro.infer.SMCFilter`` and ``particles``;
* ``resampling_cost.png``: batched Sinkhorn against POT, OT resampling against systematic;
* ``ot_gradients.png``: gradient error against the exact (Kalman) score, per resampler;
* ``ep_accuracy.png``: Gaussian smoothers and EP on the book pendulum and the growth model;
* ``deep_ssm.png``: held-out log-evidence while learning a deep state-space model;
* ``kronecker_digits.png``: test NLL and ECE of Bayesian neural networks on digits;
* ``online_flat_cost.png``: time and memory per step of the online filter over t.

Every plotted number is read from a result file; reference numbers (a book's, a paper's) are
plotted only where the benchmark stored them in its file.

Run (from any directory)::

    python benchmarks/plot_results.py                      # writes docs/figures/benchmarks/
    python benchmarks/plot_results.py --out /tmp/figures   # elsewhere
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_OUT = HERE.parent / "docs" / "figures" / "benchmarks"
WIDTH = 7.0  # inches: the content column of the docs page
DPI = 100
COLORS = plt.get_cmap("tab10").colors
STYLE = {
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
}


def load(results: Path, group: str, name: str) -> dict:
    """The parsed result file ``results/<group>/<name>.json``."""
    return json.loads((results / group / f"{name}.json").read_text())


def goal_bound(goal: str) -> float:
    """The number after ``<=`` in a stored goal sentence ("ratio ... <= 3" gives 3.0)."""
    match = re.search(r"<=\s*([0-9.]+)", goal)
    if match is None:
        raise ValueError(f"no '<= number' in the goal {goal!r}")
    return float(match.group(1))


def plain_log_ticks(ax: Axes, which: str = "y") -> None:
    """Ticks at 1, 2, 5 x 10^k on a log axis, written as plain numbers (0.5, 2, 10)."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def new_figure(height: float, ncols: int = 1, **kwargs) -> tuple[Figure, np.ndarray]:
    """A figure of the page's width with ``ncols`` axes in one row."""
    fig, axes = plt.subplots(1, ncols, figsize=(WIDTH, height), layout="constrained", **kwargs)
    return fig, np.atleast_1d(axes)


def fig_smc_speed(results: Path) -> Figure:
    """(a) forward ms per step against ``SMCFilter``; (b) time ratio to ``particles`` against N."""
    smcfilter = load(results, "smc", "bench_smcfilter")
    chopin = load(results, "smc", "particles_speed")
    fig, (ax, bx) = new_figure(3.4, 2)

    rows = sorted(smcfilter["results"], key=lambda r: r["num_particles"])
    series = [
        ("smcfilter", "pyro.infer.SMCFilter", None),
        ("ours_guide", "SMC, same guide", "ratio_ours_guide_over_smcfilter"),
        ("ours_bootstrap", "SMC, guide=None", "ratio_ours_bootstrap_over_smcfilter"),
    ]
    x = np.arange(len(rows))
    width = 0.27
    for k, (key, label, ratio) in enumerate(series):
        pos = x + (k - 1) * width
        med = np.array([r[f"{key}_ms_per_step"] for r in rows])
        lo = np.array([1e3 * r["timings"][key]["min_s"] / r["T"] for r in rows])
        hi = np.array([1e3 * r["timings"][key]["max_s"] / r["T"] for r in rows])
        ax.bar(pos, med, width, color=COLORS[k], label=label, zorder=2)
        ax.errorbar(pos, med, yerr=[med - lo, hi - med], fmt="none", ecolor="0.25", lw=0.8,
                    zorder=3)
        if ratio is not None:
            for p, r, top in zip(pos, rows, hi):
                ax.text(p, top, f"{r[ratio]:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"N = {r['num_particles']}" for r in rows])
    ax.set_ylabel("forward time per step (ms)\nmedian, bar: min to max")
    ax.set_title(f"vs SMCFilter: linear-Gaussian, T = {rows[0]['T']}")
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])
    ax.legend(loc="upper left", frameon=False)
    ax.grid(axis="x", visible=False)

    horizon = chopin["settings"]["horizons"][0]
    single = sorted((r for r in chopin["single"] if r["T"] == horizon), key=lambda r: r["N"])
    ns = [r["N"] for r in single]
    lines = [
        ("SMC, one filter", [r["ratio"] for r in single]),
        ("SMC, validation off", [r["ratio_noval"] for r in single]),
        ("SMC, compiled step", [r["ratio_compiled"] for r in single]),
        ("SMC, compiled, recording kept (SVI)", [r["ratio_kept"] for r in single]),
        ("hand-written torch loop", [r["floor_ms"] / r["particles_ms"] for r in single]),
    ]
    for k, (label, ratios) in enumerate(lines):
        style = ":" if label.startswith("hand") else "-"
        bx.plot(ns, ratios, style, marker="o", ms=4, color=COLORS[k], label=label)
    for k, row in enumerate(r for r in chopin["batched"] if r["T"] == horizon):
        bx.plot(row["N"], row["ratio_per_filter"], marker="sv"[k % 2], ls="none", ms=6,
                color=COLORS[5 + k])
        bx.annotate(f"{row['B']} filters in one run", (row["N"], row["ratio_per_filter"]),
                    xytext=(7, 0), textcoords="offset points", ha="left", va="center",
                    fontsize=7, color=COLORS[5 + k])
    bx.axhline(1.0, color="0.2", lw=0.8, ls="--", label="particles (parity)")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_ylim(0.08, None)
    plain_log_ticks(bx)
    bx.set_xlabel("particles N")
    bx.set_ylabel("time per filter / particles' time")
    bx.set_title(f"vs particles: stochastic volatility, T = {horizon}")
    bx.legend(loc="lower left", frameon=False, fontsize=7)
    return fig


def fig_resampling_cost(results: Path) -> Figure:
    """(a) Sinkhorn solve time against N, ours and POT; (b) OT filter cost over systematic."""
    sinkhorn = load(results, "resampling", "bench_sinkhorn")
    ot_cost = load(results, "resampling", "bench_ot_cost")
    fig, (ax, bx) = new_figure(3.4, 2)

    solved = [r for r in sinkhorn["results"] if "skipped" not in r and r["B"] == 1]
    for k, eps in enumerate(sorted({r["epsilon"] for r in solved}, reverse=True)):
        rows = sorted((r for r in solved if r["epsilon"] == eps), key=lambda r: r["N"])
        ns = [r["N"] for r in rows]
        ax.plot(ns, [1e3 * r["ours_s"] for r in rows], "-o", ms=4, color=COLORS[k],
                label=f"ours, ε = {eps:g}")
        ax.plot(ns, [1e3 * r["pot_s"] for r in rows], "--s", ms=4, color=COLORS[k], mfc="white",
                label=f"POT, ε = {eps:g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("particles N (one N x N problem)")
    ax.set_ylabel("solve time (ms)")
    ax.set_title("Sinkhorn at equal marginal error")
    ax.legend(frameon=False, loc="upper left")

    variants = [
        ("ot_implicit_scaling0.75", "implicit\n(default)"),
        ("ot_implicit_scaling0", "implicit,\nscaling 0"),
        ("ot_last_step_scaling0.75", "last_step"),
        ("ot_unroll_scaling0.75", "unroll"),
    ]
    runs = ot_cost["runs"]
    x = np.arange(len(variants))
    width = 0.38
    for k, (dtype, run) in enumerate(runs.items()):
        ratios = [run["results"][key]["ratio_over_systematic"] for key, _ in variants]
        pos = x + (k - 0.5) * width
        bx.bar(pos, ratios, width, color=COLORS[2 + k], label=dtype, zorder=2)
        for p, r in zip(pos, ratios):
            bx.text(p, r, f"{r:.1f}", ha="center", va="bottom", fontsize=7)
    bounds = {goal_bound(run["goal"]) for run in runs.values()}
    for bound in bounds:
        bx.axhline(bound, color="firebrick", lw=1, ls="--", zorder=1, label=f"goal (<= {bound:g}x)")
    bx.axhline(1.0, color="0.2", lw=0.8, zorder=1, label="systematic")
    settings = next(iter(runs.values()))["settings"]
    bx.set_yscale("log")
    plain_log_ticks(bx)
    bx.set_ylim(0.8, 4 * max(r["results"][key]["ratio_over_systematic"]
                               for r in runs.values() for key, _ in variants))
    bx.set_xticks(x, [label for _, label in variants])
    bx.set_ylabel("forward + backward time / systematic's")
    bx.set_title(f"OT filter: {settings['num_filters']} x {settings['num_particles']} particles, "
                 f"T = {settings['T']}")
    bx.legend(frameon=False, loc="upper left", ncol=2)
    bx.grid(axis="x", visible=False)
    return fig


def fig_ot_gradients(results: Path) -> Figure:
    """Median, 90% and 99% quantiles of the gradient error of each resampler, per setting."""
    data = load(results, "resampling", "bench_gradients")
    names = {"ot_implicit": "OT implicit", "ot_unroll": "OT unroll", "ot_last_step": "OT last_step",
             "soft": "soft", "systematic": "systematic"}
    models = {"ar1": "AR(1)", "paper": "2-d linear-Gaussian"}
    settings: dict[tuple[str, float], dict[str, dict]] = {}
    for cell in data["results"].values():
        settings.setdefault((cell["model"], cell["theta"]), {})[cell["dtype"]] = cell
    fig, axes = new_figure(3.3, len(settings))
    for ax, ((model, theta), by_dtype) in zip(axes, sorted(settings.items())):
        x = np.arange(len(names))
        for k, (dtype, cell) in enumerate(sorted(by_dtype.items())):
            pos = x + (k - 0.5) * 0.3
            stats = [cell["resamplers"][name] for name in names]
            med = [s["median_abs_error"] for s in stats]
            ax.vlines(pos, med, [s["q90_abs_error"] for s in stats], color=COLORS[k], lw=2)
            ax.plot(pos, [s["q99_abs_error"] for s in stats], "_", ms=7, mew=1.5, color=COLORS[k])
            ax.plot(pos, med, "o", ms=4.5, color=COLORS[k], label=f"{dtype}")
        ax.set_xticks(x, list(names.values()), rotation=40, ha="right", rotation_mode="anchor")
        ax.set_ylim(0, None)
        runs = next(iter(by_dtype.values()))["resamplers"]["ot_implicit"]["runs"]
        ax.set_title(f"{models.get(model, model)}, θ = {theta:g}\n"
                     f"T = {next(iter(by_dtype.values()))['T']}, {runs} runs")
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel("|gradient − exact score|")
    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="0.3", lw=2, marker="_", ms=7, mew=1.5))
    labels.append("median (dot) to 90% (bar), 99% (tick)")
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    return fig


def fig_ep_accuracy(results: Path) -> Figure:
    """Pendulum angle RMSE against the book's; growth-model RMSE and NLL against Kamthe et al."""
    pendulum = load(results, "gaussian", "bench_ep_pendulum")
    growth = load(results, "gaussian", "bench_ep_growth")
    fig = plt.figure(figsize=(WIDTH, 6.2), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.1, 1], hspace=0.04)
    ax = top.subplots()

    methods = list(pendulum["book_data"])
    y = np.arange(len(methods))[::-1]
    ours = [pendulum["book_data"][m]["rmse"] for m in methods]
    ax.barh(y, ours, 0.6, color=COLORS[0], label="ours, book's data", zorder=2)
    book = pendulum["anchors_book"]
    ref = [(yy, book[m]) for yy, m in zip(y, methods) if m in book]
    ax.plot([v for _, v in ref], [yy for yy, _ in ref], "D", ms=6, color="black",
            label="book's number", zorder=4)
    sims = pendulum["simulated"].values()
    for k, (yy, m) in enumerate(zip(y, methods)):
        vals = [s[m]["rmse"] for s in sims if m in s]
        ax.plot(vals, np.full(len(vals), yy), "o", ms=3, color="0.55", zorder=3,
                label=f"ours, {len(vals)} simulations" if k == 0 else None)
    for name, value in book.items():
        if name not in methods:
            label = name.replace(" (book)", "")
            ax.axvline(value, color="black", ls=":", lw=1, zorder=1, label=f"book's {label}")
    ax.set_yticks(y, methods)
    ax.set_xlabel("angle RMSE (rad)")
    top.suptitle("Pendulum (Särkkä and Svensson): Gaussian smoothers and EP",
                 fontsize=STYLE["axes.titlesize"])
    ax.legend(loc="lower right", frameon=True, framealpha=0.9)
    ax.grid(axis="y", visible=False)

    cell = growth["results"]["anchor"]
    # (our key, tick label, key of the rerun of their code). The first column is the plain
    # smoother (its own row since power EP applies from the first sweep; files from before have
    # none, and their EP-1 was that smoother), marked by the rerun of their code's plain sweep.
    smoother = cell.get("_smoother_name", "EP-1")
    first = f"plain smoother\n({smoother})"
    columns = [(smoother, first, "anchor/EP-1 plain"), ("EP-10", "EP-10", "anchor/EP-10"),
               ("EP-50", "EP-50", "anchor/EP-50")]
    paper, rerun = growth["anchors_paper"], growth["anchors_reference_code_rerun"]
    seeds = len(growth["settings"]["seeds"])
    axes = bottom.subplots(1, 2)
    for j, (metric, label) in enumerate([("rmse", "RMSE of x"), ("nll", "NLL per step (nats)")]):
        bx = axes[j]
        x = np.arange(len(columns))
        bx.bar(x, [cell[c][f"{metric}_mean"] for c, _, _ in columns], 0.55, color=COLORS[1],
               yerr=[cell[c][f"{metric}_se"] for c, _, _ in columns], capsize=3, zorder=2,
               error_kw={"lw": 0.8}, label=f"ours ± s.e., {seeds} seeds")
        pub = [(i, paper[c][metric]) for i, (c, _, _) in enumerate(columns[1:], 1) if c in paper]
        bx.plot([i for i, _ in pub], [v for _, v in pub], "D", ms=6, color="black",
                label="Kamthe et al. (2022)", zorder=4)
        code = [(i, rerun[r][metric]) for i, (_, _, r) in enumerate(columns) if r in rerun]
        bx.plot([i + 0.18 for i, _ in code], [v for _, v in code], "^", ms=6, color="0.45",
                label="their code, rerun", zorder=4)
        bx.set_xticks(x, [tick for _, tick, _ in columns])
        bx.set_ylabel(label)
        bx.set_ylim(0, 1.35 * bx.get_ylim()[1])
        bx.grid(axis="x", visible=False)
        if j == 0:
            bx.legend(loc="upper right", frameon=False, fontsize=7)
    bottom.suptitle("Growth model (UNGM), setting of Kamthe et al.",
                    fontsize=STYLE["axes.titlesize"])
    return fig


def fig_deep_ssm(results: Path) -> Figure:
    """Held-out log Z per sequence along training, per gradient estimator (mean and seeds)."""
    data = load(results, "smc", "deep_ssm")
    fig, (ax,) = new_figure(3.4)
    names = {"ot": "OT", "soft": "soft", "systematic": "systematic",
             "stop_gradient": "stop-gradient"}
    for k, (key, label) in enumerate(names.items()):
        runs = [r for r in data["runs"] if r["estimator"] == key]
        steps = [p["step"] for p in runs[0]["curve"]]
        curves = np.array([[p["held_out"] for p in r["curve"]] for r in runs])
        for curve in curves:
            ax.plot(steps, curve, color=COLORS[k], lw=0.7, alpha=0.45)
        ax.plot(steps, curves.mean(0), color=COLORS[k], lw=2,
                label=f"{label}, mean of {len(runs)} seeds")
    ax.axhline(data["truth_held_out"], color="black", ls="--", lw=1, label="true model")
    ax.axhline(data["untrained_held_out"], color="0.5", ls=":", lw=1, label="untrained")
    ax.set_xlabel("SVI step")
    ax.set_ylabel("held-out log Z per sequence (nats)")
    s = data["settings"]
    fig.suptitle(f"NeuralSSM + NeuralProposal learnt on {s['train']} Van der Pol sequences, "
                 f"{s['particles']} particles", fontsize=STYLE["axes.titlesize"])
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", frameon=False)
    return fig


def fig_kronecker_digits(results: Path) -> Figure:
    """Test NLL and ECE of three guides, MLP and conv net, mean ± SD over seeds and each seed."""
    data = load(results, "kronecker", "bnn_digits")
    guides = ["AutoNormal", "K-Linear", "K-Nonlinear"]
    fig, axes = new_figure(3.2, 2)
    archs = {"mlp": "MLP", "conv": "conv net"}
    for ax, (metric, label) in zip(axes, [("test_nll", "test NLL (nats per image)"),
                                          ("ece", "expected calibration error")]):
        for a, arch in enumerate(archs):
            per_seed = data["runs"][arch]["per_seed"]
            for g, guide in enumerate(guides):
                vals = [r[metric] for r in per_seed[guide]]
                pos = a + (g - 1) * 0.25
                ax.plot(np.full(len(vals), pos + 0.06), vals, ".", ms=4, color=COLORS[g], alpha=0.6)
                ax.errorbar(pos, statistics.mean(vals), yerr=statistics.stdev(vals), fmt="o",
                            ms=5, capsize=3, color=COLORS[g], label=guide if a == 0 else None)
        ax.set_xticks(range(len(archs)), list(archs.values()))
        ax.set_xlim(-0.5, len(archs) - 0.5)
        ax.set_ylabel(label)
        ax.grid(axis="x", visible=False)
    seeds = data["runs"]["mlp"]["settings"]["seeds"]
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(guides), frameon=False)
    fig.suptitle(f"BNNs on digits: mean ± SD over {seeds} seeds (dots: each seed)",
                 fontsize=STYLE["axes.titlesize"])
    return fig


def fig_online_flat_cost(results: Path) -> Figure:
    """CPU time per step and reachable tensor memory at each checkpoint t, per method."""
    data = load(results, "online", "online_flat_cost")
    names = {"vf": "online filter", "vf+learn": "online filter, learning",
             "smc": "SMC (records history)", "smc+graph": "SMC, autograd graph kept",
             "SMCFilter": "pyro SMCFilter"}
    fig, (ax, bx) = new_figure(3.3, 2)
    for k, (key, label) in enumerate(names.items()):
        points = data["results"][key]["checkpoints"]
        ts = [p["t"] for p in points]
        # SMCFilter holds about as much memory as the learning filter: larger marker, drawn below.
        style = {"ls": "-" if key.startswith("vf") else "--", "marker": "osoxD"[k],
                 "ms": 8 if key == "SMCFilter" else 5, "mfc": "none", "color": COLORS[k],
                 "label": label, "zorder": 1 if key == "SMCFilter" else 2}
        ax.plot(ts, [1e3 * p["median_cpu_s"] for p in points], **style)
        bx.plot(ts, [p["reachable"]["bytes"] / 1024 for p in points], **style)
    for axis in (ax, bx):
        axis.set_xscale("log")
        axis.set_yscale("log")
        plain_log_ticks(axis)
        axis.set_xlabel("time step t")
    ax.set_ylabel("median CPU time per step (ms)")
    bx.set_ylabel("reachable tensor memory (KiB)")
    s = data["settings"]
    ax.set_title(f"time per step, d = {s['dim']}")
    bx.set_title("memory held by the filter")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    return fig


FIGURES: dict[str, Callable[[Path], Figure]] = {
    "smc_speed": fig_smc_speed,
    "resampling_cost": fig_resampling_cost,
    "ot_gradients": fig_ot_gradients,
    "ep_accuracy": fig_ep_accuracy,
    "deep_ssm": fig_deep_ssm,
    "kronecker_digits": fig_kronecker_digits,
    "online_flat_cost": fig_online_flat_cost,
}


def write_figures(out: Path, results: Path = RESULTS) -> list[Path]:
    """Draw every figure of ``FIGURES`` from ``results`` and save it as ``out/<name>.png``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with plt.rc_context(STYLE):
        for name, draw in FIGURES.items():
            fig = draw(results)
            path = out / f"{name}.png"
            fig.savefig(path, dpi=DPI, metadata={"Software": None})
            plt.close(fig)
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder of the PNG files (default: docs/figures/benchmarks)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of the result files (default: benchmarks/results)")
    args = parser.parse_args()
    for path in write_figures(args.out, args.results):
        print(f"{path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
