"""Parameter estimation with differentiable SMC: the setting of Corenflos et al. (2021), Table 4.

Model: d = 2, A = diag(theta), Q = I, C = I, R = 0.1 I, x_1 ~ N(0, I). ``M`` data sets of
``T = 150`` observations are simulated at theta = (0.5, 0.5). For each data set:

1. the Kalman MLE: maximise the exact log-evidence (``pyro_smc.ops.kalman``) over theta in
   (0, 1)^2 (theta = sigmoid(z), LBFGS on z, float64);
2. from theta = (0.25, 0.25), ``--steps`` (default 100) Adam steps (lr ``--lr``, default 0.02) on
   ``-mean(log Z_hat)`` of ``SMC(num_particles=25, num_filters=4)`` (fresh random numbers each
   step), with (a) ``OTResampler(epsilon=0.5)`` (implicit gradients; the resampling is
   differentiated) and (b) ``SystematicResampler`` (gradients drop the resampling terms). theta is
   optimised directly (it stays inside (0, 1) in practice) and the last iterate is reported.

Score: ``RMSE = sqrt(1/M sum_k sum_i (theta_hat_i^k - theta_mle_i^k)^2)`` against the Kalman MLE,
for the last iterate and for the average of the iterates recorded (every 10 steps) over the
second half of the run (with N = 25 the gradient noise keeps the last iterate wandering).

Run: ``python benchmarks/resampling/bench_param_estimation.py`` (``--quick`` for a smoke run: 2 data sets,
few steps). Results are written after every data set, so an interrupted run keeps its data.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, f3, print_table, progress, setup, write_results, yn
from benchmarks.resampling.bench_ot_cost import DiagSSM
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.kalman import kalman_filter
from pyro_smc.resamplers import OTResampler, SystematicResampler

THETA_TRUE = 0.5
THETA_INIT = 0.25


def simulate(T: int, seed: int) -> torch.Tensor:
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(THETA_TRUE * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    return ssm.simulate(T, generator=torch.Generator().manual_seed(seed))[1]


def kalman_log_evidence(theta: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(2, dtype=theta.dtype)
    return kalman_filter(ys.to(theta.dtype), torch.diag(theta), eye, eye, 0.1 * eye, torch.zeros(2, dtype=theta.dtype), eye).log_evidence


def kalman_mle(ys: torch.Tensor) -> list[float]:
    z = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # theta = sigmoid(z), starts at 0.5
    opt = torch.optim.LBFGS([z], lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -kalman_log_evidence(torch.sigmoid(z), ys)
        loss.backward()
        return loss

    opt.step(closure)
    theta = torch.sigmoid(z.detach())
    # First-order check: the gradient in theta must vanish at an interior optimum.
    t = theta.clone().requires_grad_(True)
    grad = torch.autograd.grad(kalman_log_evidence(t, ys), t)[0]
    return theta.tolist(), float(grad.abs().max())


def fit_smc(ys, resampler, steps, lr, num_particles, num_filters, seed):
    pyro.set_rng_seed(seed)
    theta = torch.full((2,), THETA_INIT, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=lr)
    model = DiagSSM(theta)
    trace = []
    for _ in range(steps):
        opt.zero_grad()
        smc = SMC(model, num_particles=num_particles, num_filters=num_filters, resampler=resampler).run(ys)
        loss = -smc.log_evidence.mean()
        loss.backward()
        opt.step()
        trace.append(theta.detach().tolist())
    return theta.detach().tolist(), trace


def one_dataset(job):
    k, T, steps, lr, N, B, threads = job
    torch.set_num_threads(threads)
    ys = simulate(T, seed=k)
    mle, mle_grad = kalman_mle(ys)
    out = {"dataset": k, "theta_mle": mle, "mle_max_abs_grad": mle_grad}
    for name, resampler in (("ot", OTResampler(epsilon=0.5)), ("systematic", SystematicResampler())):
        start = time.perf_counter()
        theta, trace = fit_smc(ys, resampler, steps, lr, N, B, seed=10_000 + k)
        out[name] = {"theta_hat": theta, "seconds": time.perf_counter() - start, "trace_every_10": trace[9::10]}
    return out


def rmse(records, name, key=lambda rec: rec["theta_hat"]):
    total = sum((h - m) ** 2 for r in records for h, m in zip(key(r[name]), r["theta_mle"]))
    return math.sqrt(total / len(records))


def tail_average(rec):
    """Mean of the iterates recorded every 10 steps over the second half of the run (Polyak-style)."""
    tail = rec["trace_every_10"][len(rec["trace_every_10"]) // 2 :] or [rec["theta_hat"]]
    return [sum(t[i] for t in tail) / len(tail) for i in range(2)]


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows RMSE of the OT and systematic estimates against the Kalman MLE.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    s = d.get("settings", {})
    ot, sy = d["rmse_ot"], d["rmse_systematic"]
    ot_t, sy_t = d.get("rmse_ot_tail_average"), d.get("rmse_systematic_tail_average")
    m = d.get("completed_datasets", s.get("M"))
    conditions = f" (M = {m} data sets, N = {s['num_particles']})" if "num_particles" in s else f" (M = {m} data sets)"
    partial = "" if d.get("finished", True) else f"; run unfinished ({m} data sets)"
    return {
        "ours": f"RMSE vs Kalman MLE, OT (eps 0.5): last iterate {f3(ot)}" + (f", tail average {f3(ot_t)}" if ot_t is not None else "") + conditions,
        "anchor": f"systematic (resampling terms dropped): {f3(sy)}" + (f", tail average {f3(sy_t)}" if sy_t is not None else ""),
        "comparison": f"OT / systematic {f2(ot / sy)}" + (f" (tail {f2(ot_t / sy_t)})" if ot_t is not None and sy_t else "") + partial,
        "goal": "RMSE OT < systematic (the paper's Table 4 claim)",
        "met": yn(ot < sy),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--datasets", type=int, default=None, help="M (default 10; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps (default 100; 5 with --quick)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--particles", type=int, default=25)
    parser.add_argument("--filters", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="data sets fitted in parallel processes")
    args = parser.parse_args()
    setup(args)
    M = args.datasets if args.datasets is not None else (2 if args.quick else 10)
    steps = args.steps if args.steps is not None else (5 if args.quick else 100)
    T = 150
    jobs = [(k, T, steps, args.lr, args.particles, args.filters, args.threads) for k in range(M)]

    settings = {
        "M": M, "T": T, "steps": steps, "optimizer": f"Adam(lr={args.lr})", "num_particles": args.particles,
        "num_filters": args.filters, "theta_true": THETA_TRUE, "theta_init": THETA_INIT,
        "ot": "OTResampler(epsilon=0.5, scaling=0.75, threshold=1e-3, max_iter=100, gradient='implicit')",
        "systematic": "SystematicResampler()", "ess_threshold": 0.5, "mle": "LBFGS on sigmoid-logit, float64",
    }
    records = []

    def save(done):
        payload = {"settings": settings, "completed_datasets": len(records), "results": sorted(records, key=lambda r: r["dataset"])}
        if records:
            payload["rmse_ot"] = rmse(records, "ot")
            payload["rmse_systematic"] = rmse(records, "systematic")
            payload["rmse_ot_tail_average"] = rmse(records, "ot", tail_average)
            payload["rmse_systematic_tail_average"] = rmse(records, "systematic", tail_average)
        payload["finished"] = done
        write_results("bench_param_estimation", payload, summary=summary_cells)

    start = time.perf_counter()
    if args.workers > 1:
        with mp.get_context("fork").Pool(args.workers) as pool:
            for rec in progress(pool.imap_unordered(one_dataset, jobs), "data sets", args, total=len(jobs)):
                records.append(rec)
                print(f"data set {rec['dataset']}: MLE {rec['theta_mle']}, OT {rec['ot']['theta_hat']}, systematic {rec['systematic']['theta_hat']}", flush=True)
                save(False)
    else:
        for job in progress(jobs, "data sets", args):
            rec = one_dataset(job)
            records.append(rec)
            print(f"data set {rec['dataset']}: MLE {rec['theta_mle']}, OT {rec['ot']['theta_hat']}, systematic {rec['systematic']['theta_hat']}", flush=True)
            save(False)
    elapsed = time.perf_counter() - start

    rows = [[r["dataset"], *(f"{v:.3f}" for v in r["theta_mle"]), *(f"{v:.3f}" for v in r["ot"]["theta_hat"]), *(f"{v:.3f}" for v in r["systematic"]["theta_hat"])] for r in sorted(records, key=lambda r: r["dataset"])]
    print_table(["k", "MLE 1", "MLE 2", "OT 1", "OT 2", "sys 1", "sys 2"], rows, title=f"theta estimates after {steps} Adam steps (N={args.particles}, B={args.filters})")
    r_ot, r_sys = rmse(records, "ot"), rmse(records, "systematic")
    a_ot, a_sys = rmse(records, "ot", tail_average), rmse(records, "systematic", tail_average)
    print_table(
        ["resampler", "RMSE last iterate", "ratio", "RMSE tail average", "ratio"],
        [["OT (eps=0.5)", r_ot, r_ot / r_sys, a_ot, a_ot / a_sys], ["systematic", r_sys, 1.0, a_sys, 1.0]],
        title=f"RMSE of theta against the Kalman MLE, M={M} data sets, wall {elapsed:.0f} s (tail average: mean of the iterates at steps 10k over the second half)",
    )
    settings["wall_s"] = elapsed
    save(True)


if __name__ == "__main__":
    main()
