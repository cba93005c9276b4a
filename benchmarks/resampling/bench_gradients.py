"""Per-run error of the SMC score d log Z_hat / d theta against the exact (Kalman) score, per resampler.

Issue 11 ("Measure"). For each model, evaluation point theta, filter dtype and resampler, ``R``
independent runs (default 500) of ``SMC(num_particles=N, ess_threshold=0.5)`` (N = 100 by default)
each give one gradient ``g`` of their ``log Z_hat`` with respect to theta; it is compared with the
exact score ``s = d log p(y_{1:T}) / d theta``, autograd through ``pyro_smc.ops.kalman.kalman_filter``
in float64 (always float64, whatever the filter's dtype).

Models (data simulated once, in float64, from ``--data-seed``):

* ``ar1``: the README's sharp AR(1): ``x_1 ~ N(0, 1)``, ``x_t = theta x_{t-1} + N(0, 1)``,
  ``y_t ~ N(x_t, 0.3^2)``, T = 100, data at theta = 0.8; gradients at theta = 0.2 (the README's
  start value; exact score 166.07 for data seed 0, the issue's 166) and at 0.8.
* ``paper``: the 2-d linear-Gaussian model of Corenflos et al. (2021) as in
  ``tests/infer/paper_model.py`` and ``python -m pyro_smc``: ``A = diag(theta)``, Q = I, C = I,
  R = 0.1 I, ``x_1 ~ N(0, I)``, T = 150, data at theta = (0.5, 0.5); gradient with respect to both
  entries of theta at (0.5, 0.5). Its error is the Euclidean norm ``|g - s|`` of the 2-vector.

Resamplers: ``OTResampler(epsilon=0.5)`` with ``gradient="implicit"`` (default), ``"unroll"`` and
``"last_step"`` (scaling 0.75, threshold 1e-3, max_iter 100), ``SoftResampler(0.5)``,
``SystematicResampler()``. Filter dtypes float32 and float64.

Runs are batched: one ``SMC(num_filters=B)`` holds B independent filters and each filter has its
own copy of theta (a leaf tensor of shape ``(B, 1)``, ``(B, 1, 2)`` for ``paper``, used as
``theta * state["x"]``), so ``torch.autograd.grad(smc.log_evidence.sum(), theta)`` gives the B
per-run gradients in one backward pass. Batch ``k`` of a configuration draws its random numbers
from ``pyro.set_rng_seed(seed + k)``; a run is identified by ``(seed + k, B, index in batch)`` and is
reproducible from those (with the same batch size).

Reported per configuration: median, 90th, 99th percentile and max of ``|g - s|``, the number of
non-finite runs, mean and sd of ``g`` (bias and spread separately), q99 / median, the fraction of
(step, filter) pairs at which resampling happened, wall time (forward + backward, all runs), and the
5 worst runs with their seeds. Runs with a non-finite gradient or an error above 100x the
configuration's median error are re-run one by one (``--no-diagnose`` to skip): a bisection over
``t`` of ``d log Z_hat_t / d theta`` finds the first step whose cumulative error exceeds that bound.

Goal (issue 11): for every (model, theta, dtype), OT implicit's q99 error <= 2x its median error,
no non-finite runs, and its median error the lowest of the five resamplers.

Run: ``python benchmarks/resampling/bench_gradients.py --workers 2`` (``--quick``: 50 runs, T = 30, AR(1) at
theta = 0.2 only, about 35 s). Results go to ``results/bench_gradients.json``,
rewritten after every configuration (``"finished": false`` until the end); ``--resume`` keeps the
configurations of that file that were run with the same settings and batch size and runs the rest.
Filters per SMC call (``--batches``) are set per resampler by memory: the autograd graph of a whole
run is held until its backward pass (last_step: ~0.15 GB per filter, float64, T = 150).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, generic_cells, print_table, progress, result_path, setup, write_results
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.kalman import kalman_filter
from pyro_smc.resamplers import OTResampler, SoftResampler, SystematicResampler

try:  # may not exist in every version of the library
    from pyro_smc.ops.sinkhorn import SinkhornConvergenceWarning
except ImportError:  # pragma: no cover
    SinkhornConvergenceWarning = None

RESAMPLERS = ("ot_implicit", "ot_unroll", "ot_last_step", "soft", "systematic")
# Filters per SMC call. The autograd graph of a run is held until its backward pass: measured peak
# memory per filter for the paper model (T = 150, float64) is ~0.15 GB for last_step, ~0.02 GB for
# implicit (a first full run at 250 filters per call had last_step killed for memory at 19.7 GB).
DEFAULT_BATCH = {"ot_implicit": 100, "ot_unroll": 20, "ot_last_step": 20, "soft": 500, "systematic": 500}
OUTLIER_FACTOR = 100.0  # a run whose error exceeds this times its configuration's median is diagnosed


def make_resampler(name: str, epsilon: float):
    if name.startswith("ot_"):
        return OTResampler(epsilon=epsilon, gradient=name[3:])
    if name == "soft":
        return SoftResampler(0.5)
    if name == "systematic":
        return SystematicResampler()
    raise ValueError(name)


def describe_resampler(name: str, epsilon: float) -> str:
    if name.startswith("ot_"):
        return f"OTResampler(epsilon={epsilon}, scaling=0.75, threshold=1e-3, max_iter=100, gradient={name[3:]!r})"
    return {"soft": "SoftResampler(0.5)", "systematic": "SystematicResampler()"}[name]


# --------------------------------------------------------------------------------------------------
# models: plain classes holding one copy of theta per filter


class _TimeIndexed:
    """Holds theta and counts the time steps (sites are named ``x_t`` / ``y_t``)."""

    def __init__(self, theta: torch.Tensor):
        self.theta = theta
        self.t = 0

    def init(self, state):
        self.t = 0


class AR1(_TimeIndexed):
    """``x_1 ~ N(0, 1)``, ``x_t = theta x_{t-1} + N(0, 1)``, ``y_t ~ N(x_t, 0.3^2)``; theta ``(B, 1)``."""

    def step(self, state, y=None):
        loc = self.theta * state["x"] if self.t else torch.zeros((), dtype=self.theta.dtype)
        state["x"] = pyro.sample(f"x_{self.t}", dist.Normal(loc, 1.0))
        pyro.sample(f"y_{self.t}", dist.Normal(state["x"], 0.3), obs=y)
        self.t += 1


class PaperModel(_TimeIndexed):
    """``x_1 ~ N(0, I)``, ``x_t = diag(theta) x_{t-1} + N(0, I)``, ``y_t = x_t + N(0, 0.1 I)``; theta ``(B, 1, 2)``."""

    def step(self, state, y=None):
        if self.t:
            x = pyro.sample(f"x_{self.t}", dist.Normal(self.theta * state["x"], 1.0).to_event(1))
        else:
            x = pyro.sample(f"x_{self.t}", dist.Normal(torch.zeros(2, dtype=self.theta.dtype), 1.0).to_event(1))
        state["x"] = x
        pyro.sample(f"y_{self.t}", dist.Normal(x, 0.1**0.5).to_event(1), obs=y)
        self.t += 1


def ssm(name: str, theta) -> LinearGaussianSSM:
    f64 = torch.float64
    if name == "ar1":
        one = torch.ones(1, 1, dtype=f64)
        return LinearGaussianSSM(float(theta) * one, one, one, 0.09 * one, torch.zeros(1, dtype=f64), one)
    eye = torch.eye(2, dtype=f64)
    return LinearGaussianSSM(torch.diag(torch.as_tensor(theta, dtype=f64)), eye, eye, 0.1 * eye, torch.zeros(2, dtype=f64), eye)


MODELS = {
    # name: model class, parameter dim, data-generating theta, T (30 with --quick)
    "ar1": {"cls": AR1, "dim": 1, "theta_true": 0.8, "T": 100},
    "paper": {"cls": PaperModel, "dim": 2, "theta_true": 0.5, "T": 150},
}


def simulate(model: str, T: int, data_seed: int) -> torch.Tensor:
    """Observations ``(T, dy)`` in float64."""
    truth = MODELS[model]["theta_true"]
    theta = truth if model == "ar1" else [truth, truth]
    return ssm(model, theta).simulate(T, generator=torch.Generator().manual_seed(data_seed))[1]


def exact_log_lik(model: str, theta: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Per-step Kalman ``log p(y_t | y_{1:t-1})`` (float64), differentiable in ``theta`` (shape ``(dim,)``)."""
    d = ys.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    R = (0.09 if model == "ar1" else 0.1) * eye
    return kalman_filter(ys, torch.diag(theta), eye, eye, R, torch.zeros(d, dtype=torch.float64), eye).log_evidence_increments


def exact_scores(model: str, theta_value: float, ys: torch.Tensor, cumulative: bool = False):
    """The exact score (``(dim,)``), or with ``cumulative`` the scores of ``log p(y_{1:t})`` for every t, ``(T, dim)``."""
    theta = torch.full((MODELS[model]["dim"],), theta_value, dtype=torch.float64, requires_grad=True)
    lls = exact_log_lik(model, theta, ys)
    if not cumulative:
        (score,) = torch.autograd.grad(lls.sum(), theta)
        return lls.sum().item(), score
    cums = lls.cumsum(0)
    return torch.stack([torch.autograd.grad(c, theta, retain_graph=True)[0] for c in cums])


def observations(model: str, ys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ys = ys.to(dtype)
    return ys[:, 0] if model == "ar1" else ys  # AR(1) observations are scalars


def theta_leaf(model: str, theta_value: float, B: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (B, 1) if model == "ar1" else (B, 1, 2)
    return torch.full(shape, theta_value, dtype=dtype, requires_grad=True)


# --------------------------------------------------------------------------------------------------
# one configuration


def run_batch(model, theta_value, dtype, resampler, ys_model, B, N, seed):
    """Gradients ``(B, dim)`` (float64), fraction of (step, filter) pairs resampled, seconds."""
    theta = theta_leaf(model, theta_value, B, dtype)
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    smc = SMC(MODELS[model]["cls"](theta), num_particles=N, num_filters=B, resampler=resampler).run(ys_model)
    (grad,) = torch.autograd.grad(smc.log_evidence.sum(), theta)
    seconds = time.perf_counter() - start
    return grad.reshape(B, -1).double(), float(smc.resampled.float().mean()), seconds


def quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x, q)) if x.numel() else math.nan


def run_config(job: dict) -> dict:
    """All runs of one (model, theta, dtype, resampler); never raises (a failed batch is recorded)."""
    torch.set_num_threads(job["threads"])
    model, theta_value, name = job["model"], job["theta"], job["resampler"]
    dtype = getattr(torch, job["dtype"])
    ys = job["ys"]
    ys_model = observations(model, ys, dtype)
    exact = job["exact_score"]
    resampler = make_resampler(name, job["epsilon"])
    runs, B, N = job["runs"], job["batch"], job["num_particles"]
    grads, ids, resampled, failures = [], [], [], []
    seconds, n_warnings = 0.0, 0
    for k in range((runs + B - 1) // B):
        b = min(B, runs - k * B)
        seed = job["seed"] + k
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                g, frac, sec = run_batch(model, theta_value, dtype, resampler, ys_model, b, N, seed)
            except Exception as error:  # noqa: BLE001 - a failed batch is a result, not a crash
                g, frac, sec = torch.full((b, exact.numel()), math.nan, dtype=torch.float64), math.nan, math.nan
                failures.append({"seed": seed, "batch": b, "error": f"{type(error).__name__}: {error}"})
        if SinkhornConvergenceWarning is not None:
            n_warnings += sum(issubclass(w.category, SinkhornConvergenceWarning) for w in caught)
        grads.append(g)
        ids += [(seed, b, i) for i in range(b)]
        resampled.append((frac, b))
        seconds += sec if math.isfinite(sec) else 0.0
    g = torch.cat(grads)  # (runs, dim)
    err = (g - exact).norm(dim=-1)
    finite = torch.isfinite(err)
    e = err[finite]
    gf = g[finite]
    med = quantile(e, 0.5)
    rec = {
        "resampler": describe_resampler(name, job["epsilon"]),
        "runs": runs,
        "batch_size": B,
        "batch_seeds": [job["seed"], job["seed"] + (runs + B - 1) // B - 1],
        "median_abs_error": med,
        "q90_abs_error": quantile(e, 0.9),
        "q99_abs_error": quantile(e, 0.99),
        "max_abs_error": float(e.max()) if e.numel() else math.nan,
        "q99_over_median": quantile(e, 0.99) / med if med > 0 else math.nan,
        "nonfinite_runs": int((~finite).sum()),
        "mean_grad": gf.mean(0).tolist(),
        "sd_grad": gf.std(0).tolist() if gf.shape[0] > 1 else [math.nan] * g.shape[1],
        "bias": (gf.mean(0) - exact).tolist(),
        "bias_norm": float((gf.mean(0) - exact).norm()),
        "rmse": float(((gf - exact) ** 2).sum(-1).mean().sqrt()),
        "fraction_resampled": sum(f * b for f, b in resampled if math.isfinite(f)) / max(1, sum(b for f, b in resampled if math.isfinite(f))),
        "wall_s": seconds,
        "ms_per_run": 1e3 * seconds / runs,
        "sinkhorn_convergence_warnings": n_warnings,
        "failed_batches": failures,
    }
    order = torch.argsort(torch.where(finite, err, torch.full_like(err, math.inf)), descending=True)
    rec["worst_runs"] = [
        {"seed": ids[i][0], "batch": ids[i][1], "index": ids[i][2], "abs_error": float(err[i]), "grad": g[i].tolist()} for i in order[:5].tolist()
    ]
    bad = [i for i in range(runs) if not bool(finite[i]) or (med > 0 and float(err[i]) > OUTLIER_FACTOR * med)]
    rec["outliers"] = [
        {"seed": ids[i][0], "batch": ids[i][1], "index": ids[i][2], "abs_error": float(err[i]), "grad": g[i].tolist()} for i in bad
    ]
    if bad and job["diagnose"]:
        for o in rec["outliers"][: job["diagnose"]]:
            o["diagnosis"] = diagnose(job, dtype, resampler, ys_model, o, OUTLIER_FACTOR * med)
    return {"key": job["key"], "resampler_name": name, "record": rec}


def diagnose(job, dtype, resampler, ys_model, outlier, bound):
    """Re-runs an outlier's batch and bisects over t for the first step whose cumulative error exceeds ``bound``."""
    model, theta_value = job["model"], job["theta"]
    cum_exact = exact_scores(model, theta_value, job["ys"], cumulative=True)  # (T, dim)
    b, i = outlier["batch"], outlier["index"]
    theta = theta_leaf(model, theta_value, b, dtype)
    pyro.set_rng_seed(outlier["seed"])
    smc = SMC(MODELS[model]["cls"](theta), num_particles=job["num_particles"], num_filters=b, resampler=resampler)
    smc.init()
    log_z, ess = [], []
    for t in range(ys_model.shape[0]):
        smc.step(ys_model[t])
        log_z.append(smc.log_evidence[i])
        ess.append(float(smc.ess[i]))
    resampled = smc.resampled[:, i].tolist()

    def error(t):
        (g,) = torch.autograd.grad(log_z[t], theta, retain_graph=True)
        return float((g.reshape(b, -1)[i].double() - cum_exact[t]).norm())

    def bad(e):
        return not math.isfinite(e) or e > bound

    final = error(len(log_z) - 1)
    out = {"bound": bound, "replayed_final_abs_error": final, "reproduced": bad(final)}
    if not bad(final):
        return out
    lo, hi = 0, len(log_z) - 1  # invariant: error(hi) is bad; find the first bad step
    while lo < hi:
        mid = (lo + hi) // 2
        if bad(error(mid)):
            hi = mid
        else:
            lo = mid + 1
    out.update({
        "first_bad_step": hi,
        "abs_error_at_step": error(hi),
        "abs_error_before": error(hi - 1) if hi > 0 else None,
        "resampled_at_step": bool(resampled[hi]),
        "ess_at_step": ess[hi],
        "ess_before": ess[hi - 1] if hi > 0 else None,
    })
    return out


# --------------------------------------------------------------------------------------------------


def git_state() -> dict:
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "pyro_smc"], cwd=here.parent, capture_output=True, text=True, timeout=10)
        dirty = status.stdout.split("\n")
        return {"git_head": head or None, "uncommitted_library_files": [line[3:] for line in dirty if line.strip()]}
    except Exception:  # noqa: BLE001
        return {"git_head": None, "uncommitted_library_files": None}


def library_fingerprint() -> str:
    """sha256 (16 hex digits) of every ``pyro_smc/**/*.py`` as on disk now (the library is edited
    concurrently; ``--resume`` only keeps configurations measured with the same code)."""
    root = Path(__file__).resolve().parent.parent / "pyro_smc"
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def group_key(model, theta, dtype) -> str:
    return f"{model}_theta{theta:g}_{dtype}"


def goal_check(group: dict) -> dict:
    res = group["resamplers"]
    ot = res.get("ot_implicit")
    if ot is None:
        return {"met": False, "reason": "OT implicit not run"}
    medians = {k: v["median_abs_error"] for k, v in res.items()}
    lowest = min(medians, key=lambda k: medians[k] if math.isfinite(medians[k]) else math.inf)
    parts = {
        "q99_within_2x_median": bool(ot["q99_over_median"] <= 2.0),
        "no_nonfinite": ot["nonfinite_runs"] == 0,
        "lowest_median_error": lowest == "ot_implicit",
    }
    return {**parts, "lowest_median_resampler": lowest, "met": all(parts.values())}


def fmt_vec(v):
    return v[0] if len(v) == 1 else "(" + ", ".join(f"{x:.1f}" for x in v) + ")"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=None, help="runs per configuration (default 500; 50 with --quick)")
    parser.add_argument("--num-particles", type=int, default=100)
    parser.add_argument("--epsilon", type=float, default=0.5, help="OTResampler epsilon")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the simulated observations")
    parser.add_argument("--seed", type=int, default=1000, help="batch k of every configuration uses pyro.set_rng_seed(seed + k)")
    parser.add_argument("--models", default=None, help="default ar1,paper (ar1 with --quick)")
    parser.add_argument("--ar1-thetas", default=None, help="evaluation points (default 0.2,0.8; 0.2 with --quick)")
    parser.add_argument("--paper-thetas", default="0.5", help="evaluation points, both entries of theta (default 0.5)")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--resamplers", default=",".join(RESAMPLERS))
    parser.add_argument("--batches", default=",".join(f"{k}={v}" for k, v in DEFAULT_BATCH.items()),
                        help="filters per SMC call per resampler (memory, float64, T = 150: last_step ~0.15 GB per filter, implicit ~0.02)")
    parser.add_argument("--resume", action="store_true", help="keep the configurations of the existing result file run with the same settings")
    parser.add_argument("--workers", type=int, default=1, help="configurations run in parallel processes")
    parser.add_argument("--no-diagnose", action="store_true", help="do not bisect outlier runs")
    args = parser.parse_args()
    setup(args)
    runs = args.runs if args.runs is not None else (50 if args.quick else 500)
    ar1_thetas = [float(x) for x in (args.ar1_thetas or ("0.2" if args.quick else "0.2,0.8")).split(",")]
    paper_thetas = [float(x) for x in args.paper_thetas.split(",")]
    models = (args.models or ("ar1" if args.quick else "ar1,paper")).split(",")
    dtypes = args.dtypes.split(",")
    names = args.resamplers.split(",")
    for n in names:
        if n not in RESAMPLERS:
            parser.error(f"unknown resampler {n!r}; choose from {RESAMPLERS}")
    batches = dict(DEFAULT_BATCH)
    for item in args.batches.split(","):
        k, v = item.split("=")
        if k not in RESAMPLERS:
            parser.error(f"unknown resampler {k!r} in --batches")
        batches[k] = int(v)

    data, groups, jobs = {}, {}, []
    for model in models:
        T = 30 if args.quick else MODELS[model]["T"]
        ys = simulate(model, T, args.data_seed)
        thetas = ar1_thetas if model == "ar1" else paper_thetas
        data[model] = {"T": T, "theta_true": MODELS[model]["theta_true"], "data_seed": args.data_seed, "exact": {}}
        for theta in thetas:
            log_lik, score = exact_scores(model, theta, ys)
            data[model]["exact"][f"{theta:g}"] = {"log_evidence": log_lik, "score": score.tolist()}
            for dtype in dtypes:
                key = group_key(model, theta, dtype)
                groups[key] = {
                    "model": model, "theta": theta, "dtype": dtype, "T": T, "exact_score": score.tolist(), "exact_log_evidence": log_lik, "resamplers": {},
                }
                for name in names:
                    jobs.append({
                        "key": key, "model": model, "theta": theta, "dtype": dtype, "resampler": name, "ys": ys, "exact_score": score,
                        "runs": runs, "batch": min(runs, batches[name]),
                        "num_particles": args.num_particles, "epsilon": args.epsilon, "seed": args.seed,
                        "threads": args.threads, "diagnose": 0 if args.no_diagnose else 3,
                    })
    # Longest first (unroll, then the other OT modes), so parallel workers finish together.
    cost = {"ot_unroll": 0, "ot_last_step": 1, "ot_implicit": 2, "soft": 3, "systematic": 4}
    jobs.sort(key=lambda j: (cost[j["resampler"]], j["model"] != "paper"))

    settings = {
        "runs": runs, "num_particles": args.num_particles, "epsilon": args.epsilon, "ess_threshold": 0.5,
        "data_seed": args.data_seed, "seed": args.seed, "seed_rule": "batch k of each configuration: pyro.set_rng_seed(seed + k)",
        "batches": batches, "workers": args.workers, "threads": args.threads,
        "resamplers": {n: describe_resampler(n, args.epsilon) for n in names},
        "exact": "autograd through pyro_smc.ops.kalman.kalman_filter, float64",
        "error": "|g - s|, Euclidean norm over theta's entries (paper: 2 entries)",
        "outlier_rule": f"non-finite or error > {OUTLIER_FACTOR:g} x the configuration's median error",
    }
    fingerprint = library_fingerprint()
    resumed = []
    if args.resume:
        path = result_path("bench_gradients")
        old = json.loads(path.read_text()) if path.exists() else {}
        same = all(old.get("settings", {}).get(k) == settings[k] for k in ("runs", "num_particles", "epsilon", "data_seed", "seed", "ess_threshold"))
        todo = []
        for job in jobs:
            prev = old.get("results", {}).get(job["key"], {}) if same else {}
            rec = prev.get("resamplers", {}).get(job["resampler"])
            if (rec is not None and prev.get("T") == groups[job["key"]]["T"] and rec.get("batch_size") == job["batch"] and rec.get("runs") == runs
                    and rec.get("library_sha256") == fingerprint):
                rec["resumed"] = True  # measured by an earlier invocation (its wall time is from then)
                groups[job["key"]]["resamplers"][job["resampler"]] = rec
                resumed.append(f"{job['key']}/{job['resampler']}")
            else:
                todo.append(job)
        jobs = todo
        settings["resumed_configurations"] = resumed
        print(f"resumed {len(resumed)} configurations from {path.name}; {len(jobs)} to run", flush=True)
    goal_text = "for every (model, theta, dtype): OT implicit q99 error <= 2x its median, no non-finite runs, lowest median error of the five resamplers"
    git = git_state()
    start = time.perf_counter()

    def save(done: bool):
        goals = {k: goal_check(g) for k, g in groups.items() if g["resamplers"]}
        head = groups.get(group_key("ar1", 0.2, "float32")) or next(iter(groups.values()))
        summary = {
            n: {"median_error": r["median_abs_error"], "q99_error": r["q99_abs_error"], "nonfinite": r["nonfinite_runs"]}
            for n, r in sorted(head["resamplers"].items(), key=lambda kv: RESAMPLERS.index(kv[0]))
        }
        write_results("bench_gradients", {
            "settings": settings, "data": data, "results": groups,
            "goal": {"text": goal_text, "met": bool(goals) and all(g["met"] for g in goals.values()) and done, "per_group": goals},
            "summary_group": f"{head['model']} theta={head['theta']:g} {head['dtype']}", "summary": summary,
            "finished": done, "wall_s": time.perf_counter() - start, **git, "library_sha256": fingerprint,
        }, summary=generic_cells)

    if args.workers > 1:
        pool = mp.get_context("fork").Pool(args.workers)
        outputs = pool.imap_unordered(run_config, jobs)
    else:
        pool, outputs = None, map(run_config, jobs)
    for out in progress(outputs, "configurations", args, total=len(jobs)):
        rec = out["record"]
        rec["library_sha256"] = fingerprint
        groups[out["key"]]["resamplers"][out["resampler_name"]] = rec
        print(f"{out['key']:>24} {out['resampler_name']:>13}: median {rec['median_abs_error']:.3g}, q99 {rec['q99_abs_error']:.3g}, "
              f"max {rec['max_abs_error']:.3g}, non-finite {rec['nonfinite_runs']}, outliers {len(rec['outliers'])}, {rec['wall_s']:.0f} s", flush=True)
        save(False)
    if pool is not None:
        pool.close()
        pool.join()
    elapsed = time.perf_counter() - start

    for group in groups.values():
        res = group["resamplers"]
        ot = res.get("ot_implicit")
        rows = []
        for n in RESAMPLERS:
            if n not in res:
                continue
            r = res[n]
            rows.append([
                n, r["median_abs_error"], r["q90_abs_error"], r["q99_abs_error"], r["max_abs_error"], r["q99_over_median"], r["nonfinite_runs"],
                fmt_vec(r["mean_grad"]), fmt_vec(r["sd_grad"]), r["bias_norm"],
                r["median_abs_error"] / ot["median_abs_error"] if ot else math.nan,
                r["q99_abs_error"] / ot["q99_abs_error"] if ot else math.nan,
                r["fraction_resampled"], r["wall_s"],
            ])
        print_table(
            ["resampler", "median", "q90", "q99", "max", "q99/med", "nonfin", "mean g", "sd g", "|bias|", "med/OT", "q99/OT", "resampled", "wall s"],
            rows,
            title=f"{group['model']}, theta = {group['theta']:g}, {group['dtype']}, T = {group['T']}: |g - s| over {runs} runs, "
                  f"exact score s = {fmt_vec(group['exact_score'])}",
        )
        g = goal_check(group)
        print(f"goal: q99/median <= 2: {g.get('q99_within_2x_median')}; no non-finite: {g.get('no_nonfinite')}; "
              f"lowest median: {g.get('lowest_median_error')} (lowest: {g.get('lowest_median_resampler')}) -> {'met' if g['met'] else 'NOT met'}")
        for n, r in res.items():
            for o in r["outliers"]:
                print(f"  outlier {n}: seed {o['seed']} batch {o['batch']} index {o['index']}: |g - s| = {o['abs_error']:.4g} "
                      f"({o['abs_error'] / r['median_abs_error']:.0f}x median)"
                      + (f", diagnosis {o['diagnosis']}" if "diagnosis" in o else ""))
    settings["wall_s"] = elapsed
    save(True)
    print(f"wall {elapsed:.0f} s")


if __name__ == "__main__":
    main()
