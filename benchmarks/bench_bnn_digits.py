"""Bayesian neural network on sklearn's 8x8 digits: Kronecker-flow guides against mean-field and low rank.

Data: ``sklearn.datasets.load_digits`` (1797 images, 64 features), features standardised with the
training split's mean and sd; a fixed random split per seed, 1297 train / 500 test.
Model: MLP 64-50-10 (tanh), a ``PyroModule`` whose weights are
``PyroSample(Normal(0, 1).expand([out, in]).to_event(2))`` and biases ``Normal(0, 1)`` vectors;
categorical likelihood in ``pyro.plate("data", 1297, subsample_size=128)`` (the plate scales the
minibatch log-likelihood by 1297 / 128).
Training: ``SVI(model, guide, Adam(lr=0.01), Trace_ELBO())``, one particle, fixed number of steps.
Guides: ``AutoNormal``, ``AutoLowRankMultivariateNormal(rank=10)`` and ``AutoKroneckerFlow``
kind ``diag`` / ``linear`` / ``nonlinear`` (RealNVP, hidden (32,)); init scale 0.01 for all.
Metrics on the test split, from the posterior predictive (softmax probabilities averaged over
100 guide samples): error rate, NLL per point, expected calibration error (15 equal-width bins of
the top-class confidence); time per SVI step (median over the steps after the first 50) and the
number of variational parameters.
Goals: K-Linear and K-Nonlinear beat AutoNormal on NLL and ECE; time per step within 2x AutoNormal.

Run: ``python benchmarks/bench_bnn_digits.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam
from sklearn.datasets import load_digits

from _common import add_common_args, print_table, setup, write_results
from pyro_smc.guides.kronecker_flow import AutoKroneckerFlow

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

    def forward(self, x, y=None, subsample_size=None):
        # Weights are sampled once per call (PyroSample caches them within the call).
        w1, b1, w2, b2 = self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            xb = x[idx]
            logits = torch.tanh(xb @ w1.T + b1) @ w2.T + b2
            pyro.sample("obs", dist.Categorical(logits=logits), obs=None if y is None else y[idx])
        return logits


def load_data(seed: int):
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1000 + seed))
    test, train = perm[:N_TEST], perm[N_TEST:]
    mean, sd = x[train].mean(0), x[train].std(0).clamp_min(1e-3)  # a few pixels are constant 0
    x = (x - mean) / sd
    return x[train], y[train], x[test], y[test]


def make_guide(name: str, model):
    if name == "AutoNormal":
        return AutoNormal(model, init_scale=INIT_SCALE)
    if name == "AutoLowRankMVN(10)":
        return AutoLowRankMultivariateNormal(model, rank=10, init_scale=INIT_SCALE)
    kind = {"K-Diag": "diag", "K-Linear": "linear", "K-Nonlinear": "nonlinear"}[name]
    return AutoKroneckerFlow(model, kind=kind, flow="realnvp", hidden_dims=(32,), init_scale=INIT_SCALE)


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


def run_one(guide_name: str, seed: int, steps: int, warmup: int):
    xtr, ytr, xte, yte = load_data(seed)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = BNN()
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float32)
    steps = args.steps or (100 if args.quick else 3000)
    n_seeds = args.seeds or (1 if args.quick else 3)
    warmup = 10 if args.quick else 50

    per = {g: [] for g in GUIDES}
    t_start = time.perf_counter()
    for seed in range(n_seeds):
        for g in GUIDES:  # guides alternate within a seed, spreading drifts of machine load
            r = run_one(g, seed, steps, warmup)
            per[g].append(r)
            print(f"seed {seed} {g:20s} err {r['test_error']:.3f} nll {r['test_nll']:.3f} ece {r['ece']:.3f} "
                  f"step {1e3 * r['step_s']:.2f} ms  [{time.perf_counter() - t_start:.0f} s]", flush=True)

    base_step = statistics.mean(r["step_s"] for r in per["AutoNormal"])
    rows, summary = [], {}
    for g in GUIDES:
        s = {k: mean_sd([r[k] for r in per[g]]) for k in ("test_error", "test_nll", "ece", "step_s")}
        s["n_params"] = per[g][0]["n_params"]
        s["step_ratio_vs_autonormal"] = s["step_s"][0] / base_step
        summary[g] = s
        rows.append([g, fmt(s["test_error"]), fmt(s["test_nll"]), fmt(s["ece"]),
                     f"{1e3 * s['step_s'][0]:.2f} +- {1e3 * s['step_s'][1]:.2f}", f"{s['step_ratio_vs_autonormal']:.2f}", s["n_params"]])
    print_table(["guide", "test error", "test NLL", "ECE (15 bins)", "ms / step", "x AutoNormal", "# var. params"], rows,
                title=f"BNN 64-50-10 on digits, {steps} steps, {n_seeds} seeds (mean +- sd)")

    an = summary["AutoNormal"]
    goals = {}
    for g in ("K-Linear", "K-Nonlinear"):
        goals[g] = {
            "nll_beats_autonormal": summary[g]["test_nll"][0] < an["test_nll"][0],
            "ece_beats_autonormal": summary[g]["ece"][0] < an["ece"][0],
            "step_within_2x": summary[g]["step_ratio_vs_autonormal"] <= 2.0,
        }
    print("\ngoals:", goals)
    write_results("bnn_digits", {
        "settings": {"steps": steps, "seeds": n_seeds, "batch": BATCH, "lr": LR, "init_scale": INIT_SCALE,
                     "n_test": N_TEST, "predictive_samples": NUM_PRED if steps > 200 else 20, "ece_bins": ECE_BINS,
                     "timing_warmup_steps": warmup},
        "per_seed": per, "summary": summary, "goals": goals,
        "total_wall_s": time.perf_counter() - t_start,
    })


if __name__ == "__main__":
    main()
