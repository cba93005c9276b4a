"""Parameter recovery by evidence maximisation: EP (implicit gradient) vs the UKF vs a differentiable particle filter.

Two models, several simulated data sets each, the same parameterisation, start, optimiser and
number of steps for every method:

* ``ungm``: the growth model of ``bench_ep_growth.py`` (Kamthe et al.'s setting, their data sets):
  ``x_{k+1} = x_k/2 + b x_k/(1+x_k^2) + c cos(1.2 k) + w_k``, ``w ~ N(0, Q)``,
  ``y_k = x_k^2/20 + v_k``, ``v ~ N(0, R)``, ``x_0 ~ N(0, 5)`` unobserved, their data sets cut to ``--ungm-steps`` observations (default 50).
  Truth ``b = 25, c = 8, Q = 1, R = 10``; learned: ``b, c, log Q, log R``.
* ``pendulum``: the pendulum of ``bench_ep_pendulum.py`` (Sarkka and Svensson): angle and angular
  velocity, Euler step ``dt = 0.01``, ``Q = qc [[dt^3/3, dt^2/2], [dt^2/2, dt]]``,
  ``y = sin(angle) + v``, ``v ~ N(0, R)``, ``--pendulum-steps`` observations (default 80). Truth ``g = 9.81, qc = 0.01, R = 0.1``; learned:
  ``g, log qc, log R``.

Methods (all: ``torch.optim.Adam`` on ``-log_evidence / T`` over the same unconstrained
parameters, the same learning rate and number of steps):

* ``ep``: ``EPSmoother(projection="unscented", gradient="implicit")`` with the settings of the
  EP benchmarks (UNGM: power 0.9, damping 0.9, the anchor sigma points of bench_ep_growth, where
  EP does not converge; pendulum: plain EP), fitted with ``pyro_smc.infer.fit_evidence``.
* ``ep_parallel``: the same EP (same projection, ``tol``, implicit gradient) with
  ``schedule="parallel"`` (every factor refitted at its cavity in one batched projection, then the
  fitted chain solved by the parallel-scan Kalman smoother; same fixed points as plain EP), at most
  ``--parallel-max-iter`` iterations (default 100; the schedule adapts its damping and may need more
  iterations than the sequential one). The parallel schedule is plain EP (power 1): pendulum
  damping 1 (the same EP as ``ep``); UNGM damping ``--ungm-parallel-damping`` (default 0.9),
  power 1, whereas ``ep`` there is power EP (0.9). Fitted with ``fit_evidence(warm_start=True)``
  (as every EP method here: each step's EP starts from where the previous step's stopped).
* ``ep_unrolled`` (UNGM only, where EP never converges so the implicit gradient is undefined):
  exactly ``--unrolled-sweeps`` sweeps (default 5), differentiated through (``gradient="unroll"``).
* ``ukf``: ``EPSmoother(projection=same, max_iter=1)``: the unscented smoother's first sweep,
  whose evidence is the UKF's prediction-error evidence (fit_evidence too).
* ``smc_ot``: the bootstrap particle filter ``SMC(ssm, num_particles=N, resampler=OTResampler(0.5))``,
  maximising ``log Z_hat`` directly (fresh random numbers every step; the same Adam loop).

Yardstick, common to all fits: the log-likelihood of a held-out sequence (simulated from
the true model with another seed) and of the training sequence under the fitted parameters,
estimated by a bootstrap particle filter with many particles (systematic resampling, no
gradient). Also: the error of each parameter against the truth, the fit's wall time and time per
step, and the bytes autograd saves for backward in one gradient evaluation (summed over
``saved_tensors_hooks``). A memory table compares EP's implicit gradient with the unrolled one
(``gradient="unroll"``) at sweep counts set by ``tol``, for both schedules.

There is no exact maximum-likelihood estimate for these models; the ``ep`` row *is* the maximiser
of the EP evidence (reported against the truth), and the held-out particle-filter likelihood at
the true parameters is the reference for the yardstick.

Run: ``python benchmarks/gaussian/bench_ep_learning.py`` (``--quick`` for a smoke run;
``--models ungm`` reruns one model and keeps the other's results in the JSON, under
``kept_models`` with the run they come from).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.nn import PyroModule, PyroParam

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, f3, g3, met_summary, print_table, progress, ratio, result_path, setup, write_results
from benchmarks.gaussian import bench_ep_growth as growth
from benchmarks.gaussian import bench_ep_pendulum as pend
from pyro_smc import SMC, EPSmoother
from pyro_smc.infer import Unscented, fit_evidence
from pyro_smc.models import NonlinearGaussianSSM, time_dependent
from pyro_smc.resamplers import OTResampler, SystematicResampler

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# Models with learnable parameters


class LearnableNoiseSSM(NonlinearGaussianSSM):
    """``NonlinearGaussianSSM`` with ``Q = exp(log_q) Q_base`` and ``R = exp(log_r) R_base``, the
    scalar logs ``PyroParam``s (one parameterisation for every method)."""

    def __init__(self, transition, q_base, log_q, observation, r_base, log_r, init_mean, init_cov):
        super().__init__(transition, math.exp(log_q) * q_base, observation, math.exp(log_r) * r_base, init_mean, init_cov)
        del self._buffers["transition_cov"], self._buffers["observation_cov"]
        self.register_buffer("q_base", q_base)
        self.register_buffer("r_base", r_base)
        self.log_q = PyroParam(torch.tensor(float(log_q), dtype=F64))
        self.log_r = PyroParam(torch.tensor(float(log_r), dtype=F64))

    def __getattr__(self, name):
        if name == "transition_cov":
            return self.log_q.exp() * self.q_base
        if name == "observation_cov":
            return self.log_r.exp() * self.r_base
        return super().__getattr__(name)


class UNGMTransition(PyroModule):
    def __init__(self, b: float, c: float):
        super().__init__()
        self.b = PyroParam(torch.tensor(b, dtype=F64))
        self.c = PyroParam(torch.tensor(c, dtype=F64))

    @time_dependent
    def forward(self, x, t):
        return 0.5 * x + self.b * x / (1 + x**2) + self.c * math.cos(1.2 * t)


class PendulumTransition(PyroModule):
    def __init__(self, g: float):
        super().__init__()
        self.g = PyroParam(torch.tensor(g, dtype=F64))

    def forward(self, x):
        dt = pend.DT
        return torch.stack([x[..., 0] + dt * x[..., 1], x[..., 1] - self.g * torch.sin(x[..., 0]) * dt], -1)


def ungm_ssm(p: dict) -> LearnableNoiseSSM:
    one = torch.ones(1, 1, dtype=F64)
    return LearnableNoiseSSM(UNGMTransition(p["b"], p["c"]), one, math.log(p["Q"]), growth.observation, one, math.log(p["R"]),
                             torch.zeros(1, dtype=F64), 5 * one)


def _f(x) -> float:
    return float(x.detach())


def ungm_params(ssm) -> dict:
    return {"b": _f(ssm.transition.b), "c": _f(ssm.transition.c), "Q": _f(ssm.log_q.exp()), "R": _f(ssm.log_r.exp())}


def pendulum_ssm(p: dict) -> LearnableNoiseSSM:
    q_base = pend.process_cov() / pend.QC
    return LearnableNoiseSSM(PendulumTransition(p["g"]), q_base, math.log(p["qc"]), pend.observation, torch.eye(1, dtype=F64),
                             math.log(p["R"]), torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))


def pendulum_params(ssm) -> dict:
    return {"g": _f(ssm.transition.g), "qc": _f(ssm.log_q.exp()), "R": _f(ssm.log_r.exp())}


def ungm_data(seed: int, steps: int):
    return growth.simulate(seed, steps)[1]  # (steps + 1, 1), y_0 = NaN


def pendulum_data(seed: int, steps: int):
    return pend.simulate(seed, steps)[1]  # (steps + 1, 1), y_0 = NaN


MODELS = {
    "ungm": {
        "make": ungm_ssm, "params": ungm_params, "data": ungm_data,
        "truth": {"b": 25.0, "c": 8.0, "Q": 1.0, "R": 10.0},
        "start": {"b": 20.0, "c": 6.0, "Q": 3.0, "R": 4.0},
        "seeds": [101, 201, 301], "heldout_seed": 9001,
        "methods": ("ep", "ep_parallel", "ep_unrolled", "ukf", "smc_ot"),
        # EP does not converge on the UNGM (see the README), so the implicit gradient is undefined:
        # the memory table varies the (unrolled) sweep count instead of tol.
        "memory_configs": [{"max_iter": 5, "tol": 1e-300}, {"max_iter": 10, "tol": 1e-300}, {"max_iter": 20, "tol": 1e-300}],
        # bench_ep_growth's setting ("anchor" sigma points, power = damping = 0.9)
        "projection": lambda: Unscented(transition=growth.UT_TRANSITION, observation=growth.UT_MEASUREMENT),
        "ep": {"power": 0.9, "damping": 0.9},
        # the parallel schedule is plain EP (power 1 only); its damping adapts below this
        "ep_parallel": {"power": 1.0, "damping": 0.9},
    },
    "pendulum": {
        "make": pendulum_ssm, "params": pendulum_params, "data": pendulum_data,
        "truth": {"g": pend.G, "qc": pend.QC, "R": pend.R},
        "start": {"g": 7.0, "qc": 0.05, "R": 0.3},
        "seeds": [0, 1, 2], "heldout_seed": 9001,
        "methods": ("ep", "ep_parallel", "ukf", "smc_ot"),
        "memory_configs": [{"tol": 1e-2}, {"tol": 1e-4}, {"tol": 1e-8}],
        # bench_ep_pendulum's setting (book sigma points = library default, plain EP)
        "projection": lambda: Unscented(),
        "ep": {"power": 1.0, "damping": 1.0},
        "ep_parallel": {"power": 1.0, "damping": 1.0},
    },
}


# --------------------------------------------------------------------------------------------------
# The fits


def ep_smoother(spec, ssm, args, method, **kw) -> EPSmoother:
    if method == "ukf":
        return EPSmoother(ssm, projection=spec["projection"](), max_iter=1)
    opts = dict(max_iter=args.max_iter, tol=args.tol, **spec["ep"])
    if method == "ep_parallel":
        opts.update(spec["ep_parallel"], max_iter=args.parallel_max_iter, schedule="parallel")
    if method == "ep_unrolled":  # a fixed number of sweeps, differentiated through (EP-k of bench_ep_growth)
        opts.update(max_iter=args.unrolled_sweeps, tol=1e-300, gradient="unroll")
    opts.update(kw)
    return EPSmoother(ssm, projection=spec["projection"](), **opts)


def smc_loss(ssm, ys, N, eps):
    smc = SMC(ssm, num_particles=N, resampler=OTResampler(epsilon=eps)).run(ys)
    return -smc.log_evidence.mean() / len(ys)


def fit(spec, ys, method, args, seed) -> dict:
    """One fit from the start point; returns the fitted parameters and the cost."""
    ssm = spec["make"](spec["start"])
    params = list(ssm.parameters())
    optim = torch.optim.Adam(params, lr=args.lr)
    trace, sweeps = [], []
    stuck = None
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    if method == "smc_ot":
        losses = []
        for _ in range(args.steps):
            optim.zero_grad()
            loss = smc_loss(ssm, ys, args.particles, args.epsilon)
            loss.backward()
            optim.step()
            losses.append(float(loss.detach()))
            trace.append(spec["params"](ssm))
    else:
        smoother = ep_smoother(spec, ssm, args, method)
        inner = smoother.smooth

        def counting_smooth(y, **kw):  # records the EP sweeps of every step (kw: the warm start)
            out = inner(y, **kw)
            sweeps.append(len(out.history))
            return out

        smoother.smooth = counting_smooth
        losses = []

        def callback(step, loss):
            losses.append(loss)
            trace.append(spec["params"](ssm))

        # EP is deterministic: a step that fit_evidence skips (EP not converged) leaves the
        # parameters unchanged, so every later step would be the same skipped step. "raise" stops
        # the fit there, with the result "skip" would give after all steps, in less time.
        try:
            fit_evidence(smoother, ys, num_steps=args.steps, optimizer=optim, callback=callback, on_nonconvergence="raise", warm_start=True)
        except RuntimeError as error:
            if "did not converge" not in str(error):
                raise
            stuck = {"step": len(losses), "message": str(error)[:300]}
    seconds = time.perf_counter() - start
    done = max(len(losses), 1)
    out = {"params": spec["params"](ssm), "seconds": seconds, "steps_taken": len(losses), "step_s": seconds / (done + (stuck is not None)),
           "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
           "stuck": stuck, "trace_every_10": trace[9::10]}
    if sweeps:
        out["sweeps_mean"] = statistics.mean(sweeps)
        out["sweeps_max"] = max(sweeps)
    # Parameters averaged over the last 10% of steps (the particle fit's gradient is noisy).
    tail = trace[-max(1, len(trace) // 10):]
    out["params_tail_mean"] = {k: statistics.mean(p[k] for p in tail) for k in tail[0]} if tail else out["params"]
    return out, ssm


# --------------------------------------------------------------------------------------------------
# Measurements


def saved_bytes(fn) -> dict:
    """Bytes autograd saves for backward while ``fn()`` builds its loss (each saved tensor's
    ``numel * element_size``, counted per save), then the backward; the seconds of both, and the
    backward's error if it raised."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    out = {"saved_bytes": total[0]}
    try:
        loss.backward()
    except RuntimeError as error:
        out["backward_error"] = str(error)[:200]
    out["seconds"] = time.perf_counter() - start
    return out


def ep_loss(smoother, ys, result: dict):
    """``-log_evidence / T`` of the smoother on ``ys``; the smoother's result goes to ``result["r"]``."""
    result["r"] = smoother.smooth(ys)
    return -result["r"].log_evidence / len(ys)


def gradient_memory(spec, ys, args) -> dict:
    """Saved bytes of one gradient evaluation of each method at the start point."""
    out = {}
    for method in spec["methods"]:
        ssm = spec["make"](spec["start"])
        if method == "smc_ot":
            pyro.set_rng_seed(0)
            out[method] = saved_bytes(functools.partial(smc_loss, ssm, ys, args.particles, args.epsilon))
        else:
            result = {}
            out[method] = saved_bytes(functools.partial(ep_loss, ep_smoother(spec, ssm, args, method), ys, result))
            out[method]["sweeps"] = len(result["r"].history)
    return out


def ep_memory_table(spec, ys, args) -> list[dict]:
    """Implicit vs unrolled gradient of the EP evidence at the truth, for the sequential (``ep``)
    and the parallel (``ep_parallel``) schedule: saved bytes, sweeps and time for settings that
    change the number of sweeps (``spec["memory_configs"]``; cold starts)."""
    rows = []
    for method, schedule in (("ep", "sequential"), ("ep_parallel", "parallel")):
        for config in spec["memory_configs"]:
            for gradient in ("implicit", "unroll"):
                ssm = spec["make"](spec["truth"])
                result = {}
                smoother = ep_smoother(spec, ssm, args, method, gradient=gradient, **config)
                rec = saved_bytes(functools.partial(ep_loss, smoother, ys, result))
                rec.update(config, max_iter=smoother.max_iter, schedule=schedule, gradient=gradient, sweeps=len(result["r"].history),
                           converged=bool(result["r"].converged))
                if "backward_error" not in rec:
                    rec["grad"] = [float(p.grad) for p in ssm.parameters()]
                rows.append(rec)
    return rows


@torch.no_grad()
def pf_loglik(ssm, ys, N, filters, seed) -> tuple[float, float]:
    """Bootstrap-PF estimate of ``log p(ys)`` (mean and sd over ``filters`` filters)."""
    pyro.set_rng_seed(seed)
    smc = SMC(ssm, num_particles=N, num_filters=filters, resampler=SystematicResampler()).run(ys)
    z = smc.log_evidence
    return float(z.mean()), float(z.std()) if filters > 1 else float("nan")


def rel_errors(params: dict, truth: dict) -> dict:
    return {k: abs(params[k] - truth[k]) / abs(truth[k]) for k in truth}


# --------------------------------------------------------------------------------------------------
# Summary


EP_VARIANTS = {"ep": "EP", "ep_parallel": "EP parallel"}  # implicit-gradient EP fits; the goal is judged with the best


def _goal_checks(e: dict, smc: dict, ukf: dict) -> dict:
    """The parts of the goal for one EP fit's aggregate ``e``; "as accurately": held-out
    log-likelihood within 1 nat of the particle fit's (or better)."""
    return {"as accurate as SMC-OT": e["heldout_ll_mean"] >= smc["heldout_ll_mean"] - 1.0,
            "faster": e["seconds_mean"] < smc["seconds_mean"],
            "beats UKF": e["heldout_ll_mean"] > ukf["heldout_ll_mean"]}


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``."""
    agg = d["aggregate"]
    ours, comp, verdict = [], [], {}
    names = {**EP_VARIANTS, "ep_unrolled": "EP unrolled", "ukf": "UKF", "smc_ot": "SMC-OT"}
    for model, a in agg.items():
        ukf, smc = a["ukf"], a["smc_ot"]
        shown = [m for m in names if m in a]
        stuck = "".join(f" ({names[m]} stuck at the start in {a[m]['stuck_fits']} fits: not converged)" for m in EP_VARIANTS if a.get(m, {}).get("stuck_fits"))
        ours.append(f"{model}: mean rel. error " + ", ".join(f"{names[m]} {f3(a[m]['rel_error_mean'])}" for m in shown)
                    + "; held-out log-lik. " + ", ".join(f"{names[m]} {f2(a[m]['heldout_ll_mean'])}" for m in shown)
                    + "; s / step " + ", ".join(f"{names[m]} {f3(a[m]['step_s_mean'])}" for m in shown)
                    + f" (truth {f2(a['truth_heldout_ll_mean'])}){stuck}")

        fitted = [m for m in EP_VARIANTS if m in a and not a[m].get("stuck_fits")]
        parts = []
        for m in [m for m in EP_VARIANTS if m in a] + (["ep_unrolled"] if not fitted and "ep_unrolled" in a else []):
            e, label = a[m], names[m]
            if e.get("stuck_fits"):
                parts.append(f"{label} did not converge, no fit")
                continue
            parts.append(f"{label} / SMC-OT time {ratio(e['seconds_mean'] / smc['seconds_mean'])}, "
                         f"held-out log-lik. {label} - SMC-OT {e['heldout_ll_mean'] - smc['heldout_ll_mean']:+.2f}, "
                         f"{label} - UKF {e['heldout_ll_mean'] - ukf['heldout_ll_mean']:+.2f}")
        comp.append(f"{model}: " + "; ".join(parts))
        if not fitted:  # no fit took place: its time and accuracy are those of the start point
            verdict[f"{model}: EP converges, so its evidence can be fitted"] = False
            continue
        # the best EP variant: the most parts of the goal met, then the shortest fit
        best = max(fitted, key=lambda m: (sum(_goal_checks(a[m], smc, ukf).values()), -a[m]["seconds_mean"]))
        for part, ok in _goal_checks(a[best], smc, ukf).items():
            verdict[f"{model} {names[best]} {part}"] = ok
    n = max((len(v) for v in d.get("settings", {}).get("seeds", {}).values()), default=0)
    return {
        "ours": f"{n} data sets per model; " + "; ".join(ours),
        "anchor": "the particle filter (SMC, OT resampling) and the UKF fitted from the same start; truth's held-out log-lik.",
        "comparison": "; ".join(comp),
        "goal": "EP (best of the sequential and parallel schedules) fits as accurately as the particle filter (held-out log-lik. within 1 nat) "
                "in less time, and beats the UKF's fit",
        "met": met_summary(verdict),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--models", default="ungm,pendulum")
    parser.add_argument("--datasets", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80, help="Adam steps (all methods)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--unrolled-sweeps", type=int, default=5, help="sweeps of the UNGM's ep_unrolled fit")
    parser.add_argument("--max-iter", type=int, default=30, help="EP sweeps at most")
    parser.add_argument("--tol", type=float, default=1e-4, help="EP tolerance")
    parser.add_argument("--parallel-max-iter", type=int, default=100, help="iterations of ep_parallel at most")
    parser.add_argument("--ungm-parallel-damping", type=float, default=0.9, help="ep_parallel's (initial, largest) damping on the UNGM")
    parser.add_argument("--particles", type=int, default=100, help="particles of the differentiable filter")
    parser.add_argument("--epsilon", type=float, default=0.5, help="OT resampler's epsilon")
    parser.add_argument("--ungm-steps", type=int, default=50, help="UNGM observations")
    parser.add_argument("--pendulum-steps", type=int, default=80, help="pendulum observations")
    parser.add_argument("--eval-particles", type=int, default=4000)
    parser.add_argument("--eval-filters", type=int, default=4)
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(F64)
    # Each model instance keeps its own parameters: with Pyro's global param store, a second
    # instance with the same parameter names (the truth, the next fit) would silently take the
    # first one's values as soon as it runs under SMC (PyroModule syncs with the store).
    pyro.settings.set(module_local_params=True)
    if args.quick:
        args.datasets, args.steps, args.ungm_steps, args.pendulum_steps = 1, 5, 30, 60
        args.eval_particles, args.eval_filters = 500, 2
    MODELS["ungm"]["ep_parallel"]["damping"] = args.ungm_parallel_damping
    models = args.models.split(",")
    lengths = {"ungm": args.ungm_steps, "pendulum": args.pendulum_steps}
    wall = time.perf_counter()
    results, aggregate, memory = {}, {}, {}
    for model in models:
        spec = MODELS[model]
        T = lengths[model]
        seeds = spec["seeds"][: args.datasets]
        heldout = spec["data"](spec["heldout_seed"], T)
        truth_ssm = spec["make"](spec["truth"])
        start_ssm = spec["make"](spec["start"])
        results[model] = {}
        train0 = spec["data"](seeds[0], T)
        memory[model] = {"per_method": gradient_memory(spec, train0, args), "ep_implicit_vs_unrolled": ep_memory_table(spec, train0, args)}
        for k, seed in enumerate(progress(seeds, model, args)):
            ys = spec["data"](seed, T)
            rec = {
                "truth_heldout_ll": pf_loglik(truth_ssm, heldout, args.eval_particles, args.eval_filters, 7),
                "truth_train_ll": pf_loglik(truth_ssm, ys, args.eval_particles, args.eval_filters, 7),
                "start_heldout_ll": pf_loglik(start_ssm, heldout, args.eval_particles, args.eval_filters, 7),
            }
            for method in spec["methods"]:
                out, ssm = fit(spec, ys, method, args, seed=1000 + k)
                out["rel_error"] = rel_errors(out["params"], spec["truth"])
                out["rel_error_mean"] = statistics.mean(out["rel_error"].values())
                out["heldout_ll"] = pf_loglik(ssm, heldout, args.eval_particles, args.eval_filters, 7)
                out["train_ll"] = pf_loglik(ssm, ys, args.eval_particles, args.eval_filters, 7)
                rec[method] = out
                print(f"  {model} seed {seed} {method}: {out['params']} rel.err {out['rel_error_mean']:.3f} "
                      f"held-out {out['heldout_ll'][0]:.2f} ({out['seconds']:.1f} s)", flush=True)
            results[model][str(seed)] = rec
        recs = list(results[model].values())
        agg = {"truth_heldout_ll_mean": statistics.mean(r["truth_heldout_ll"][0] for r in recs),
               "truth_train_ll_mean": statistics.mean(r["truth_train_ll"][0] for r in recs),
               "start_heldout_ll_mean": statistics.mean(r["start_heldout_ll"][0] for r in recs)}
        for method in spec["methods"]:
            agg[method] = {
                "rel_error_mean": statistics.mean(r[method]["rel_error_mean"] for r in recs),
                "rel_error_per_param": {p: statistics.mean(r[method]["rel_error"][p] for r in recs) for p in spec["truth"]},
                "heldout_ll_mean": statistics.mean(r[method]["heldout_ll"][0] for r in recs),
                "train_ll_mean": statistics.mean(r[method]["train_ll"][0] for r in recs),
                "seconds_mean": statistics.mean(r[method]["seconds"] for r in recs),
                "step_s_mean": statistics.mean(r[method]["step_s"] for r in recs),
                "saved_bytes": memory[model]["per_method"][method]["saved_bytes"],
                "stuck_fits": sum(r[method]["stuck"] is not None for r in recs),
                "steps_taken_mean": statistics.mean(r[method]["steps_taken"] for r in recs),
            }
        aggregate[model] = agg

    # ---- tables
    for model in models:
        spec, agg = MODELS[model], aggregate[model]
        names = list(spec["truth"])
        rows = []
        for seed, rec in results[model].items():
            for method in spec["methods"]:
                r = rec[method]
                rows.append([seed, method] + [g3(r["params"][p]) for p in names] + [r["rel_error_mean"], r["heldout_ll"][0], r["train_ll"][0],
                                                                                     r["seconds"], 1e3 * r["step_s"], r["steps_taken"], r.get("sweeps_mean", "")])
            rows.append([seed, "truth"] + [g3(spec["truth"][p]) for p in names] + ["", rec["truth_heldout_ll"][0], rec["truth_train_ll"][0], "", "", "", ""])
        print_table(["data", "method"] + names + ["mean rel. err", "held-out LL", "train LL", "fit s", "ms / step", "steps", "EP sweeps"], rows,
                    title=f"{model}: T = {lengths[model]}, start {spec['start']}, Adam lr {args.lr}, {args.steps} steps; "
                          f"LL by bootstrap PF N = {args.eval_particles} x {args.eval_filters}")
        rows = []
        for method in spec["methods"]:
            a = agg[method]
            rows.append([method + (" (stuck)" if a["stuck_fits"] else "")] + [a["rel_error_per_param"][p] for p in names] + [
                a["rel_error_mean"], a["heldout_ll_mean"], a["train_ll_mean"], a["seconds_mean"], 1e3 * a["step_s_mean"],
                a["saved_bytes"] / 2**20, a["seconds_mean"] / agg["smc_ot"]["seconds_mean"],
                a["rel_error_mean"] / agg["smc_ot"]["rel_error_mean"]])
        print_table(["method"] + [f"rel.err {p}" for p in names] + ["mean rel. err", "held-out LL", "train LL", "fit s", "ms / step",
                                                                     "saved MiB / grad", "time / SMC", "err / SMC"], rows,
                    title=f"{model}: means over {len(results[model])} data sets (truth held-out LL {agg['truth_heldout_ll_mean']:.2f}, "
                          f"start {agg['start_heldout_ll_mean']:.2f})")
        rows = [[r.get("schedule", "sequential"), r.get("max_iter", args.max_iter), f"{r['tol']:g}", r["gradient"], r["sweeps"], r["converged"],
                 r["saved_bytes"] / 2**20, r["seconds"], "backward raised: not converged" if "backward_error" in r else ""]
                for r in memory[model]["ep_implicit_vs_unrolled"]]
        print_table(["schedule", "max_iter", "tol", "gradient", "sweeps", "converged", "saved MiB", "s (fwd + bwd)", ""], rows,
                    title=f"{model}: EP gradient memory at the truth (saved tensors of one evaluation)")
    wall = time.perf_counter() - wall
    print(f"\ntotal wall time {wall:.0f} s")
    payload = {
        "settings": {
            "models": models, "T": lengths, "seeds": {m: MODELS[m]["seeds"][: args.datasets] for m in models},
            "heldout_seed": {m: MODELS[m]["heldout_seed"] for m in models},
            "truth": {m: MODELS[m]["truth"] for m in models}, "start": {m: MODELS[m]["start"] for m in models},
            "optimizer": f"torch.optim.Adam(lr={args.lr}) on -log_evidence / T, all methods", "steps": args.steps,
            "ep": {m: dict(MODELS[m]["ep"], max_iter=args.max_iter, tol=args.tol, gradient="implicit") for m in models},
            "ep_parallel": {m: dict(MODELS[m]["ep_parallel"], schedule="parallel", max_iter=args.parallel_max_iter, tol=args.tol, gradient="implicit",
                                    warm_start=True) for m in models},
            "warm_start": "fit_evidence(warm_start=True) for every EP method",
            "projection": {"ungm": "Unscented(transition=alpha 1 beta 2 kappa 3, observation=alpha 1 beta 2 kappa 2)",
                           "pendulum": "Unscented() (alpha 1, beta 0, kappa 3 - n)"},
            "smc_ot": {"num_particles": args.particles, "num_filters": 1, "resampler": f"OTResampler(epsilon={args.epsilon})", "proposal": "bootstrap"},
            "yardstick": {"num_particles": args.eval_particles, "num_filters": args.eval_filters, "resampler": "systematic"},
            "ep_unrolled": {"ungm": f"max_iter={args.unrolled_sweeps} sweeps always (tol 1e-300), gradient='unroll'"},
            "memory_configs": {m: MODELS[m]["memory_configs"] for m in models},
        },
        "results": results,
        "aggregate": aggregate,
        "memory": memory,
        "wall_s": wall,
    }
    path = result_path("ep_learning")
    if not args.quick and path.exists():
        keep_other_models(payload, json.loads(path.read_text()), models)
    write_results("ep_learning", payload, dtype=F64, summary=summary_cells)


def keep_other_models(payload: dict, old: dict, models: list[str]) -> None:
    """Adds to ``payload`` the models of the result file ``old`` that this run (``--models``) did
    not rerun, with their settings, and says under ``"kept_models"`` which run they come from, so
    that ``--models ungm`` replaces the UNGM's rows and keeps the pendulum's."""
    kept = [m for m in old.get("settings", {}).get("models", []) if m not in models]
    if not kept:
        return
    settings = payload["settings"]
    for key, value in old["settings"].items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key].update({m: value[m] for m in kept if m in value and m not in settings[key]})
    settings["models"] = list(models) + kept
    for key in ("results", "aggregate", "memory"):
        payload[key].update({m: old[key][m] for m in kept})
    earlier = old.get("kept_models", {})
    payload["kept_models"] = {m: earlier.get(m, {"command": old.get("command"), "wall_s": old.get("wall_s")}) for m in kept}


if __name__ == "__main__":
    main()
