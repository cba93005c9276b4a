"""High-dimensional EP: Lorenz-96 at d = 40 and d = 200 in the setting of Kamthe, Takao, Mohamed
and Deisenroth, "Iterative state estimation in non-linear dynamical systems using approximate
expectation propagation" (TMLR 2022), against the numbers in their published logs.

Setting (their code, github.com/sanket-kamthe/EPyStateEstimator: Systems/L96.py,
Experiments/EP_Sweep_L96.py, Utils/Metrics.py; read for the setting only):

    dx_i/dt = (x_{i+1} - x_{i-2}) x_{i-1} - x_i + F,  F = 8, one RK4 step of dt = 0.05 per transition
    x_{t+1} = RK4(x_t) + w_t,  w_t ~ N(0, 0.1 I);   y_t = x_t^2 + v_t,  v_t ~ N(0, I)   (entrywise)
    x_0 ~ N(x_bar, I), x_bar = 999 RK4 steps from F 1 + 0.01 e_1;  y_1..y_50 observed (y_0 is not)
    unscented transform alpha = 1, beta = 2, kappa = 3 (dynamics) / 2 (measurement)
    RMSE = sqrt(mean_t ||m_t - x_t||^2)   (not per site: it grows like sqrt(d))
    NLL  = mean_t -log N(x_t; m_t, P_t)   (the full d-dimensional density),  t = 1..50
    10 seeds, EP power 1 / 0.8 / 0.1 with damping 1, 10 sweeps

We model x_0..x_50 (T = 51) with y_0 missing and score t = 1..50. The data are our own
simulations of the same model (torch generators, seeds 0..9), not theirs: the runs are
compared as means over 10 seeds with their standard errors. Their per-seed logs
(log/L96_dim_experiment_3.db, log/IEKS_L96.db) give the anchors below.

Contenders (float64, CPU):
  URTS           ``unscented_rts_smoother`` with their sigma points (= EP's first sweep);
  EP p=...       ``EPSmoother(projection=Unscented(...), power=p, damping=1)``, sequential
                 schedule, metrics after every sweep (warm-started one sweep at a time, which is
                 the same iteration to rounding), 10 sweeps. Like theirs, power EP uses the power
                 from the first sweep on (docs/math/ep.md#power-ep), so the first sweep at p < 1
                 is compared with their iteration 0 at that power; at p = 1 it is the URTS;
  EP lin         EP with the linearisation projection (their "TT" rows), power 1;
  IEKS           ``iterated_extended_rts_smoother``, 10 Gauss-Newton passes (Bell 1994).

Time per sweep: median of ``--repeats`` interleaved runs of each method on one seed divided by
its sweeps (IEKS: passes), one thread.

Run: ``python benchmarks/gaussian/bench_ep_lorenz96.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, f3, load_average, met_summary, print_table, progress, setup, timeit_interleaved, write_results
from pyro_smc import EPSmoother
from pyro_smc.infer import Linearization, Unscented, extended_rts_smoother, gaussian_smoother, unscented_rts_smoother
from pyro_smc.infer.gaussian.iterated import NominalLinearization, iterated_extended_rts_smoother
from pyro_smc.models.lorenz96 import Lorenz96SSM

STEPS = 50
SWEEPS = 10
POWERS = (1.0, 0.8, 0.1)
UT = Unscented(alpha=1.0, beta=2.0, kappa=3.0, observation=dict(kappa=2.0))
# Kamthe et al.'s logs: mean (standard error) over their 10 seeds of RMSE and NLL, UT EP at
# iteration 0 (their first sweep, with the power) and 9 (the 10th sweep); IEKS after 10 passes.
ANCHORS = {
    40: {
        "EP p=1 first": (1.413, 0.029, -16.53, 0.40),
        "EP p=1 last": (1.209, 0.017, -21.57, 0.41),
        "EP p=0.8 first": (1.379, 0.028, -17.54, 0.40),
        "EP p=0.8 last": (1.200, 0.018, -21.91, 0.42),
        "EP p=0.1 first": (1.340, 0.067, -17.92, 2.17),
        "EP p=0.1 last": (1.284, 0.067, -18.33, 3.15),
        "EP lin last": (3.107, None, 1424.3, None),
        "IEKS": (3.145, 1.284, 1540.6, 1129.3),
    },
    200: {
        "EP p=1 first": (4.473, 0.056, 8.72, 1.38),
        "EP p=1 last": (2.945, 0.018, -89.05, 0.56),
        "EP p=0.8 first": (4.112, 0.044, -12.41, 1.05),
        "EP p=0.8 last": (2.800, 0.015, -102.97, 0.48),
        "EP p=0.1 first": (2.843, 0.017, -97.44, 0.54),
        "EP p=0.1 last": (2.606, 0.010, -111.17, 0.38),
        "EP lin last": (4.837, None, 1604.4, None),
        "IEKS": (4.920, 0.970, 1753.3, 1008.0),
    },
}


def metrics(result, xs: torch.Tensor) -> tuple[float, float]:
    """Their RMSE and NLL over t = 1..T-1 (x_0 is not scored)."""
    m, P, x = result.means[1:], result.covariances[1:], xs[1:]
    rmse = float(((m - x) ** 2).sum(-1).mean().sqrt())
    nll = float(-torch.distributions.MultivariateNormal(m, P).log_prob(x).mean())
    return rmse, nll


def ep_trace(ssm, ys, xs, projection, power: float, sweeps: int) -> list[tuple[float, ...]]:
    """(RMSE, NLL, skipped updates, largest change) after each of ``sweeps`` EP sweeps,
    warm-starting one sweep at a time."""
    out, result = [], None
    for _ in range(sweeps):
        result = EPSmoother(ssm, projection, max_iter=1, power=power, tol=1e-12).smooth(ys, init=result)
        (sweep,) = result.history
        out.append((*metrics(result, xs), sweep.skipped, sweep.change))
    return out


def ieks_trace(ssm, ys, xs, passes: int) -> list[tuple[float, float]]:
    """(RMSE, NLL) after each IEKS pass (the first is the EKS): the loop of
    ``iterated_extended_rts_smoother``, each pass's result kept."""
    result = extended_rts_smoother(ssm, ys)
    out = [metrics(result, xs)]
    for _ in range(passes - 1):
        result = gaussian_smoother(ssm, ys, NominalLinearization(result.means))
        out.append(metrics(result, xs))
    return out


def run_seed(d: int, seed: int, sweeps: int, with_linear: bool) -> dict:
    ssm = Lorenz96SSM(d, dtype=torch.float64)
    xs, ys = ssm.simulate(STEPS + 1, generator=torch.Generator().manual_seed(seed))
    ys[0] = float("nan")
    traces = {"URTS": [metrics(unscented_rts_smoother(ssm, ys, UT), xs)]}
    for power in POWERS:
        traces[f"EP p={power:g}"] = ep_trace(ssm, ys, xs, UT, power, sweeps)
    if with_linear:
        traces["EP lin"] = ep_trace(ssm, ys, xs, Linearization(), 1.0, sweeps)
    traces["IEKS"] = ieks_trace(ssm, ys, xs, sweeps)
    return traces


def timing(d: int, sweeps: int, repeats: int, with_linear: bool) -> dict:
    ssm = Lorenz96SSM(d, dtype=torch.float64)
    _, ys = ssm.simulate(STEPS + 1, generator=torch.Generator().manual_seed(0))
    ys[0] = float("nan")
    fns = {"URTS": lambda: unscented_rts_smoother(ssm, ys, UT)}
    for power in (1.0, 0.1):
        fns[f"EP p={power:g}"] = lambda power=power: EPSmoother(ssm, UT, max_iter=sweeps, power=power, tol=1e-12).smooth(ys)
    if with_linear:
        fns["EP lin"] = lambda: EPSmoother(ssm, Linearization(), max_iter=sweeps, tol=1e-12).smooth(ys)
    fns["IEKS"] = lambda: iterated_extended_rts_smoother(ssm, ys, num_iter=sweeps, tol=1e-300)
    times = timeit_interleaved(fns, repeats=repeats, warmup=1, desc=f"timing d={d}")
    for name, t in times.items():
        t["per_sweep_s"] = t["median_s"] / (1 if name == "URTS" else sweeps)
    return times


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def aggregate(per_seed: dict) -> dict:
    """Per method and sweep: the mean and standard error over seeds of RMSE and NLL."""
    out = {}
    seeds = list(per_seed.values())
    for name in seeds[0]:
        rows = []
        for k in range(len(seeds[0][name])):
            rmse, rmse_se = mean_se([s[name][k][0] for s in seeds])
            nll, nll_se = mean_se([s[name][k][1] for s in seeds])
            row = {"rmse": rmse, "rmse_se": rmse_se, "nll": nll, "nll_se": nll_se}
            if len(seeds[0][name][k]) > 2:  # EP: updates skipped (all seeds), largest change (worst seed)
                row["skipped"] = sum(s[name][k][2] for s in seeds)
                row["change_max"] = max(s[name][k][3] for s in seeds)
            rows.append(row)
        out[name] = rows
    return out


def verdict(ours: dict, anchor: tuple) -> str:
    """``beat`` (lower RMSE by more than 2 combined standard errors), ``match`` (within) or ``worse``."""
    rmse, se = anchor[0], anchor[1] or 0.0
    band = 2 * math.hypot(ours["rmse_se"], se)
    return "beat" if ours["rmse"] < rmse - band else "match" if ours["rmse"] <= rmse + band else "worse"


def table_rows(d: int, agg: dict, times: dict) -> list[dict]:
    anchors = ANCHORS.get(d, {})
    rows = [("URTS (= EP first sweep)", agg["URTS"][0], "EP p=1 first", times.get("URTS"))]
    for name in ("EP p=0.8", "EP p=0.1"):  # power EP's first sweep is not the URTS
        rows.append((f"{name}, first sweep", agg[name][0], f"{name} first", None))
    for name in ("EP p=1", "EP p=0.8", "EP p=0.1", "EP lin"):
        if name in agg:
            rows.append((f"{name}, {len(agg[name])} sweeps", agg[name][-1], f"{name} last", times.get(name)))
    rows.append((f"IEKS, {len(agg['IEKS'])} passes", agg["IEKS"][-1], "IEKS", times.get("IEKS")))
    out = []
    for label, ours, key, t in rows:
        anchor = anchors.get(key)
        out.append(
            {
                "method": label,
                "rmse": ours["rmse"],
                "rmse_se": ours["rmse_se"],
                "nll": ours["nll"],
                "nll_se": ours["nll_se"],
                "kamthe_rmse": anchor[0] if anchor else None,
                "kamthe_nll": anchor[2] if anchor else None,
                "verdict": verdict(ours, anchor) if anchor else "",
                "per_sweep_s": t["per_sweep_s"] if t else None,
                "skipped": ours.get("skipped"),
                "last_change_max": ours.get("change_max"),
            }
        )
    return out


def summary_cells(d: dict) -> dict:
    """This benchmark's row of the summary table in ``benchmarks/README.md``: d = 200 RMSE of EP
    after 10 sweeps (power 1 and 0.1), URTS and IEKS against Kamthe et al.'s logs."""
    rows = {r["method"].split(",")[0]: r for r in d["table"]["200"] if not r["method"].endswith(", first sweep")}
    keys = [k for k in ("URTS (= EP first sweep)", "EP p=1", "EP p=0.1", "IEKS") if k in rows]
    short = lambda k: k.split(" (")[0]  # noqa: E731
    return {
        "ours": "d = 200 RMSE / NLL: "
        + ", ".join(f"{short(k)} {f2(rows[k]['rmse'])} / {rows[k]['nll']:.0f}" for k in keys)
        + (
            f"; EP {rows['EP p=1']['per_sweep_s']:.2f} s (p=1) / {rows['EP p=0.1']['per_sweep_s']:.2f} s (p=0.1) per sweep (CPU, 1 thread)"
            if rows["EP p=1"].get("per_sweep_s") and rows["EP p=0.1"].get("per_sweep_s")
            else ""
        ),
        "anchor": "Kamthe et al. (2022) logs: " + ", ".join(f"{short(k)} {f2(rows[k]['kamthe_rmse'])} / {rows[k]['kamthe_nll']:.0f}" for k in keys),
        "comparison": ", ".join(f"{short(k)}: {rows[k]['verdict']}" for k in keys),
        "goal": "match or beat their RMSE (within 2 combined standard errors over 10 seeds)",
        "met": met_summary({short(k): rows[k]["verdict"] in ("match", "beat") for k in keys if k != "URTS (= EP first sweep)"}),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--dims", type=int, nargs="+", default=[40, 200])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sweeps", type=int, default=SWEEPS)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (on seed 0)")
    parser.add_argument("--no-linear", action="store_true", help="skip EP with the linearisation projection")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    warnings.simplefilter("ignore")  # EP's convergence warning at max_iter=1 sweeps does not apply
    dims = [8] if args.quick else args.dims
    num_seeds, sweeps, repeats = (2, 3, 1) if args.quick else (args.seeds, args.sweeps, args.repeats)
    results, tables = {}, {}
    for d in dims:
        per_seed = {seed: run_seed(d, seed, sweeps, not args.no_linear) for seed in progress(range(num_seeds), f"d={d}", args)}
        agg = aggregate(per_seed)
        times = timing(d, sweeps, repeats, not args.no_linear)
        tables[str(d)] = table_rows(d, agg, times)
        results[str(d)] = {"per_seed": {str(k): v for k, v in per_seed.items()}, "by_sweep": agg, "timing": times}
        print_table(
            ["method", "RMSE", "se", "NLL", "se", "Kamthe RMSE", "Kamthe NLL", "verdict", "s / sweep"],
            [
                [
                    r["method"],
                    r["rmse"],
                    r["rmse_se"],
                    r["nll"],
                    r["nll_se"],
                    r["kamthe_rmse"] or "",
                    r["kamthe_nll"] or "",
                    r["verdict"],
                    r["per_sweep_s"] or "",
                ]
                for r in tables[str(d)]
            ],
            title=f"Lorenz-96 d = {d}, T = {STEPS}, {num_seeds} seeds (load average {load_average()})",
        )
        print("EP RMSE by sweep:", {k: [f3(row["rmse"]) for row in v] for k, v in agg.items() if k.startswith("EP")})
        print("EP skipped updates by sweep (all seeds):", {k: [row["skipped"] for row in v] for k, v in agg.items() if k.startswith("EP")})
        print("EP largest change in the last sweep (worst seed):", {k: v[-1]["change_max"] for k, v in agg.items() if k.startswith("EP")})
    write_results(
        "bench_ep_lorenz96",
        {
            "settings": {
                "forcing": 8.0,
                "dt": 0.05,
                "transition_var": 0.1,
                "observation": "x^2",
                "observation_var": 1.0,
                "steps": STEPS,
                "init": "N(spin-up, I) on x_0, y_0 missing",
                "unscented": "alpha 1, beta 2, kappa 3 (dynamics) / 2 (measurement)",
                "powers": POWERS,
                "damping": 1.0,
                "sweeps": sweeps,
                "seeds": num_seeds,
                "rmse": "sqrt(mean_t ||m_t - x_t||^2), t = 1..50",
                "nll": "mean_t -log N(x_t; m_t, P_t), t = 1..50",
            },
            "anchors_kamthe": {str(k): v for k, v in ANCHORS.items()},
            "table": tables,
            "results": results,
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
