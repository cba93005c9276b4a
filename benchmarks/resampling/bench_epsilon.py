"""How epsilon trades bias, gradient spread and time for OT resampling on the sharp AR(1).

The README's AR(1) (observation sd 0.3 against a stationary state sd of 1.7, T = 100, data
seed 0), 100 independent runs of N = 100 particles in float32 at theta = 0.8, its exact MLE
region; the exact log-likelihood and score come from the Kalman filter in float64. Each run gets
its own copy of theta, so one vectorised pass gives 100 per-run gradients.

    python benchmarks/resampling/bench_epsilon.py            # about 10 minutes on 2 cores
    python benchmarks/resampling/bench_epsilon.py --quick    # 20 runs, T = 30

Writes ``benchmarks/results/resampling/bench_epsilon.json`` (``--quick``: a scratch file, see
``benchmarks/_common.py``). The model is ``_sharp_ar1.py`` beside this script.
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import generic_cells, write_results
from benchmarks.resampling._sharp_ar1 import per_run_gradients, simulate
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
from pyro_smc.resamplers import OTResampler


def exact(ys: torch.Tensor, theta: float) -> tuple[float, float]:
    one = torch.ones(1, 1, dtype=torch.float64)
    th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    ll = LinearGaussianSSM(th * one, one, one, 0.09 * one, torch.zeros(1, dtype=torch.float64), one).log_evidence(ys.reshape(-1, 1))
    (grad,) = torch.autograd.grad(ll, th)
    return float(ll.detach()), float(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--theta", type=float, default=0.8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs, steps = (20, 30) if args.quick else (100, 100)
    ys = simulate(steps, seed=0)
    log_lik, score = exact(ys, args.theta)
    results = {}
    for eps in args.epsilons:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SinkhornConvergenceWarning)
            start = time.perf_counter()
            grads, smc = per_run_gradients(ys.float(), OTResampler(eps), runs, 100, seed=7, theta=args.theta)
            seconds = time.perf_counter() - start
        grads, log_z = grads.double(), smc.log_evidence.detach().double()
        errors = (grads - score).abs()
        row = {
            "mean_grad": float(grads.mean()),
            "sd_grad": float(grads.std()),
            "bias": float(grads.mean() - score),
            "median_abs_error": float(errors.median()),
            "q99_abs_error": float(errors.quantile(0.99)),
            "nonfinite_runs": int((~torch.isfinite(grads)).sum()),
            "log_z_gap_mean": float(log_z.mean() - log_lik),
            "log_z_sd": float(log_z.std()),
            "ms_per_run": 1000 * seconds / runs,
            "convergence_warnings": sum(issubclass(w.category, SinkhornConvergenceWarning) for w in caught),
        }
        results[str(eps)] = row
        print(f"epsilon {eps:5.2f}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    settings = {"runs": runs, "T": steps, "num_particles": 100, "dtype": "float32", "theta": args.theta, "seed": 7, "data_seed": 0}
    write_results("bench_epsilon", {"settings": settings, "exact": {"log_likelihood": log_lik, "score": score}, "results": results},
                  summary=generic_cells)


if __name__ == "__main__":
    main()
