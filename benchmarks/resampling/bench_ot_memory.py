"""Memory and time of a chain of differentiable OT resampling steps: the kernel kept for the backward
pass against the kernel rebuilt there (issue 28).

The fused ensemble transform (``OTResampler(gradient="implicit")``) needs the ``(B, N, N)``
symmetric kernel in its backward pass. It keeps it only up to ``_SAVED_KERNEL_MAX_BYTES`` (8 MB)
and rebuilds larger ones from the solve's potentials, with the forward's and the rebuild's kernels
in per-thread buffers. The anchor is the previous behaviour, every kernel kept (the limit raised
past any size, the buffers capped at 32 MB as they were).

Workload: ``T`` chained steps ``y <- ensemble_solve(y + 0.5 z, log_w(y)).x_new`` on ``B`` clouds of
``N`` 2-d particles (``z`` standard normal, ``log_w`` a unit-variance Gaussian likelihood around a
random point), epsilon 0.5, ``max_iter=500``, then ``y.square().sum().backward()``: the
backward pass comes after every step, as in a filter. Each contender runs in its own process (peak
RSS is per process); reported: forward and backward seconds, growth of peak RSS over the process's
start, and the relative difference of the two gradients (same seed, same draws).

Goal: the rebuilt kernel's peak RSS does not grow with ``T`` and stays below the kept kernels';
time at most 1.1x the anchor's.

Run: ``python benchmarks/resampling/bench_ot_memory.py`` (``--quick``: one small size).
Results: ``results/resampling/bench_ot_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, print_table, ratio, setup, write_results, yn

CASES = [("float32", 8, 1000, 8), ("float64", 8, 1000, 8), ("float32", 8, 2000, 5), ("float32", 8, 2000, 10)]
QUICK_CASES = [("float32", 4, 1000, 3)]


def one_run(mode: str, dtype: str, b: int, n: int, t: int) -> dict:
    """One contender in this process: ``mode`` "kept" (the anchor) or "rebuilt" (the default)."""
    import pyro_smc.ops.ensemble as ensemble
    from pyro_smc.ops.sinkhorn import SinkhornSettings

    if mode == "kept":
        ensemble._SAVED_KERNEL_MAX_BYTES = 1 << 62
        ensemble._WORKSPACE_MAX_BYTES = 1 << 25
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, n, 2, generator=gen, dtype=dt, requires_grad=True)
    settings = SinkhornSettings(0.5, max_iter=500)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    y = x
    for _ in range(t):
        y = y + 0.5 * torch.randn(b, n, 2, generator=gen, dtype=dt)
        centre = torch.randn(b, 1, 2, generator=gen, dtype=dt)
        log_w = (-0.5 * (y - centre).square().sum(-1)).log_softmax(-1)
        y = ensemble.ensemble_solve(y, log_w, settings, plan=False).x_new
    mid = time.perf_counter()
    y.square().sum().backward()
    end = time.perf_counter()
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) / 1024  # kB -> MB (Linux)
    return {"forward_s": mid - start, "backward_s": end - mid, "peak_rss_growth_mb": growth, "grad": x.grad.flatten().tolist()}


def in_subprocess(mode: str, case: tuple, threads: int) -> dict:
    dtype, b, n, t = case
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, dtype, str(b), str(n), str(t), "--threads", str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``."""
    rows = d["results"]
    big = max(rows, key=lambda r: r["N"] * r["T"])
    return {
        "ours": "kernel rebuilt in the backward pass: "
        + "; ".join(f"{r['B']}x{r['N']} {r['dtype']} T={r['T']} {f2(r['rebuilt']['peak_rss_growth_mb'])} MB, "
                    f"{f2(r['rebuilt']['forward_s'] + r['rebuilt']['backward_s'])} s" for r in rows),
        "anchor": "every kernel kept: " + "; ".join(f"{f2(r['kept']['peak_rss_growth_mb'])} MB, {f2(r['kept']['forward_s'] + r['kept']['backward_s'])} s" for r in rows),
        "comparison": f"largest case: memory {ratio(big['memory_ratio'])}, time {ratio(big['time_ratio'])}",
        "goal": d["goal"],
        "met": yn(all(r["memory_ratio"] < 1 and r["time_ratio"] <= 1.1 for r in rows)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--child", nargs=5, metavar=("MODE", "DTYPE", "B", "N", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup(args)
    if args.child:
        mode, dtype, b, n, t = args.child
        print(json.dumps(one_run(mode, dtype, int(b), int(n), int(t))))
        return
    results, table = [], []
    for case in QUICK_CASES if args.quick else CASES:
        runs = {mode: in_subprocess(mode, case, args.threads) for mode in ("kept", "rebuilt")}
        g_kept, g_new = (torch.tensor(runs[m].pop("grad"), dtype=torch.float64) for m in ("kept", "rebuilt"))
        dtype, b, n, t = case
        rec = {
            "dtype": dtype, "B": b, "N": n, "T": t, **runs,
            "memory_ratio": runs["rebuilt"]["peak_rss_growth_mb"] / runs["kept"]["peak_rss_growth_mb"],
            "time_ratio": (runs["rebuilt"]["forward_s"] + runs["rebuilt"]["backward_s"]) / (runs["kept"]["forward_s"] + runs["kept"]["backward_s"]),
            "grad_rel_diff": float((g_new - g_kept).norm() / g_kept.norm()),
        }
        results.append(rec)
        table.append([f"{b} x {n}", dtype, t, runs["kept"]["forward_s"], runs["kept"]["backward_s"], runs["kept"]["peak_rss_growth_mb"],
                      runs["rebuilt"]["forward_s"], runs["rebuilt"]["backward_s"], runs["rebuilt"]["peak_rss_growth_mb"],
                      rec["time_ratio"], rec["memory_ratio"], rec["grad_rel_diff"]])
    print_table(["B x N", "dtype", "T", "kept fwd s", "kept bwd s", "kept MB", "rebuilt fwd s", "rebuilt bwd s", "rebuilt MB",
                 "time ratio", "memory ratio", "grad rel diff"], table,
                title="Chained OT steps, forward then backward: kernel kept (anchor) vs rebuilt (default)")
    goal = "rebuilt: peak RSS below the kept kernels' and not growing with T; time <= 1.1x"
    write_results("bench_ot_memory", {"settings": {"epsilon": 0.5, "max_iter": 500, "cases": [list(c) for c in (QUICK_CASES if args.quick else CASES)]},
                                      "goal": goal, "results": results}, summary=summary_cells)


if __name__ == "__main__":
    main()
