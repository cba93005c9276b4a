"""Particle Gibbs against ``particles``' particle Gibbs on the same model, with the exact posterior as the yardstick.

Model: the AR(1) plus noise of ``bench_pmmh_particles.py``, ``x_1 ~ N(0, sigma^2 / (1 - rho^2))``,
``x_t = rho x_{t-1} + sigma v_t``, ``y_t = x_t + tau e_t``, ``tau = 0.5`` known, ``(rho, sigma)``
unknown with priors ``rho ~ Uniform(-1, 1)``, ``sigma ~ LogNormal(0, 1)``; ``T`` steps simulated at
``rho = 0.7``, ``sigma = 1``, float64. Exact posterior: the Kalman likelihood on a 600 x 600 grid
over ``(rho, log sigma)`` for the parameters, and, for the state ``x_25`` (the 25th of the path,
index 24 of ``get_samples()["x"]``), the grid average of the Kalman (RTS) smoother's mean and
variance at each grid point.

Contenders, all ``N`` particles, bootstrap conditional SMC, the parameters moved by a Gaussian random
walk in ``(atanh rho, log sigma)``:

* ``particles``: Chopin's ``particles.mcmc.ParticleGibbs`` (NumPy) with its conditional SMC
  (``mcmc.CSMC``) and backward sampling (``backward_step=True``, the same law of the path update
  as ancestor sampling for a state-space model), its ``update_theta`` written here: ``K`` random-walk
  steps on the exact ``p(theta | x)``, the step size tuned towards a 0.3 acceptance rate during
  warm-up (a diagonal walk: the library has no adaptive one for particle Gibbs).
* ``ours``: ``MCMC(ParticleGibbs(model, N, num_mh_steps=K), ...)``, the adaptive random walk of
  ``proposals.py`` (covariance and scale, warm-up only); the ``K`` steps score the path in one
  batched run of the model's ``step``.
* ``ours + nc``: the same with one non-centred (interweaving) step per sweep
  (``noncentred_steps=1``): the parameters move with the path's noise held.

All start at the prior medians (``rho = 0``, ``sigma = 1``), ``K = 5``; each repetition runs one chain
of each contender, interleaved in one process, seeds differing per repetition. Reported, median
over repetitions: wall time per iteration, acceptance rate, ESS (``arviz.ess``, bulk) of ``rho``,
``sigma`` and ``x_25`` after warm-up, ESS per iteration and per second of the whole run, and the
error of each posterior mean in exact posterior sds, with its worst ratio to the Monte Carlo
standard error ``sd / sqrt(ESS)`` over repetitions (goal: below 5).

Run: ``python benchmarks/pmcmc/bench_particle_gibbs.py`` (about 9 minutes on a shared 2-core machine;
``--quick``: a smoke run; ``--scratch``: other settings, written to the scratch folder). Results:
``results/pmcmc/particle_gibbs.json``.
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
from pyro.infer import MCMC

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, load_average, print_table, progress, setup, write_results  # noqa: E402
from benchmarks.pmcmc.bench_pmmh_particles import AR1, TAU, chain_payload, chain_stats, kalman_log_likelihood, particles_ar1, simulate  # noqa: E402
from pyro_smc.infer.pmcmc.gibbs import ParticleGibbs  # noqa: E402

PARAMS = ("rho", "sigma")
QUANTITIES = ("rho", "sigma", "x_25")
STATE = 24  # x_25, 1-based: the 25th state of the path
CONTENDERS = ("particles", "ours", "ours + nc")


def exact_posterior(ys: torch.Tensor, size: int = 600) -> dict:
    """Posterior means and sds of rho, sigma and x_25 on a grid over (rho, log sigma)."""
    rho = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1
    log_sigma = torch.linspace(-3.0, 1.5, size, dtype=torch.float64)
    r, ls = torch.meshgrid(rho, log_sigma, indexing="ij")
    log_density = kalman_log_likelihood(ys, r, ls.exp()) - 0.5 * ls**2  # LogNormal(0, 1): N(0, 1) in log sigma
    w = (log_density - log_density.max()).exp()
    w = w / w.sum()
    mean_x, var_x = smoother_moments(ys, r, ls.exp(), STATE)
    out = {}
    for name, v, extra_var in (("rho", r, 0.0), ("sigma", ls.exp(), 0.0), ("x_25", mean_x, var_x)):
        mean = float((w * v).sum())
        out[name] = {"mean": mean, "sd": float((w * ((v - mean) ** 2 + extra_var)).sum().sqrt())}
    return out


def smoother_moments(ys: torch.Tensor, rho: torch.Tensor, sigma: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The RTS smoother's mean and variance of the state observed by ``ys[index]``, on a grid."""
    mean, var = torch.zeros_like(rho), sigma**2 / (1 - rho**2)  # the predictive law of the first state
    filtered, predicted = [], []
    for y in ys:
        predicted.append((mean, var))
        s = var + TAU**2
        gain = var / s
        mean, var = mean + gain * (y - mean), (1 - gain) * var
        filtered.append((mean, var))
        mean, var = rho * mean, rho**2 * var + sigma**2
    mean, var = filtered[-1]
    for t in range(len(ys) - 2, index - 1, -1):
        fm, fv = filtered[t]
        pm, pv = predicted[t + 1]
        gain = fv * rho / pv
        mean, var = fm + gain * (mean - pm), fv + gain**2 * (var - pv)
    return mean, var


def particles_gibbs(ys: np.ndarray, n: int, warmup: int, samples: int, num_mh_steps: int, seed: int):
    import particles.distributions as pdist
    from particles import mcmc

    ParticlesAR1 = particles_ar1()

    rng = np.random.default_rng(seed)

    def log_target(u: np.ndarray, x: np.ndarray) -> float:
        """log p(theta | x) in u = (atanh rho, log sigma), Jacobian included."""
        rho, sigma = math.tanh(u[0]), math.exp(u[1])
        sd0 = sigma / math.sqrt(1 - rho**2)
        out = -0.5 * (x[0] / sd0) ** 2 - math.log(sd0)
        out += float(np.sum(-0.5 * ((x[1:] - rho * x[:-1]) / sigma) ** 2)) - (len(x) - 1) * math.log(sigma)
        return out + math.log(1 - rho**2) - 0.5 * u[1] ** 2  # U(-1, 1) and N(0, 1) in log sigma, with Jacobians

    class Gibbs(mcmc.ParticleGibbs):
        """``update_theta``: random-walk Metropolis-Hastings on the exact conditional."""

        scale, accepted, tried, it = 0.5, 0, 0, 0

        def update_theta(self, theta, x):
            xs = np.asarray(x, dtype=float).reshape(-1)
            u = np.array([math.atanh(float(theta["rho"])), math.log(float(theta["sigma"]))])
            current = log_target(u, xs)
            self.it += 1
            for _ in range(num_mh_steps):
                proposed = u + self.scale * rng.standard_normal(2)
                value = log_target(proposed, xs) if abs(proposed[0]) < 18 else -math.inf
                prob = min(1.0, math.exp(min(value - current, 0.0)))
                if rng.uniform() < prob:
                    u, current = proposed, value
                if self.it <= warmup:  # Robbins-Monro on the log scale, warm-up only
                    self.scale *= math.exp((prob - 0.3) / math.sqrt(self.it))
                else:
                    self.accepted += prob > 0 and bool(np.array_equal(u, proposed))
                    self.tried += 1
            new = theta.copy()
            new["rho"], new["sigma"] = math.tanh(u[0]), math.exp(u[1])
            return new

    prior = pdist.StructDist({"rho": pdist.Uniform(-1.0, 1.0), "sigma": pdist.LogNormal(0.0, 1.0)})
    theta0 = np.zeros(1, dtype=[("rho", float), ("sigma", float)])
    theta0["sigma"] = 1.0
    np.random.seed(seed)
    sampler = Gibbs(ssm_cls=ParticlesAR1, prior=prior, data=list(ys), Nx=n, niter=warmup + samples, theta0=theta0[0], backward_step=True, store_x=True)
    start = time.perf_counter()
    sampler.run()
    wall = time.perf_counter() - start
    draws = {name: np.asarray(sampler.chain.theta[name][warmup:], dtype=float) for name in PARAMS}
    draws["x_25"] = np.asarray([np.asarray(path[STATE]).reshape(()) for path in sampler.chain.x[warmup:]], dtype=float)
    return draws, wall, sampler.accepted / max(sampler.tried, 1)


def ours_gibbs(ys: torch.Tensor, n: int, warmup: int, samples: int, num_mh_steps: int, noncentred_steps: int, seed: int):
    pyro.set_rng_seed(seed)
    kernel = ParticleGibbs(AR1(), num_particles=n, num_mh_steps=num_mh_steps, noncentred_steps=noncentred_steps)
    mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, disable_progbar=True)
    start = time.perf_counter()
    mcmc.run(ys)
    wall = time.perf_counter() - start
    got = mcmc.get_samples()
    draws = {name: got[name].numpy() for name in PARAMS}
    draws["x_25"] = got["x"][:, STATE].numpy()
    return draws, wall, mcmc.diagnostics()["acceptance rate"]["chain 0"]


def summarize(reps: list[dict]) -> dict:
    def med(key, name=None):
        return statistics.median(r[key] if name is None else r[name][key] for r in reps)

    out = {"wall_s": med("wall_s"), "acceptance": med("acceptance")}
    for name in QUANTITIES:
        out[name] = {k: med(k, name) for k in ("ess", "ess_per_iteration", "ess_per_s", "mean_error_sds", "sd_ratio")}
        out[name]["max_abs_mean_error_over_mcse"] = max(abs(r[name]["mean_error_sds"]) / r[name]["mcse_sds"] for r in reps)
    return out


def summary_cells(d: dict) -> dict:
    """This benchmark's row in the summary table of ``benchmarks/README.md`` (see ``_common.summary_record``)."""
    s = d["settings"]
    runs = d["median"]

    def ess_s(m):
        return "/".join(f"{m[q]['ess_per_s']:.1f}" for q in QUANTITIES)

    def describe(label):
        return "; ".join(f"N = {n}: ESS/s (rho/sigma/x_25) {ess_s(runs[str(n)][label])}" for n in s["N"])

    worst = {label: max(runs[str(n)][label][q]["max_abs_mean_error_over_mcse"] for n in s["N"] for q in QUANTITIES) for label in CONTENDERS}
    ratios = "; ".join(
        f"N = {n}: " + "/".join(f"{runs[str(n)]['ours + nc'][q]['ess_per_s'] / runs[str(n)]['particles'][q]['ess_per_s']:.2f}x" for q in QUANTITIES)
        for n in s["N"]
    )
    return {
        "ours": f"AR(1)+noise, T = {s['T']}, {s['warmup']} + {s['samples']} sweeps, K = {s['num_mh_steps']}: ours {describe('ours')}; "
        f"ours + non-centred {describe('ours + nc')}",
        "anchor": f"`particles` ParticleGibbs (backward sampling): {describe('particles')}",
        "comparison": f"ESS/s ours + non-centred / particles (rho/sigma/x_25): {ratios}; |mean error| / MCSE, worst: "
        + ", ".join(f"{label} {worst[label]:.1f}" for label in CONTENDERS),
        "goal": "posterior means of rho, sigma, x_25 within 5 MCSE of the exact (grid + Kalman) posterior; ESS/s reported against particles",
        "met": "yes" if worst["ours"] < 5 and worst["ours + nc"] < 5 else "no",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--T", type=int, default=50)
    parser.add_argument("--N", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--num-mh-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scratch", action="store_true", help="a diagnostic run: results to the scratch folder, not results/")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    if args.quick:
        args.T, args.N, args.warmup, args.samples, args.repeats = 30, [10], 50, 100, 1  # T > 25: x_25 is reported
    ys = simulate(args.T, seed=0)
    exact = exact_posterior(ys)
    iterations = args.warmup + args.samples
    load_before = load_average()
    reps: dict = {str(n): {label: [] for label in CONTENDERS} for n in args.N}
    for rep in progress(range(args.repeats), "repetitions", args):
        for n in args.N:
            out = reps[str(n)]
            draws, wall, accept = particles_gibbs(ys.numpy(), n, args.warmup, args.samples, args.num_mh_steps, seed=rep)
            out["particles"].append(chain_stats(draws, wall, accept, exact, QUANTITIES))
            draws, wall, accept = ours_gibbs(ys, n, args.warmup, args.samples, args.num_mh_steps, 0, seed=rep)
            out["ours"].append(chain_stats(draws, wall, accept, exact, QUANTITIES))
            draws, wall, accept = ours_gibbs(ys, n, args.warmup, args.samples, args.num_mh_steps, 1, seed=rep)
            out["ours + nc"].append(chain_stats(draws, wall, accept, exact, QUANTITIES))
            walls = ", ".join(f"{label} {out[label][-1]['wall_s']:.1f} s" for label in CONTENDERS)
            print(f"repetition {rep}, N = {n}: {walls}", flush=True)
    median = {n: {label: summarize(v) for label, v in by.items()} for n, by in reps.items()}
    rows = []
    for n in args.N:
        for label in CONTENDERS:
            m = median[str(n)][label]
            rows.append(
                [n, label, f2(1e3 * m["wall_s"] / iterations), f2(m["acceptance"])]
                + [f"{m[q]['ess']:.0f}" for q in QUANTITIES]
                + [f"{m[q]['ess_per_iteration']:.3f}" for q in QUANTITIES]
                + [f2(m[q]["ess_per_s"]) for q in QUANTITIES]
                + [f"{m[q]['max_abs_mean_error_over_mcse']:.1f}" for q in QUANTITIES]
            )
    headers = ["N", "contender", "ms / iteration", "acceptance"]
    headers += [f"ESS {q}" for q in QUANTITIES] + [f"ESS/it {q}" for q in QUANTITIES] + [f"ESS/s {q}" for q in QUANTITIES]
    headers += [f"max |err|/MCSE {q}" for q in QUANTITIES]
    print_table(headers, rows, title=f"Particle Gibbs, AR(1)+noise, T = {args.T}, {args.warmup} + {args.samples} sweeps, median of {args.repeats}")
    print(f"exact posterior: {exact}; 1-min load average {load_before} -> {load_average()}")
    settings = {"T": args.T, "N": args.N, "warmup": args.warmup, "samples": args.samples, "iterations": iterations,
                "num_mh_steps": args.num_mh_steps, "repeats": args.repeats}
    write_results("particle_gibbs", chain_payload(settings, exact, reps, median, load_before), summary=summary_cells, scratch=args.scratch)


if __name__ == "__main__":
    main()
