"""Bayesian neural networks on sklearn's 8x8 digits: Kronecker-flow guides against mean-field and low rank.

Data: ``sklearn.datasets.load_digits`` (1797 images, 64 features); a fixed random split per seed,
1297 train / 500 test. MLP: every feature standardised with the training split's mean and sd.
Conv net: the images (1 x 8 x 8) standardised with one mean and sd over all training pixels, which
keeps the spatial structure that shared filters rely on.
Models (``--arch``), ``PyroModule`` s whose weights have ``Normal(0, 1)`` priors and whose biases
are ``Normal(0, 1)`` vectors:

* ``mlp``: MLP 64-50-10 (tanh), weights ``PyroSample(Normal(0, 1).expand([out, in]).to_event(2))``;
* ``conv``: conv 3x3, 8 channels, pad 1, tanh, 2x2 average pool (8 x 4 x 4); conv 3x3, 16 channels,
  pad 1, tanh, 2x2 average pool (16 x 2 x 2 = 64); linear 64-10. Kernels are
  ``PyroSample(Normal(0, 1).expand([out, in, 3, 3]).to_event(4))`` on ``PyroModule[nn.Conv2d]``,
  which ``AutoKroneckerFlow`` reads as ``(out, in 3 3)`` matrices (8 x 9 and 16 x 72).

Both use a categorical likelihood in ``pyro.plate("data", 1297, subsample_size=128)`` (the plate
scales the minibatch log-likelihood by 1297 / 128).
Training: ``SVI(model, guide, Adam(lr=0.01), Trace_ELBO())``, one particle, 3000 steps for both nets
(a conv step costs about twice an MLP step; the 15 conv runs take ~12 minutes on an idle 2-core machine
with one torch thread, 23 minutes at load average 3-4). Each guide trains in one block, so drifts of
machine load between blocks leak into those step-time ratios ("block ms / step").
Interleaved timing: after the accuracy runs (or alone, ``--timing-only``) one SVI per guide is built
on the seed-0 training split, all fed the same minibatch stream (one index draw per round, passed to
every guide). Each SVI is warmed up (50 steps, 10 with ``--quick``), then for R rounds (``--timing-rounds``,
default 300, 20 with ``--quick``) one step of each guide is timed in turn, the order rotated every
round, so machine load hits every guide alike. Reported: median ms per step per guide (and its
quartiles), the ratio of medians to AutoNormal and the median of the per-round paired ratios
(``"timing_interleaved"`` in the results).
Guides: ``AutoNormal``, ``AutoLowRankMultivariateNormal(rank=10)`` and ``AutoKroneckerFlow``
kind ``diag`` / ``linear`` / ``nonlinear`` (additive coupling, hidden (32,)); init scale 0.01 for all.
Metrics on the test split, from the posterior predictive (softmax probabilities averaged over
100 guide samples): error rate, NLL per point, expected calibration error (15 equal-width bins of
the top-class confidence); time per SVI step (median over the steps after the first 50) and the
number of variational parameters.
Goals: K-Linear and K-Nonlinear beat AutoNormal on NLL and ECE; time per step within 2x AutoNormal,
judged on the interleaved timing (ratio of the medians); the block timings stay in the table and in
``"summary"`` for reference only.

Results: ``results/bnn_digits.json`` (MLP, the format of the MLP-only version plus an ``"arch"``
key) and ``results/bnn_digits_conv.json`` (conv net, same layout), each with a ``"timing_interleaved"``
key next to the block timings in ``"summary"``.

Run: ``python benchmarks/kronecker/bench_bnn_digits.py`` (both nets; ``--arch mlp`` or ``--arch conv`` for one,
``--quick`` for a smoke run). ``--timing-only`` runs only the interleaved timing and merges it into the
existing result files (replacing ``"timing_interleaved"`` and recomputing ``"goals"`` from the stored
``"summary"``), without rerunning the ~30 minutes of accuracy runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import (
    add_common_args, command, f2, f3, g3, merge_timing, num, plural, print_rotated_timing, print_table,
    progress, result_path, rotated_step_timing, setup, write_results, yn,
)
from pyro_smc.guides import AutoKroneckerFlow

ARCHS = ("mlp", "conv")
STEPS = {"mlp": 3000, "conv": 3000}
N_TEST = 500
BATCH = 128
INIT_SCALE = 0.01
LR = 0.01
NUM_PRED = 100
ECE_BINS = 15


def bayesian_linear(n_in: int, n_out: int) -> PyroModule:
    layer = PyroModule[nn.Linear](n_in, n_out)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([n_out, n_in]).to_event(2))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([n_out]).to_event(1))
    return layer


class BNN(PyroModule):
    def __init__(self, n_in: int = 64, n_hidden: int = 50, n_out: int = 10):
        super().__init__()
        self.fc1 = bayesian_linear(n_in, n_hidden)
        self.fc2 = bayesian_linear(n_hidden, n_out)

    def forward(self, x, y=None, subsample_size=None, subsample=None):
        # Weights are sampled once per call (PyroSample caches them within the call). ``subsample``
        # (indices) fixes the minibatch, as the interleaved timing does; by default the plate draws it.
        w1, b1, w2, b2 = self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size, subsample=subsample) as idx:
            xb = x[idx]
            logits = torch.tanh(xb @ w1.T + b1) @ w2.T + b2
            pyro.sample("obs", dist.Categorical(logits=logits), obs=None if y is None else y[idx])
        return logits


def bayesian_conv(c_in: int, c_out: int, k: int = 3) -> PyroModule:
    layer = PyroModule[nn.Conv2d](c_in, c_out, k, padding=k // 2)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([c_out, c_in, k, k]).to_event(4))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([c_out]).to_event(1))
    return layer


class ConvBNN(PyroModule):
    """1x8x8 -> conv 8 -> pool -> conv 16 -> pool -> 64 -> 10; ``x`` holds flattened images."""

    def __init__(self, c1: int = 8, c2: int = 16, n_out: int = 10):
        super().__init__()
        self.conv1 = bayesian_conv(1, c1)
        self.conv2 = bayesian_conv(c1, c2)
        self.fc = bayesian_linear(c2 * 2 * 2, n_out)

    def forward(self, x, y=None, subsample_size=None, subsample=None):
        k1, c1, k2, c2 = self.conv1.weight, self.conv1.bias, self.conv2.weight, self.conv2.bias
        w, b = self.fc.weight, self.fc.bias
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size, subsample=subsample) as idx:
            h = x[idx].reshape(-1, 1, 8, 8)
            h = F.avg_pool2d(torch.tanh(F.conv2d(h, k1, c1, padding=1)), 2)
            h = F.avg_pool2d(torch.tanh(F.conv2d(h, k2, c2, padding=1)), 2)
            logits = h.flatten(1) @ w.T + b
            pyro.sample("obs", dist.Categorical(logits=logits), obs=None if y is None else y[idx])
        return logits


MODELS = {"mlp": BNN, "conv": ConvBNN}
LABELS = {"mlp": "MLP", "conv": "conv"}  # each file's prefix in the summary table's row
TITLES = {"mlp": "BNN 64-50-10", "conv": "conv BNN 1x8x8-c8-pool-c16-pool-10"}
DESCRIPTIONS = {
    "mlp": "MLP 64-50-10, tanh; features standardised per pixel",
    "conv": "conv3x3(8, pad 1)-tanh-avgpool2-conv3x3(16, pad 1)-tanh-avgpool2-linear(64, 10); pixels standardised globally",
}


def load_data(seed: int, arch: str = "mlp"):
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1000 + seed))
    test, train = perm[:N_TEST], perm[N_TEST:]
    if arch == "conv":
        mean, sd = x[train].mean(), x[train].std()
    else:
        mean, sd = x[train].mean(0), x[train].std(0).clamp_min(1e-3)  # a few pixels are constant 0
    x = (x - mean) / sd
    return x[train], y[train], x[test], y[test]


def make_guide(name: str, model):
    if name == "AutoNormal":
        return AutoNormal(model, init_scale=INIT_SCALE)
    if name == "AutoLowRankMVN(10)":
        return AutoLowRankMultivariateNormal(model, rank=10, init_scale=INIT_SCALE)
    kind = {"K-Diag": "diag", "K-Linear": "linear", "K-Nonlinear": "nonlinear"}[name]
    flow_options = {"flow": "additive_coupling", "hidden_dims": (32,)} if kind == "nonlinear" else {}  # "diag"/"linear" have no flow
    return AutoKroneckerFlow(model, kind=kind, init_scale=INIT_SCALE, **flow_options)


GUIDES = ["AutoNormal", "AutoLowRankMVN(10)", "K-Diag", "K-Linear", "K-Nonlinear"]


def ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    conf, pred = probs.max(-1)
    correct = (pred == y).float()
    edges = torch.linspace(0, 1, bins + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (conf > lo) & (conf <= hi)
        if mask.any():
            total += mask.float().mean().item() * abs(conf[mask].mean().item() - correct[mask].mean().item())
    return total


@torch.no_grad()
def predictive(model, guide, x, num_samples: int) -> torch.Tensor:
    probs = torch.zeros(x.shape[0], 10)
    for _ in range(num_samples):
        tr = poutine.trace(guide).get_trace(x, None, None)
        logits = poutine.replay(model, trace=tr)(x, None, None)
        probs += torch.softmax(logits, -1)
    return probs / num_samples


def fmt(m) -> str:
    return f"{m[0]:.3f} +- {m[1]:.3f}"


def run_one(guide_name: str, seed: int, steps: int, warmup: int, arch: str = "mlp"):
    xtr, ytr, xte, yte = load_data(seed, arch)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = MODELS[arch]()
    guide = make_guide(guide_name, model)
    guide(xtr, ytr, BATCH)  # build the parameters
    n_params = sum(p.numel() for p in guide.parameters())
    svi = SVI(model, guide, Adam({"lr": LR}), Trace_ELBO())
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = svi.step(xtr, ytr, BATCH)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    probs = predictive(model, guide, xte, NUM_PRED if steps > 200 else 20)
    nll = -torch.log(probs[torch.arange(len(yte)), yte].clamp_min(1e-12)).mean().item()
    err = (probs.argmax(-1) != yte).float().mean().item()
    return {
        "test_error": err,
        "test_nll": nll,
        "ece": ece(probs, yte),
        "step_s": statistics.median(times[warmup:]),
        "n_params": n_params,
        "final_loss_mean_last100": float(np.mean(losses[-100:])),
        "finite": bool(np.isfinite(losses).all()),
    }


def mean_sd(vals):
    return (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)


def timing_interleaved(arch: str, rounds: int, warmup: int, seed: int = 0) -> dict:
    """Time one SVI step of every guide in turn (order rotated each round) on one minibatch stream.

    Alternating the guides step by step spreads drifts of machine load evenly over them, so the
    ratios to AutoNormal stay meaningful on a shared machine (unlike the one-block-per-guide timings).
    """
    xtr, ytr, _, _ = load_data(seed, arch)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svis, n_params = {}, {}
    for g in GUIDES:
        model = MODELS[arch]()
        guide = make_guide(g, model)
        # One param store for all guides: give each its own name prefix (the three K-guides are all
        # AutoKroneckerFlow, whose parameters would otherwise collide). Set before the first call,
        # which creates the parameters.
        guide._pyro_name = "".join(c for c in g if c.isalnum())
        guide(xtr, ytr, BATCH)
        n_params[g] = sum(p.numel() for p in guide.parameters())
        svis[g] = SVI(model, guide, Adam({"lr": LR}), Trace_ELBO())
    n_store = sum(v.numel() for _, v in pyro.get_param_store().named_parameters())
    assert n_store == sum(n_params.values()), f"param name collision: store {n_store} != guides {sum(n_params.values())}"

    gen = torch.Generator().manual_seed(2000 + seed)
    # The same minibatch for every guide within a round.
    timed = rotated_step_timing({g: (lambda idx, g=g: svis[g].step(xtr, ytr, BATCH, idx)) for g in GUIDES}, rounds, warmup, "AutoNormal",
                                round_args=lambda: (torch.randperm(xtr.shape[0], generator=gen)[:BATCH],), n_params=n_params)
    return {
        **timed, "seed": seed, "batch": BATCH,
        "order": "one step per guide per round, order rotated by one guide each round; same minibatch indices for all guides within a round",
        "ratio": "median step time / AutoNormal's median step time (goal check); paired_ratio_median: median over rounds of step / AutoNormal's step",
        "command": command(), "torch_threads": torch.get_num_threads(),
    }


def compute_goals(summary: dict | None, timing: dict) -> dict:
    """NLL and ECE from the accuracy runs' ``summary``; time per step from the interleaved timing."""
    an = (summary or {}).get("AutoNormal")
    goals = {}
    for g in ("K-Linear", "K-Nonlinear"):
        goals[g] = {}
        if an is not None:
            goals[g]["nll_beats_autonormal"] = bool(summary[g]["test_nll"][0] < an["test_nll"][0])
            goals[g]["ece_beats_autonormal"] = bool(summary[g]["ece"][0] < an["ece"][0])
        goals[g]["step_within_2x"] = bool(timing["guides"][g]["ratio_vs_autonormal"] <= 2.0)
    return goals


def print_timing(arch: str, timing: dict, summary: dict | None = None) -> None:
    block = None if summary is None else {
        g: (f"{1e3 * summary[g]['step_s'][0]:.2f} +- {1e3 * summary[g]['step_s'][1]:.2f}", f"{summary[g]['step_ratio_vs_autonormal']:.2f}") for g in GUIDES}
    print_rotated_timing(timing, TITLES[arch], block)


RESULT = "bnn_digits"  # one file, results/kronecker/bnn_digits.json, one run per network ("mlp", "conv")


def run_arch(arch: str, steps: int, n_seeds: int, warmup: int, rounds: int) -> dict:
    per = {g: [] for g in GUIDES}
    t_start = time.perf_counter()
    for seed in progress(range(n_seeds), f"{arch}: seeds"):
        for g in GUIDES:  # guides alternate within a seed, spreading drifts of machine load
            r = run_one(g, seed, steps, warmup, arch)
            per[g].append(r)
            print(f"{arch} seed {seed} {g:20s} err {r['test_error']:.3f} nll {r['test_nll']:.3f} ece {r['ece']:.3f} "
                  f"step {1e3 * r['step_s']:.2f} ms  [{time.perf_counter() - t_start:.0f} s]", flush=True)

    timing = timing_interleaved(arch, rounds, warmup)
    base_step = statistics.mean(r["step_s"] for r in per["AutoNormal"])
    rows, summary = [], {}
    for g in GUIDES:
        s = {k: mean_sd([r[k] for r in per[g]]) for k in ("test_error", "test_nll", "ece", "step_s")}
        s["n_params"] = per[g][0]["n_params"]
        s["step_ratio_vs_autonormal"] = s["step_s"][0] / base_step  # block timing
        summary[g] = s
        t = timing["guides"][g]
        rows.append([g, fmt(s["test_error"]), fmt(s["test_nll"]), fmt(s["ece"]),
                     f"{1e3 * s['step_s'][0]:.2f} +- {1e3 * s['step_s'][1]:.2f}", f"{s['step_ratio_vs_autonormal']:.2f}",
                     f"{1e3 * t['step_s_median']:.2f}", f"{t['ratio_vs_autonormal']:.2f}", s["n_params"]])
    print_table(["guide", "test error", "test NLL", "ECE (15 bins)", "block ms / step", "block x AN",
                 "interleaved ms / step", "interleaved x AN", "# var. params"], rows,
                title=f"{TITLES[arch]} on digits, {steps} steps, {n_seeds} seeds (mean +- sd); "
                      f"interleaved timing: median over {rounds} rounds")
    print_timing(arch, timing, summary)

    goals = compute_goals(summary, timing)
    print(f"\n{arch} goals (time: interleaved ratio):", goals)
    write_results(RESULT, {
        "arch": arch,
        "settings": {"arch": arch, "model": DESCRIPTIONS[arch], "steps": steps, "seeds": n_seeds, "batch": BATCH, "lr": LR,
                     "init_scale": INIT_SCALE, "n_test": N_TEST, "predictive_samples": NUM_PRED if steps > 200 else 20,
                     "ece_bins": ECE_BINS, "timing_warmup_steps": warmup},
        "per_seed": per, "summary": summary, "timing_interleaved": timing, "goals": goals,
        "total_wall_s": time.perf_counter() - t_start,
    }, summary=summary_cells, label=LABELS[arch], run=arch)
    return goals


def run_timing_only(arch: str, rounds: int, warmup: int, quick: bool) -> dict:
    """Interleaved timing alone, merged into the existing result file (or a new one if there is none)."""
    timing = timing_interleaved(arch, rounds, warmup)
    path = result_path(RESULT, quick)
    data = merge_timing(path, timing, compute_goals, {"benchmark": RESULT, "arch": arch}, summary=summary_cells, label=LABELS[arch], run=arch)
    print_timing(arch, timing, data.get("summary"))
    print(f"\n{arch} goals (time: interleaved ratio){'' if data.get('summary') else ' (no accuracy summary in the file)'}:", data["goals"])
    print(f"merged timing_interleaved and goals into {path}")
    return data["goals"]


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows the K-guides' test NLL / ECE and step time against AutoNormal.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    s = d["summary"]
    kguides = [k for k in ("K-Linear", "K-Nonlinear") if k in s]
    if "AutoNormal" not in s or not kguides:
        raise ValueError("summary lacks AutoNormal or the K-guides")
    timing = (d.get("timing_interleaved") or {}).get("guides")
    if timing:
        times = {k: timing[k]["ratio_vs_autonormal"] for k in kguides}
        how = "interleaved"
    else:
        times = {k: s[k]["step_ratio_vs_autonormal"] for k in kguides}
        how = "block"
    goals = d.get("goals") or {}
    parts = {}
    for k in kguides:
        g = goals.get(k) or {
            "nll_beats_autonormal": num(s[k]["test_nll"]) < num(s["AutoNormal"]["test_nll"]),
            "ece_beats_autonormal": num(s[k]["ece"]) < num(s["AutoNormal"]["ece"]),
            "step_within_2x": times[k] <= 2,
        }
        parts[k] = {"NLL": g["nll_beats_autonormal"], "ECE": g["ece_beats_autonormal"], "time": g["step_within_2x"]}
    met = "; ".join(f"{k}: " + ("yes" if all(v.values()) else ", ".join(f"{m} {yn(ok)}" for m, ok in v.items())) for k, v in parts.items())
    steps = d.get("settings", {}).get("steps")
    an = s["AutoNormal"]
    return {
        "ours": "test NLL / ECE: " + ", ".join(f"{k} {f3(s[k]['test_nll'])} / {f3(s[k]['ece'])}" for k in kguides)
        + (f" ({steps} steps, {plural(d['settings'].get('seeds', '?'), 'seed')})" if steps else ""),
        "anchor": f"AutoNormal {f3(an['test_nll'])} / {f3(an['ece'])}"
        + (f", {g3(1e3 * timing['AutoNormal']['step_s_median'])} ms/step" if timing and "AutoNormal" in timing else ""),
        "comparison": f"step time x AutoNormal ({how}): " + ", ".join(f"{k} {f2(v)}" for k, v in times.items()),
        "goal": "K-Linear, K-Nonlinear beat AutoNormal on NLL and ECE; step time <= 2x",
        "met": met,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--arch", choices=(*ARCHS, "all"), default="all", help="network(s) to benchmark (default all)")
    parser.add_argument("--steps", type=int, default=None, help=f"SVI steps (default {STEPS}, 100 with --quick)")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--timing-rounds", type=int, default=None, help="rounds of the interleaved timing (default 300, 20 with --quick)")
    parser.add_argument("--timing-only", action="store_true",
                        help="run only the interleaved timing and merge it (and the goals) into the existing result files")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float32)
    n_seeds = args.seeds or (1 if args.quick else 3)
    warmup = 10 if args.quick else 50
    rounds = args.timing_rounds or (20 if args.quick else 300)
    for arch in ARCHS if args.arch == "all" else (args.arch,):
        if args.timing_only:
            run_timing_only(arch, rounds, warmup, args.quick)
            continue
        steps = args.steps or (100 if args.quick else STEPS[arch])
        run_arch(arch, steps, n_seeds, warmup, rounds)


if __name__ == "__main__":
    main()
