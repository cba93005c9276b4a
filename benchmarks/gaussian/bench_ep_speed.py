"""Time per time slice of EP-GPADS and EP-GPEKS at motion-capture size (Deisenroth and Mohamed 2012, section 4.3).

The paper's golf-swing model: a 3-d latent state, 56 observed dimensions, GPs trained on 403
points (transition GP 3 -> 3, observation GP 3 -> 56). It reports "less than 0.5 s" per time
slice for EP-GPEKS and "about 20 s" for EP-GPADS (MATLAB, 2012 hardware). The CMU data are not
available offline, so this benchmark uses synthetic training data of the same sizes:
inputs X ~ N(0, I_3) (403 x 3), transition targets 0.9 x + 0.3 sin(x A), observation targets
tanh(x W1) W2 (56 outputs), plus N(0, 0.05^2) noise; fixed hyperparameters (signal variance 1,
noise 0.01; fitting values would not change the cost per slice). Q = 0.01 I, R = 0.01 I,
x_1 ~ N(0, I); observations simulated from the GP model, T = 10.

Two lengthscale layouts, because the exact moments group outputs with equal lengthscales (one
n x n exponential per pair of groups): ``shared`` (1.5 for every output and input, as when one
kernel serves all outputs, e.g. the GPDM's observation mapping) and ``distinct`` (every output its
own ARD lengthscales, drawn uniformly from [1, 2]: separately fitted GPs, the worst case,
E (E + 1) / 2 = 1596 exponentials per measurement projection).

One "time slice" is what EP does per t in a sweep: the forward message (transition moments),
the measurement message (56-output moments) and the backward message (transition moments).
Timed: ``EPSmoother(ssm, projection, max_iter=2, tol=1e-12).smooth(ys)`` (the plain first sweep
and one EP sweep), divided by 2 T; median of ``--repeats`` after one warm-up, float64,
1 thread by default. Goal: >= 20x faster than the paper, aim 100x.

Run: ``python benchmarks/gaussian/bench_ep_speed.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, g3, print_table, ratio, setup, timeit_interleaved, write_results, yn
from pyro_smc import EPSmoother
from pyro_smc.gp import MultiOutputGP
from pyro_smc.models import NonlinearGaussianSSM

PAPER_SECONDS_PER_SLICE = {"EP-GPADS (moment_matching)": 20.0, "EP-GPEKS (linearization)": 0.5}


def make_model(latent: int, outputs: int, num_train: int, lengthscales: str = "shared", seed: int = 0) -> NonlinearGaussianSSM:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    X = torch.randn(num_train, latent, generator=gen, dtype=f64)
    A = torch.randn(latent, latent, generator=gen, dtype=f64) / math.sqrt(latent)
    W1 = torch.randn(latent, 20, generator=gen, dtype=f64)
    W2 = torch.randn(20, outputs, generator=gen, dtype=f64) / math.sqrt(20)
    Y_f = 0.9 * X + 0.3 * torch.sin(X @ A) + 0.05 * torch.randn(num_train, latent, generator=gen, dtype=f64)
    Y_g = torch.tanh(X @ W1) @ W2 + 0.05 * torch.randn(num_train, outputs, generator=gen, dtype=f64)
    if lengthscales == "shared":
        ell_f, ell_g = 1.5, 1.5
    else:
        ell_f = 1 + torch.rand(latent, latent, generator=gen, dtype=f64)
        ell_g = 1 + torch.rand(outputs, latent, generator=gen, dtype=f64)
    gp_f = MultiOutputGP(X, Y_f, lengthscale=ell_f, variance=1.0, noise=0.01)
    gp_g = MultiOutputGP(X, Y_g, lengthscale=ell_g, variance=1.0, noise=0.01)
    eye_d, eye_e = torch.eye(latent, dtype=f64), torch.eye(outputs, dtype=f64)
    return NonlinearGaussianSSM(gp_f, 0.01 * eye_d, gp_g, 0.01 * eye_e, torch.zeros(latent, dtype=f64), eye_d)


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows seconds per time slice against the paper's.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    res = d["results"]

    def label(name: str) -> str:
        m = re.match(r"(EP-\w+).*?(shared|distinct)", name)
        return f"{m.group(1)} {m.group(2)}" if m else name

    speed = {label(k): v["speedup_over_paper"] for k, v in res.items()}
    papers = {}
    for k, v in res.items():
        papers.setdefault(label(k).split()[0], v["paper_seconds_per_slice"])
    return {
        "ours": "s per time slice: " + ", ".join(f"{label(k)} {g3(v['seconds_per_slice'])}" for k, v in res.items()),
        "anchor": "Deisenroth and Mohamed (2012): " + ", ".join(f"{k} {g3(v)} s" for k, v in papers.items()),
        "comparison": "speed-up " + ", ".join(f"{k} {ratio(v)}" for k, v in speed.items()),
        "goal": d.get("goal", "speed-up over the paper >= 20, aim 100"),
        "met": f"{yn(min(speed.values()) >= 20)} (min {ratio(min(speed.values()))}); aim 100x: {sum(v >= 100 for v in speed.values())}/{len(speed)}",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="time slices T")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    latent, outputs, num_train = (3, 8, 50) if args.quick else (3, 56, 403)
    T, repeats, sweeps = (3, 1, 2) if args.quick else (args.steps, args.repeats, 2)

    contenders = {}
    for layout in ("shared", "distinct"):
        ssm = make_model(latent, outputs, num_train, layout)
        _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(1))
        for name, projection in (("EP-GPADS (moment_matching)", "moment_matching"), ("EP-GPEKS (linearization)", "linearization")):
            contenders[name, layout] = (lambda ssm=ssm, ys=ys, projection=projection:
                                        EPSmoother(ssm, projection, max_iter=sweeps, tol=1e-12).smooth(ys))
    timings = timeit_interleaved(contenders, repeats=repeats, warmup=1, desc="rounds", args=args)
    rows, records = [], {}
    for (name, layout), rec in timings.items():
        per_slice = rec["median_s"] / (sweeps * T)
        paper = PAPER_SECONDS_PER_SLICE[name]
        records[f"{name}, {layout} lengthscales"] = {**rec, "seconds_per_slice": per_slice, "paper_seconds_per_slice": paper, "speedup_over_paper": paper / per_slice}
        rows.append([name, layout, rec["median_s"], per_slice, paper, paper / per_slice])
    print_table(
        ["method", "lengthscales", f"s per call ({sweeps} sweeps x {T})", "s per slice", "paper s per slice", "speed-up"],
        rows,
        title=f"EP per time slice: latent {latent}, {outputs} outputs, {num_train} GP training points, float64, "
        f"{torch.get_num_threads()} thread(s), median of {repeats}",
    )
    print("goal: speed-up >= 20, aim 100")
    write_results(
        "bench_ep_speed",
        {
            "settings": {"latent_dim": latent, "obs_dim": outputs, "num_train": num_train, "T": T, "sweeps": sweeps, "repeats": repeats,
                         "hyperparameters": "variance 1, noise 0.01; lengthscales 1.5 (shared) or U[1, 2] per output and input (distinct)",
                         "data": "synthetic"},
            "goal": "speed-up over the paper >= 20, aim 100",
            "results": records,
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
