"""PMMH against ``particles``' PMMH on the same model, with the exact posterior as the yardstick.

Model: AR(1) plus noise, ``x_1 ~ N(0, sigma^2 / (1 - rho^2))``, ``x_t = rho x_{t-1} + sigma v_t``,
``y_t = x_t + tau e_t`` with ``tau = 0.5`` known and ``(rho, sigma)`` unknown, priors
``rho ~ Uniform(-1, 1)`` and ``sigma ~ LogNormal(0, 1)``; ``T`` steps simulated at ``rho = 0.7``,
``sigma = 1``, float64. The exact posterior of ``(rho, sigma)`` comes from the Kalman likelihood on a
600 x 600 grid over ``(rho, log sigma)``.

Contenders, both a bootstrap filter with ``N`` particles and systematic resampling below an ESS of
``N / 2`` estimating the likelihood of an adaptive Gaussian random walk:

* ``particles``: ``particles.mcmc.PMMH(ssm_cls=..., prior=StructDist(...), data=ys, Nx=N,
  niter=warmup + samples)`` (Chopin's library, NumPy), its default adaptive random walk on the
  constrained ``(rho, sigma)`` (covariance tracked from the whole chain, scaled by ``2.38^2 / d``);
  the first ``warmup`` iterations are dropped.
* ``ours``: ``pyro.infer.MCMC(PMMH(model, num_particles=N), num_samples, warmup_steps).run(ys)``,
  the model a Pyro ``init``/``step`` program whose parameters are ``PyroSample`` attributes, the
  random walk in the unconstrained space, adapted during warm-up only; the filter's compiled step
  on (``compile=None``, the default).

Each repetition runs one chain of each, interleaved in one process, from the same starting
values (the prior medians, ``rho = 0``, ``sigma = 1``), seeds differing per repetition. Reported per
contender, median over repetitions: wall time of the whole chain (warm-up included), acceptance
rate after warm-up, effective sample size of each parameter after warm-up (``arviz.ess``, bulk,
the same estimator for both), ESS per second of the whole run, and the posterior error: the chain's
mean minus the exact mean, in exact posterior standard deviations, and its sd over the exact sd.

Run: ``python benchmarks/pmcmc/bench_pmmh_particles.py`` (about 5 minutes on an idle core;
``--quick``: a smoke run, about a minute; ``--scratch``: other settings, written to the scratch
folder). Results: ``results/pmcmc/pmmh_particles.json``.
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
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from pyro.nn import PyroModule, PyroSample

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, load_average, print_table, progress, setup, write_results  # noqa: E402
from pyro_smc.infer.pmcmc.pmmh import PMMH  # noqa: E402

TAU, RHO, SIGMA = 0.5, 0.7, 1.0
PARAMS = ("rho", "sigma")


class AR1(PyroModule):
    """The model as a Pyro program with static parameters (what a user writes)."""

    def __init__(self):
        super().__init__()
        self.rho = PyroSample(dist.Uniform(-1.0, 1.0))
        self.sigma = PyroSample(dist.LogNormal(0.0, 1.0))

    def init(self, state):
        state["x"] = pyro.sample("x0", dist.Normal(0.0, self.sigma / (1 - self.rho**2).sqrt()))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(self.rho * state["x"], self.sigma))
        pyro.sample("y", dist.Normal(state["x"], TAU), obs=y)


def particles_ar1():
    """The model in ``particles``' terms (its first state the stationary one, as ours); imported
    here, not at the top, so that the rest of the file runs without ``particles``."""
    import particles.distributions as pdist
    from particles import state_space_models as ssm

    class ParticlesAR1(ssm.StateSpaceModel):
        default_params = {"rho": RHO, "sigma": SIGMA}

        def PX0(self):
            return pdist.Normal(loc=0.0, scale=self.sigma / np.sqrt(1 - self.rho**2))

        def PX(self, t, xp):
            return pdist.Normal(loc=self.rho * xp, scale=self.sigma)

        def PY(self, t, xp, x):
            return pdist.Normal(loc=x, scale=TAU)

    return ParticlesAR1


def particles_pmmh(ys: np.ndarray, n: int, niter: int, seed: int):
    import particles.distributions as pdist
    from particles import mcmc
    from particles import smc_samplers as ssp

    ParticlesAR1 = particles_ar1()

    class Fixed(mcmc.PMMH):
        """``particles`` 0.4's PMMH writes the prior's log-density, a length-1 array, into a scalar
        slot: an error from NumPy 2.4 on. The same computation, the element taken."""

        def compute_post(self):
            self.prop.lpost[0] = self.prior.logpdf(self.prop.theta)[0]
            if np.isfinite(self.prop.lpost[0]):
                pf = self.alg_instance(ssp.rec_to_dict(self.prop.theta[0]))
                pf.run()
                self.prop.lpost[0] += pf.logLt

    prior = pdist.StructDist({"rho": pdist.Uniform(-1.0, 1.0), "sigma": pdist.LogNormal(0.0, 1.0)})
    theta0 = np.zeros(1, dtype=[("rho", float), ("sigma", float)])
    theta0["sigma"] = 1.0
    np.random.seed(seed)
    sampler = Fixed(ssm_cls=ParticlesAR1, prior=prior, data=ys, Nx=n, niter=niter, theta0=theta0)
    start = time.perf_counter()
    sampler.run()
    wall = time.perf_counter() - start
    return sampler, wall


def ours_pmmh(ys: torch.Tensor, n: int, warmup: int, samples: int, seed: int):
    pyro.set_rng_seed(seed)
    kernel = PMMH(AR1(), num_particles=n)
    mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, disable_progbar=True)
    start = time.perf_counter()
    mcmc.run(ys)
    wall = time.perf_counter() - start
    return mcmc, wall


def simulate(num_steps: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((), generator=gen, dtype=torch.float64) * SIGMA / math.sqrt(1 - RHO**2)
    ys = []
    for _ in range(num_steps):
        x = RHO * x + SIGMA * torch.randn((), generator=gen, dtype=torch.float64)
        ys.append(x + TAU * torch.randn((), generator=gen, dtype=torch.float64))
    return torch.stack(ys)


def kalman_log_likelihood(ys: torch.Tensor, rho: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Exact ``log p(y | rho, sigma)``, vectorised over a grid."""
    mean, var, total = torch.zeros_like(rho), sigma**2 / (1 - rho**2), torch.zeros_like(rho)
    for y in ys:
        s = var + TAU**2
        total = total - 0.5 * (math.log(2 * math.pi) + s.log() + (y - mean) ** 2 / s)
        gain = var / s
        mean, var = rho * (mean + gain * (y - mean)), rho**2 * (1 - gain) * var + sigma**2
    return total


def exact_posterior(ys: torch.Tensor, size: int = 600) -> dict:
    rho = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1
    log_sigma = torch.linspace(-3.0, 1.5, size, dtype=torch.float64)
    r, ls = torch.meshgrid(rho, log_sigma, indexing="ij")
    log_density = kalman_log_likelihood(ys, r, ls.exp()) - 0.5 * ls**2  # LogNormal(0, 1): N(0, 1) in log sigma
    w = (log_density - log_density.max()).exp()
    w = w / w.sum()
    out = {}
    for name, v in (("rho", r), ("sigma", ls.exp())):
        mean = float((w * v).sum())
        out[name] = {"mean": mean, "sd": float((w * (v - mean) ** 2).sum().sqrt())}
    return out


def chain_stats(draws: dict, wall: float, accept: float, exact: dict, names=PARAMS) -> dict:
    """ESS (``arviz.ess``, bulk), ESS per iteration and per second, and each posterior mean's and
    sd's error against the exact ones, for the quantities ``names`` of one chain."""
    import arviz as az

    rec = {"wall_s": wall, "acceptance": accept}
    for name in names:
        x = np.asarray(draws[name], dtype=float)
        ess = float(az.ess(x[None, :]))
        rec[name] = {
            "ess": ess,
            "ess_per_iteration": ess / len(x),
            "ess_per_s": ess / wall,
            "mean": float(x.mean()),
            "sd": float(x.std(ddof=1)),
            "mean_error_sds": (float(x.mean()) - exact[name]["mean"]) / exact[name]["sd"],
            "sd_ratio": float(x.std(ddof=1)) / exact[name]["sd"],
            # the Monte Carlo standard error of the mean, in posterior sds: 1 / sqrt(ESS)
            "mcse_sds": 1 / math.sqrt(ess),
        }
    return rec


def summarize(reps: list[dict]) -> dict:
    def med(key, name=None):
        return statistics.median(r[key] if name is None else r[name][key] for r in reps)

    out = {"wall_s": med("wall_s"), "acceptance": med("acceptance")}
    for name in PARAMS:
        out[name] = {k: med(k, name) for k in ("ess", "ess_per_s", "mean_error_sds", "sd_ratio")}
        out[name]["max_abs_mean_error_over_mcse"] = max(abs(r[name]["mean_error_sds"]) / r[name]["mcse_sds"] for r in reps)
    return out


def summary_cells(d: dict) -> dict:
    """This benchmark's row in the summary table of ``benchmarks/README.md`` (see ``_common.summary_record``)."""
    o, p = d["median"]["ours"], d["median"]["particles"]
    s = d["settings"]

    def ess_s(m):
        return "/".join(f"{m[n]['ess_per_s']:.2f}" for n in PARAMS)

    return {
        "ours": f"AR(1)+noise, (rho, sigma), T = {s['T']}, N = {s['N']}, {s['warmup']} + {s['samples']} iterations: "
        f"acceptance {o['acceptance']:.2f}, ESS/s (rho/sigma) {ess_s(o)}, {1e3 * o['wall_s'] / s['iterations']:.1f} ms/iteration",
        "anchor": f"`particles` PMMH: acceptance {p['acceptance']:.2f}, ESS/s {ess_s(p)}, {1e3 * p['wall_s'] / s['iterations']:.1f} ms/iteration",
        "comparison": "ESS/s ours / particles (rho/sigma): "
        + "/".join(f"{o[n]['ess_per_s'] / p[n]['ess_per_s']:.2f}x" for n in PARAMS)
        + "; |mean error| / MCSE, worst over repetitions: ours "
        + "/".join(f"{o[n]['max_abs_mean_error_over_mcse']:.1f}" for n in PARAMS)
        + ", particles "
        + "/".join(f"{p[n]['max_abs_mean_error_over_mcse']:.1f}" for n in PARAMS),
        "goal": "posterior means within 5 MCSE of the exact grid posterior; ESS/s reported against particles",
        "met": "yes" if all(o[n]["max_abs_mean_error_over_mcse"] < 5 for n in PARAMS) else "no",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--T", type=int, default=100)
    parser.add_argument("--N", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", action="store_true", help="a diagnostic run: results to the scratch folder, not results/")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    if args.quick:
        args.T, args.warmup, args.samples, args.repeats = 30, 100, 200, 1
    ys = simulate(args.T, seed=0)
    exact = exact_posterior(ys)
    niter = args.warmup + args.samples
    reps = {"particles": [], "ours": []}
    load_before = load_average()
    for rep in progress(range(args.repeats), "repetitions", args):
        sampler, wall = particles_pmmh(ys.numpy(), args.N, niter, seed=rep)
        draws = {n: sampler.chain.theta[n][args.warmup :] for n in PARAMS}
        accepted = float(np.mean(np.diff(sampler.chain.theta["rho"][args.warmup - 1 :]) != 0))
        reps["particles"].append(chain_stats(draws, wall, accepted, exact))
        mcmc, wall = ours_pmmh(ys, args.N, args.warmup, args.samples, seed=rep)
        draws = {n: v.numpy() for n, v in mcmc.get_samples().items()}
        reps["ours"].append(chain_stats(draws, wall, mcmc.diagnostics()["acceptance rate"]["chain 0"], exact))
        print(f"repetition {rep}: particles {reps['particles'][-1]['wall_s']:.1f} s, ours {reps['ours'][-1]['wall_s']:.1f} s", flush=True)
    median = {k: summarize(v) for k, v in reps.items()}
    rows = []
    for k in ("particles", "ours"):
        m = median[k]
        rows.append(
            [k, f2(1e3 * m["wall_s"] / niter), f2(m["acceptance"])]
            + [f"{m[n]['ess']:.0f}" for n in PARAMS]
            + [f2(m[n]["ess_per_s"]) for n in PARAMS]
            + [f"{m[n]['mean_error_sds']:+.3f}" for n in PARAMS]
            + [f2(m[n]["sd_ratio"]) for n in PARAMS]
        )
    headers = [
        "contender",
        "ms / iteration",
        "acceptance",
        "ESS rho",
        "ESS sigma",
        "ESS/s rho",
        "ESS/s sigma",
        "mean err rho (sd)",
        "mean err sigma (sd)",
        "sd ratio rho",
        "sd ratio sigma",
    ]
    print_table(headers, rows, title=f"PMMH, AR(1)+noise, T = {args.T}, N = {args.N}, {args.warmup} + {args.samples} iterations, median of {args.repeats}")
    print(f"exact posterior: {exact}; 1-min load average {load_before} -> {load_average()}")
    settings = {"T": args.T, "N": args.N, "warmup": args.warmup, "samples": args.samples, "iterations": niter, "repeats": args.repeats}
    write_results("pmmh_particles", chain_payload(settings, exact, reps, median, load_before), summary=summary_cells, scratch=args.scratch)


def chain_payload(settings: dict, exact: dict, reps: list, median: dict, load_before: float) -> dict:
    """The result file's content of a chain benchmark (this one and ``bench_particle_gibbs.py``):
    its settings, the exact posterior, every repetition, the medians and the machine's load."""
    return {"settings": settings, "exact": exact, "repetitions": reps, "median": median,
            "load_average_before": load_before, "load_average_after": load_average()}


if __name__ == "__main__":
    main()
