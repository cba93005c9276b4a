"""SMC^2 against `particles`' SMC2 on a model with an exact posterior: time per step and errors.

The model (``_ar1.py``): x_0 ~ N(0, 1), x_t = rho x_{t-1} + N(0, 1), y_t = x_t + N(0, 0.5^2),
T = 50 steps simulated at rho = 0.7; the unknown rho has a Uniform(-1, 1) prior. The exact
posterior mean and sd of rho and log p(y_{1:T}) come from Kalman likelihoods on a grid of 4001
points.

Contenders, the same settings (bootstrap inner filters with systematic resampling at ESS < N_x/2,
resample-move of the parameter particles at ESS < N_theta/2, 5 random-walk Metropolis-Hastings
moves scaled 2.38/sqrt(d) times the particles' covariance, after each resampling):

* ``SMC2``: ``pyro_smc.infer.smc2.SMC2(model, num_parameter_particles=M, num_particles=N,
  rejuvenation_steps=5)``, the N_theta filters one batched ``SMC``;
* ``particles``: ``particles.SMC(fk=particles.smc_samplers.SMC2(ssm_cls, prior, data,
  init_Nx=N, wastefree=False, len_chain=6), N=M, ESSrmin=0.5)``, one ``particles.SMC`` per
  parameter particle (its random walk moves rho itself, ours moves it on the unconstrained scale
  ``atanh``-like transform of the prior's support; both are valid MCMC moves of the same target).

For every (N_theta, N_x) in (200, 500) x (50, 100) the two run interleaved (``timeit_interleaved``),
and each timed run's estimates are kept: the errors are over those runs (``--repeats``; the biggest
sizes run once, as particles takes minutes there).

Run: ``OMP_NUM_THREADS=1 python benchmarks/smc2/bench_smc2.py`` (``--quick``: a smoke run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ar1 import AR1, exact_posterior, simulate  # noqa: E402

from benchmarks._common import add_common_args, f2, f3, print_table, ratio, setup, slash, timeit_interleaved, write_results, yn  # noqa: E402
from pyro_smc.infer.smc2.engine import SMC2  # noqa: E402

MOVES = 5
# the Monte Carlo sds of tests/infer/smc2/test_engine.py: posterior mean (times sd / sqrt(N_theta)), log Z
KAPPA_MEAN, SD_LOG_EVIDENCE = 2.0, 0.25


def particles_model():
    from particles import distributions as pdist
    from particles import state_space_models as ssm

    class AR1Noise(ssm.StateSpaceModel):
        """The same model, x_0 integrated out of the first step: x_1 ~ N(0, rho^2 + 1)."""

        default_params = {"rho": 0.7, "sigma": 0.5}

        def PX0(self):
            return pdist.Normal(scale=np.sqrt(self.rho**2 + 1.0))

        def PX(self, t, xp):
            return pdist.Normal(loc=self.rho * xp, scale=1.0)

        def PY(self, t, xp, x):
            return pdist.Normal(loc=x, scale=self.sigma)

    return AR1Noise, pdist.StructDist({"rho": pdist.Uniform(-1.0, 1.0)})


def run_particles(ys: np.ndarray, m: int, n: int, seed: int) -> dict:
    import particles
    from particles.smc_samplers import SMC2 as ParticlesSMC2

    ssm_cls, prior = particles_model()
    np.random.seed(seed)
    fk = ParticlesSMC2(ssm_cls=ssm_cls, prior=prior, data=ys, init_Nx=n, wastefree=False, len_chain=MOVES + 1)
    alg = particles.SMC(fk=fk, N=m, ESSrmin=0.5, collect=None, verbose=False)
    alg.run()
    theta, w = alg.X.theta["rho"], alg.W
    mean = float(np.sum(w * theta))
    return {"mean": mean, "sd": float(np.sqrt(np.sum(w * (theta - mean) ** 2))), "log_evidence": float(alg.logLt)}


def run_ours(ys: torch.Tensor, m: int, n: int, seed: int) -> dict:
    pyro.set_rng_seed(seed)
    smc2 = SMC2(AR1("rho"), num_parameter_particles=m, num_particles=n, rejuvenation_steps=MOVES, progress_bar=False).run(ys)
    out = smc2.result
    return {
        "mean": float(smc2.posterior_mean()["rho"]),
        "sd": float(smc2.posterior_variance()["rho"].sqrt()),
        "log_evidence": float(smc2.log_evidence),
        "rejuvenations": int(out.rejuvenated.sum()),
        "acceptance": float(out.acceptance_rates[out.rejuvenated].mean()),
    }


def errors(runs: list[dict], exact: dict) -> dict:
    """Root-mean-square errors over the runs: the mean and sd in posterior sds, log Z in nats."""
    rms = lambda xs: math.sqrt(statistics.fmean(x * x for x in xs))  # noqa: E731
    return {
        "mean_error_sd": rms([(r["mean"] - exact["mean"]) / exact["sd"] for r in runs]),
        "sd_error_sd": rms([(r["sd"] - exact["sd"]) / exact["sd"] for r in runs]),
        "log_evidence_error": rms([r["log_evidence"] - exact["log_evidence"] for r in runs]),
        "runs": runs,
    }


def within(found: dict, m: int) -> bool:
    """Whether RMS errors are within 5 Monte Carlo sds (those measured by the SMC2 tests at
    N_theta = 200, N_x = 50, T = 30, and scaled by 1 / sqrt(N_theta) for the mean)."""
    return found["mean_error_sd"] < 5 * KAPPA_MEAN / math.sqrt(m) and found["log_evidence_error"] < 5 * SD_LOG_EVIDENCE


def summary_cells(d: dict) -> dict:
    rows = d["rows"]
    sizes = slash([f"({r['M']}, {r['N']})" for r in rows], str)
    return {
        "ours": f"AR(1)+noise, rho unknown, T = {d['settings']['T']}, (N_theta, N_x) = {sizes}: "
        f"{slash([r['ours_ms_per_step'] for r in rows], f2)} ms per step; posterior-mean RMSE "
        f"{slash([r['ours']['mean_error_sd'] for r in rows], f3)} posterior sds, log Z RMSE "
        f"{slash([r['ours']['log_evidence_error'] for r in rows], f3)}",
        "anchor": f"`particles` SMC2 {slash([r['particles_ms_per_step'] for r in rows], f2)} ms per step; "
        f"mean RMSE {slash([r['particles']['mean_error_sd'] for r in rows], f3)} sds, "
        f"log Z RMSE {slash([r['particles']['log_evidence_error'] for r in rows], f3)}",
        "comparison": f"time ours / particles {slash([r['ratio'] for r in rows], ratio)}",
        "goal": d["goal"],
        "met": f"faster at every size: {yn(all(r['ratio'] < 1 for r in rows))}; within 5 Monte Carlo sds of the exact answer "
        f"(mean: 5 x {KAPPA_MEAN} / sqrt(N_theta) posterior sds, log Z: 5 x {SD_LOG_EVIDENCE} nats): {yn(all(within(r['ours'], r['M']) for r in rows))}",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved timed runs at N_theta = 200 (1 at 500)")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    num_steps = 20 if args.quick else 50
    sizes = [(100, 20)] if args.quick else [(200, 50), (200, 100), (500, 50), (500, 100)]
    ys = simulate(num_steps, 0)
    mean, sd, log_evidence = exact_posterior(ys, "rho")
    exact = {"mean": float(mean[-1]), "sd": float(sd[-1]), "log_evidence": float(log_evidence[-1])}
    run_ours(ys[:5], 20, 10, 0)  # the inner filters' step recording, kept with the model
    rows = []
    for m, n in sizes:
        repeats = 1 if args.quick or m >= 500 else args.repeats
        found = {"ours": [], "particles": []}
        seeds = iter(range(1000))

        def ours(m=m, n=n, found=found, seeds=seeds):
            found["ours"].append(run_ours(ys, m, n, next(seeds)))

        def theirs(m=m, n=n, found=found, seeds=seeds):
            found["particles"].append(run_particles(ys.numpy(), m, n, next(seeds)))

        start = time.perf_counter()
        timing = timeit_interleaved({"ours": ours, "particles": theirs}, repeats=repeats, warmup=0)
        row = {
            "M": m,
            "N": n,
            "repeats": repeats,
            "ours_ms_per_step": 1e3 * timing["ours"]["median_s"] / num_steps,
            "particles_ms_per_step": 1e3 * timing["particles"]["median_s"] / num_steps,
            "ours": errors(found["ours"], exact),
            "particles": errors(found["particles"], exact),
            "wall_s": time.perf_counter() - start,
        }
        row["ratio"] = row["ours_ms_per_step"] / row["particles_ms_per_step"]
        rows.append(row)
        print(f"(M, N) = ({m}, {n}): ours {row['ours_ms_per_step']:.1f} ms/step, particles {row['particles_ms_per_step']:.1f} ms/step", flush=True)
    print_table(
        [
            "N_theta",
            "N_x",
            "ours ms/step",
            "particles ms/step",
            "ratio",
            "ours mean err (sd)",
            "particles mean err (sd)",
            "ours logZ err",
            "particles logZ err",
        ],
        [
            [
                r["M"],
                r["N"],
                r["ours_ms_per_step"],
                r["particles_ms_per_step"],
                r["ratio"],
                r["ours"]["mean_error_sd"],
                r["particles"]["mean_error_sd"],
                r["ours"]["log_evidence_error"],
                r["particles"]["log_evidence_error"],
            ]
            for r in rows
        ],
        title=f"SMC^2 on AR(1)+noise, rho unknown, T = {num_steps} (exact: mean {exact['mean']:.4f}, sd {exact['sd']:.4f}, log Z {exact['log_evidence']:.3f})",
    )
    write_results(
        "smc2",
        {
            "settings": {"model": "AR(1)+noise", "unknown": "rho", "T": num_steps, "moves": MOVES, "ess_threshold": 0.5, "dtype": "float64"},
            "goal": "faster than particles' SMC2 at every size; posterior and log Z within Monte Carlo error of the exact answer",
            "exact": exact,
            "rows": rows,
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
