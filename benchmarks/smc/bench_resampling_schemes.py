"""The index resampling schemes against ``particles``' on the same model: log-evidence variance.

Model: the stochastic-volatility model of ``bench_particles_speed.py`` (``x_t = 0.91 x_{t-1} +
v_t``, ``y_t = 0.5 exp(x_t / 2) e_t``), one simulated data set, T = 100, float64; bootstrap
filters resampling when the ESS falls below N / 2, at N = 50 and 200.

Contenders, for each scheme (multinomial, residual, stratified, systematic):

* ``ours``: ``SMC(model, num_particles=N, num_filters=R, resampler=<Scheme>Resampler())``, ``R``
  independent filters in one vectorised pass;
* ``particles``: ``particles.SMC(fk=Bootstrap(...), N, resampling=<scheme>, ESSrmin=0.5)``, run
  ``R`` times (Chopin's library, MIT).

Reported: the variance of ``log Z_hat`` over the ``R`` runs with its standard error
(``sqrt((m4 - s^4) / R)``), each scheme's variance over multinomial resampling's in the same
library, and ours over ``particles``' for the same scheme. The means of ``log Z_hat`` of the two
libraries must agree within 5 standard errors (same model, same data). Goals: every scheme's
variance matches ``particles``' for the same scheme (within 3 combined standard errors), and
residual resampling's is no larger than multinomial's (within the same margin).

Run: ``python benchmarks/smc/bench_resampling_schemes.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, print_table, progress, setup, write_results, yn  # noqa: E402
from benchmarks.smc.bench_particles_speed import SV, particles_model, simulate  # noqa: E402
from pyro_smc import SMC  # noqa: E402
from pyro_smc.resamplers import MultinomialResampler, ResidualResampler, StratifiedResampler, SystematicResampler  # noqa: E402

SCHEMES = {
    "multinomial": MultinomialResampler,
    "residual": ResidualResampler,
    "stratified": StratifiedResampler,
    "systematic": SystematicResampler,
}


def moments(values) -> dict:
    """Mean, variance and the variance's standard error ``sqrt((m4 - s^4) / R)``."""
    x = np.asarray(values, dtype=np.float64)
    r = len(x)
    var = float(x.var(ddof=1))
    m4 = float(((x - x.mean()) ** 4).mean())
    return {"mean": float(x.mean()), "mean_se": math.sqrt(var / r), "var": var, "var_se": math.sqrt(max(m4 - var**2, 0.0) / r)}


def ours(ys: torch.Tensor, n: int, runs: int, scheme: str) -> tuple[list[float], float]:
    start = time.perf_counter()
    log_z = SMC(SV(), num_particles=n, num_filters=runs, resampler=SCHEMES[scheme]()).run(ys).log_evidence
    return log_z.tolist(), time.perf_counter() - start


def theirs(fk, n: int, runs: int, scheme: str, args) -> tuple[list[float], float]:
    import particles

    out = []
    start = time.perf_counter()
    for _ in progress(range(runs), f"particles {scheme} N={n}", args):
        alg = particles.SMC(fk=fk, N=n, resampling=scheme, ESSrmin=0.5, collect=None, store_history=False, verbose=False)
        alg.run()
        out.append(float(alg.logLt))
    return out, time.perf_counter() - start


def summary_cells(d: dict) -> dict:
    """This benchmark's row in ``benchmarks/README.md``, from a result file's content ``d``."""
    rows = d["results"]
    ns = sorted({r["N"] for r in rows})

    def cell(side: str, key: str) -> str:
        parts = []
        for n in ns:
            at = {r["scheme"]: r for r in rows if r["N"] == n}
            parts.append(f"N = {n}: " + " / ".join(f2(at[s][side][key]) for s in SCHEMES))
        return "; ".join(parts)

    met_match = all(r["match"] for r in rows)
    met_residual = all(r["residual_not_above_multinomial"] for r in rows if r["scheme"] == "residual")
    return {
        "ours": "var log Z, multinomial / residual / stratified / systematic: " + cell("ours", "var"),
        "anchor": "`particles` (same schemes, same model and data): " + cell("particles", "var"),
        "comparison": "ours / particles' variance per scheme: "
        + "; ".join(f"N = {r['N']} {r['scheme']} {f2(r['ratio_to_particles'])}" for r in rows if r["scheme"] == "residual"),
        "goal": "every scheme's variance matches `particles`' (3 combined SE); residual's no larger than multinomial's",
        "met": f"{yn(met_match and met_residual)} (match: {yn(met_match)}; residual <= multinomial: {yn(met_residual)})",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=400, help="filters per scheme and library")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    np.random.seed(0)
    T = 20 if args.quick else 100
    runs = 20 if args.quick else args.runs
    sizes = (50,) if args.quick else (50, 200)
    ys = simulate(T, seed=1)
    from particles import state_space_models as ssm

    fk = ssm.Bootstrap(ssm=particles_model(), data=ys.numpy())
    records, rows = [], []
    for n in sizes:
        results = {}
        for scheme in SCHEMES:
            mine, t_mine = ours(ys, n, runs, scheme)
            other, t_other = theirs(fk, n, runs, scheme, args)
            results[scheme] = {"ours": moments(mine), "particles": moments(other), "ours_s": t_mine, "particles_s": t_other}
        base_ours, base_theirs = results["multinomial"]["ours"], results["multinomial"]["particles"]
        for scheme, res in results.items():
            a, b = res["ours"], res["particles"]
            se = math.hypot(a["var_se"], b["var_se"])
            mean_z = (a["mean"] - b["mean"]) / math.hypot(a["mean_se"], b["mean_se"])
            rec = {
                "N": n,
                "scheme": scheme,
                **res,
                "ratio_to_particles": a["var"] / b["var"],
                "ours_over_multinomial": a["var"] / base_ours["var"],
                "particles_over_multinomial": b["var"] / base_theirs["var"],
                "match": abs(a["var"] - b["var"]) <= 3 * se,
                "means_agree": abs(mean_z) < 5,
                "mean_z": mean_z,
                "residual_not_above_multinomial": a["var"] <= base_ours["var"] + 3 * math.hypot(a["var_se"], base_ours["var_se"]),
            }
            records.append(rec)
            rows.append([n, scheme, a["var"], a["var_se"], b["var"], b["var_se"], rec["ratio_to_particles"], rec["ours_over_multinomial"],
                         rec["particles_over_multinomial"], mean_z, res["ours_s"], res["particles_s"]])
    print_table(
        ["N", "scheme", "var ours", "se", "var particles", "se", "ours / particles", "ours / multinomial", "particles / multinomial",
         "mean z", "ours s", "particles s"],
        rows,
        title=f"log Z variance over {runs} runs, stochastic volatility, T = {T}, bootstrap, ESS < N / 2, float64",
    )
    if not all(r["means_agree"] for r in records):
        print("WARNING: the two libraries' mean log Z disagree beyond 5 standard errors", file=sys.stderr)
    write_results(
        "resampling_schemes",
        {
            "settings": {"T": T, "runs": runs, "N": list(sizes), "ess_threshold": 0.5, "dtype": "float64", "model": "stochastic volatility (alpha 0.91, sigma 1, beta 0.5)"},
            "goal": "every scheme's variance matches particles' (3 combined SE); residual's no larger than multinomial's",
            "results": records,
            "median_time_ratio": statistics.median(r["ours_s"] / r["particles_s"] for r in records),
        },
        dtype=torch.float64,
        summary=summary_cells,
        scratch=args.quick,
    )


if __name__ == "__main__":
    main()
