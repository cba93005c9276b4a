"""``SMC`` against the ``particles`` library on the same model, one filter and many (issue 14, benchmark 2).

Model (stochastic volatility, as in ``bench_estimators.py``): ``x_1 ~ N(0, sigma^2 / (1 - alpha^2))``,
``x_t = alpha x_{t-1} + sigma v_t``, ``y_t = beta exp(x_t / 2) e_t``, alpha = 0.91, sigma = 1,
beta = 0.5, float64 (the dtype ``particles`` computes in), one simulated data set per T. Both libraries
run a bootstrap filter with systematic resampling when the ESS falls below N / 2.

Contenders, timed interleaved in one process (``_common.timeit_interleaved``), forward pass only:

* ``particles``: ``particles.SMC(fk=Bootstrap(ssm, data), N, resampling="systematic", ESSrmin=0.5)``,
  ``collect=None``, no history (Chopin's library, MIT; NumPy).
* ``SMC``: ``pyro_smc.SMC(model, num_particles=N, compile=False)``, the model an ordinary Pyro
  ``init``/``step`` program run through Pyro's handlers at every step, Pyro's validation on.
* ``SMC compile``: the default, ``compile=None``: a regular step recorded once and replayed
  (``docs/engines/smc.md#the-compiled-step``), with the reweighting and summary inside the
  recording; a new model object each run, which reuses the recording of an earlier object of
  the same class (verified again at its first regular step: two steps on the handlers).
* ``SMC compile, first``: the same with that shared recording forgotten before each run, so each
  run records (three of the T steps on the handlers, the trace, its simplification and the
  loop's compilation): what the first run of a class in a process pays.
* ``SMC compile, kept``: the same with one model object for all runs, as in an SVI loop
  (``SMCELBO`` builds a new ``SMC`` per step): a run reuses the recording of the run before,
  verified again at its first regular step (two steps on the handlers, no recording).
* ``floor``: the same bootstrap filter hand-written in 20 lines of PyTorch (no Pyro), the issue's
  yardstick for what the hardware allows.
* ``SMC, validation off``: the same inside ``pyro.validation_enabled(False)`` (the switch Pyro
  documents for speed; ``particles`` validates nothing either).
* ``SMC, B filters``: ``num_filters=B`` independent filters in one vectorised pass, its time divided
  by ``B`` (per filter), against ``B`` runs of ``particles``.

Sanity check (same model, same answer): the mean of ``log Z_hat`` over runs of each library, with
its standard error; the two must agree within 5 standard errors.

Profile: where one ``SMC`` step goes (N = 1000, B = 1), by wall-clock timers around the engine's own
stages: the user's ``step`` under Pyro's handlers (the Pyro program itself: distribution
construction, ``pyro.sample``, plates, trace), the site log-densities, the centring and normalisation
of the weights, recording (ESS, means, histories) and resampling. The timers add about a microsecond
per stage.

Profile of the compiled step (recording kept, N = 100 and 1000): the compiled loop that takes the
rest of the run once the recording is verified, the recording's calls and the resampling of the
steps replayed one at a time before it, the engine's Python around them, and the run's fixed cost.

Goals (issue 28): ``SMC`` at B = 1 at most 1.0x ``particles`` at N = 1000 and at most 1.3x the
hand-written floor at every N; ahead of ``particles`` (per filter) from 10 filters on.

Run: ``python benchmarks/smc/bench_particles_speed.py`` (``--quick``: a smoke run, < 20 s).
Results: ``results/particles_speed.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, print_table, progress, ratio, setup, slash, timeit_interleaved, write_results, yn
from pyro_smc import SMC
from pyro_smc.infer.smc.compiled import _SHARED
from pyro_smc.infer.smc import advance as advance_module
from pyro_smc.infer.smc import compiled as compiled_module
from pyro_smc.infer.smc import engine as engine_module
from pyro_smc.infer.smc import step as step_module

ALPHA, SIGMA, BETA = 0.91, 1.0, 0.5


class SV:
    """The SV model as a Pyro program (what a user writes)."""

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, SIGMA / math.sqrt(1 - ALPHA**2)))

    def step(self, state, y):
        x = pyro.sample("x", dist.Normal(ALPHA * state["x"], SIGMA))
        pyro.sample("y", dist.Normal(0.0, BETA * torch.exp(x / 2)), obs=y)
        state["x"] = x


def particles_model():
    from particles import distributions as pdist
    from particles import state_space_models as ssm

    class ParticlesSV(ssm.StateSpaceModel):
        """The same model in ``particles``' terms."""

        def PX0(self):
            return pdist.Normal(loc=0.0, scale=SIGMA / np.sqrt(1 - ALPHA**2))

        def PX(self, t, xp):
            return pdist.Normal(loc=ALPHA * xp, scale=SIGMA)

        def PY(self, t, xp, x):
            return pdist.Normal(loc=0.0, scale=BETA * np.exp(x / 2))

        def upper_bound_log_pt(self, t):
            # max of the transition density, for particles' rejection-based backward sampling
            return -0.5 * np.log(2 * np.pi * SIGMA**2)

    return ParticlesSV()


def simulate(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((), generator=g, dtype=torch.float64) * SIGMA / math.sqrt(1 - ALPHA**2)
    ys = []
    for _ in range(T):
        x = ALPHA * x + SIGMA * torch.randn((), generator=g, dtype=torch.float64)
        ys.append(BETA * torch.exp(x / 2) * torch.randn((), generator=g, dtype=torch.float64))
    return torch.stack(ys)


def run_particles(fk, n: int) -> float:
    import particles

    alg = particles.SMC(fk=fk, N=n, resampling="systematic", ESSrmin=0.5, collect=None, store_history=False, verbose=False)
    alg.run()
    return float(alg.logLt)


def run_ours(ys: torch.Tensor, n: int, filters: int = 1, validate: bool = True, compile: bool = False, model: SV | None = None) -> torch.Tensor:
    with contextlib.nullcontext() if validate else pyro.validation_enabled(False):
        return SMC(SV() if model is None else model, num_particles=n, num_filters=filters, compile=compile).run(ys).log_evidence


def run_floor(ys: torch.Tensor, n: int) -> torch.Tensor:
    """The floor: the same bootstrap filter written by hand in PyTorch, no Pyro."""
    x = torch.randn(n) * (SIGMA / math.sqrt(1 - ALPHA**2))
    log_w, log_z = torch.full((n,), -math.log(n)), torch.zeros(())
    for y in ys:
        x = ALPHA * x + SIGMA * torch.randn(n)
        scale = BETA * torch.exp(x / 2)
        joint = log_w - 0.5 * (y / scale) ** 2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)
        increment = torch.logsumexp(joint, 0)
        log_z, log_w = log_z + increment, joint - increment
        if 1.0 / torch.exp(2 * log_w).sum() < 0.5 * n:
            u = (torch.rand(()) + torch.arange(n)) / n
            x = x[torch.searchsorted(torch.cumsum(torch.exp(log_w), 0), u).clamp(max=n - 1)]
            log_w = torch.full((n,), -math.log(n))
    return log_z


def mean_se(values) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


class StageTimers:
    """Wall-clock timers wrapped around named methods or module functions (``timed``), removed by
    ``restore``; ``totals`` holds the seconds spent in each label."""

    def __init__(self):
        self.totals = collections.Counter()
        self.patched = []

    def timed(self, owner, name, label):
        original = getattr(owner, name)
        totals = self.totals

        @functools.wraps(original)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                totals[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)
        self.patched.append((owner, name, original))

    def restore(self):
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)


def profile_steps(ys: torch.Tensor, n: int, repeats: int) -> dict:
    """Microseconds per step in each stage of ``SMC``, by timers wrapped around the engine's stages."""
    timers = StageTimers()
    totals, timed = timers.totals, timers.timed
    model = SV()
    timed(model, "step", "user step under Pyro's handlers")
    # The phases as the engine and step modules call them (module globals, so patched there).
    timed(advance_module, "log_weight_terms", "site log-densities")
    timed(step_module, "centred_increment", "centring the weight terms")
    timed(advance_module, "summarise", "recording (ESS, means, histories)")
    timed(advance_module, "maybe_resample", "resampling")
    timed(engine_module.SMC, "_advance", "whole step")
    try:
        smc = SMC(model, num_particles=n, compile=False)
        smc.run(ys)  # warm-up
        totals.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            smc.run(ys)
        wall = time.perf_counter() - start
    finally:
        timers.restore()
    steps = repeats * (len(ys) + 1)
    us = {label: 1e6 * value / steps for label, value in totals.items()}
    us["normalisation and the rest of the step"] = us["whole step"] - sum(v for k, v in us.items() if k != "whole step")
    us["run() outside the steps"] = 1e6 * wall / steps - us["whole step"]
    return us


def profile_compiled(ys: torch.Tensor, n: int, repeats: int) -> dict:
    """Microseconds per step of a compiled run with a kept recording (as in an SVI loop): the
    recording's call (the replay), the resampling of replayed steps, the engine's Python around
    them, and the run's fixed cost (``init`` and the verifying step on the handlers)."""
    timers = StageTimers()
    totals, timed = timers.totals, timers.timed
    timed(compiled_module, "execute", "replay (the recording's call)")
    timed(advance_module, "_resample_replayed", "resampling (replayed steps)")
    timed(step_module.StepProgram, "propose", "the program on the handlers (init, the verifying step)")
    timed(engine_module.SMC, "_advance", "whole step")
    timed(engine_module, "run_replayed", "the compiled loop (the rest of the run)")
    model = SV()
    try:
        SMC(model, num_particles=n).run(ys)  # records; the runs below reuse it
        totals.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            SMC(model, num_particles=n).run(ys)
        wall = time.perf_counter() - start
    finally:
        timers.restore()
    steps = repeats * len(ys)
    us = collections.Counter({label: 1e6 * value / steps for label, value in totals.items()})
    loop = "the compiled loop (the rest of the run)"
    # The loop runs outside _advance (the steps taken one at a time): the rest is what neither holds.
    us["engine Python around them"] = us["whole step"] - sum(v for k, v in us.items() if k not in ("whole step", loop))
    us["run() outside the steps"] = 1e6 * wall / steps - us["whole step"] - us[loop]
    return dict(us)


def summary_cells(d: dict) -> dict:
    """This benchmark's row in the summary table of ``benchmarks/README.md`` (see ``_common.summary_record``)."""
    single = {(r["N"], r["T"]): r for r in d["single"]}
    t_main = min(t for _, t in single)
    rows = [single[(n, t_main)] for n in sorted({n for n, _ in single})]
    batch = sorted(d["batched"], key=lambda r: r["B"])
    return {
        "ours": f"SV bootstrap, T = {t_main}, B = 1, N = {slash([r['N'] for r in rows], str)}: "
        f"{slash([r['ours_ms'] for r in rows], f2)} ms ({slash([r['ours_noval_ms'] for r in rows], f2)} with Pyro validation off); "
        f"per filter with B = {slash([r['B'] for r in batch], str)} filters at N = {batch[0]['N']}: {slash([r['ours_ms_per_filter'] for r in batch], f2)} ms",
        "anchor": f"`particles` (Chopin) {slash([r['particles_ms'] for r in rows], f2)} ms per run",
        "comparison": f"ours / particles at B = 1: {slash([r['ratio'] for r in rows], ratio)} ({slash([r['ratio_noval'] for r in rows], ratio)} validation off; "
        f"compiled {slash([r['ratio_compiled'] for r in rows], ratio)}, recording kept {slash([r.get('ratio_kept', math.nan) for r in rows], ratio)}, "
        f"recorded afresh {slash([r.get('ratio_first', math.nan) for r in rows], ratio)}); "
        f"compiled / hand-written floor {slash([r['compiled_over_floor'] for r in rows], ratio)} "
        f"(kept {slash([r.get('kept_over_floor', math.nan) for r in rows], ratio)}); "
        f"per filter at B = {slash([r['B'] for r in batch], str)}: {slash([r['ratio_per_filter'] for r in batch], ratio)}",
        "goal": d["goal"],
        "met": f"1.0x at B = 1, N = 1000: {yn(single[(1000, t_main)]['ratio'] <= 1.0)} "
        f"(compiled: {yn(single[(1000, t_main)]['ratio_compiled'] <= 1.0)}); compiled <= 1.3x floor at every N: "
        f"{yn(all(r['compiled_over_floor'] <= 1.3 for r in rows))} (kept: {yn(all(r.get('kept_over_floor', math.inf) <= 1.3 for r in rows))}); ahead from 10 filters: "
        f"{yn(all(r['ratio_per_filter'] < 1 for r in batch if r['B'] >= 10))}",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--runs", type=int, default=200, help="runs per library for the log Z sanity check")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    from particles import state_space_models as ssm

    quick = args.quick
    sizes = [100, 1000] if quick else [100, 1000, 10000]
    horizons = [50] if quick else [100, 200]
    batches = [10] if quick else [10, 50]
    repeats = 3 if quick else args.repeats
    runs = 20 if quick else args.runs
    model = particles_model()

    single, rows = [], []
    for T in horizons:
        ys = simulate(T, seed=T)
        fk = ssm.Bootstrap(ssm=model, data=ys.numpy())
        for n in progress(sizes, f"T = {T}", args):
            kept = SV()  # one model for all runs, as in an SVI loop
            t = timeit_interleaved(
                {
                    "particles": lambda fk=fk, n=n: run_particles(fk, n),
                    "ours": lambda ys=ys, n=n: run_ours(ys, n),
                    "ours_noval": lambda ys=ys, n=n: run_ours(ys, n, validate=False),
                    "ours_compiled": lambda ys=ys, n=n: run_ours(ys, n, compile=True),
                    "ours_first": lambda ys=ys, n=n: (_SHARED.clear(), run_ours(ys, n, compile=True))[1],
                    "ours_kept": lambda ys=ys, n=n, m=kept: run_ours(ys, n, compile=True, model=m),
                    "floor": lambda ys=ys, n=n: run_floor(ys, n),
                },
                repeats=repeats,
            )
            ms = {k: 1e3 * v["median_s"] for k, v in t.items()}
            rec = {"N": n, "T": T, "particles_ms": ms["particles"], "ours_ms": ms["ours"], "ours_noval_ms": ms["ours_noval"],
                   "ours_compiled_ms": ms["ours_compiled"], "ours_kept_ms": ms["ours_kept"], "floor_ms": ms["floor"],
                   "ratio_kept": ms["ours_kept"] / ms["particles"], "kept_over_floor": ms["ours_kept"] / ms["floor"],
                   "ratio": ms["ours"] / ms["particles"], "ratio_noval": ms["ours_noval"] / ms["particles"],
                   "ratio_compiled": ms["ours_compiled"] / ms["particles"], "compiled_over_floor": ms["ours_compiled"] / ms["floor"],
                   "ours_first_ms": ms["ours_first"], "ratio_first": ms["ours_first"] / ms["particles"],
                   "first_over_floor": ms["ours_first"] / ms["floor"],
                   "ours_over_floor": ms["ours"] / ms["floor"], "timings": t}
            single.append(rec)
            rows.append([T, n, ms["particles"], ms["floor"], ms["ours"], ms["ours_first"], ms["ours_compiled"], ms["ours_kept"], rec["ratio"],
                         rec["ratio_first"], rec["ratio_compiled"], rec["ratio_kept"], rec["ours_over_floor"], rec["first_over_floor"],
                         rec["compiled_over_floor"], rec["kept_over_floor"]])
    print_table(["T", "N", "particles ms", "floor ms", "SMC ms", "first ms", "compiled ms", "kept ms", "SMC / particles", "first / particles",
                 "compiled / particles", "kept / particles", "SMC / floor", "first / floor", "compiled / floor", "kept / floor"], rows,
                title=f"One filter (B = 1), forward, SV bootstrap, float64, median of {repeats}")

    T, n = horizons[0], 1000
    ys = simulate(T, seed=T)
    fk = ssm.Bootstrap(ssm=model, data=ys.numpy())
    batched, rows = [], []
    for b in progress(batches, "filters", args):
        t = timeit_interleaved({"particles": lambda: run_particles(fk, n), "ours": lambda b=b: run_ours(ys, n, filters=b, compile=None)}, repeats=repeats)
        per_particles = 1e3 * t["particles"]["median_s"]
        per_ours = 1e3 * t["ours"]["median_s"] / b
        batched.append({"B": b, "N": n, "T": T, "particles_ms": per_particles, "ours_ms_per_filter": per_ours,
                        "ratio_per_filter": per_ours / per_particles, "timings": t})
        rows.append([b, per_particles, 1e3 * t["ours"]["median_s"], per_ours, per_ours / per_particles])
    print_table(["B", "particles ms / run", "SMC ms / pass", "SMC ms / filter", "ratio per filter"], rows,
                title=f"B filters in one pass against B runs of particles (N = {n}, T = {T})")

    # Same model, same answer: log Z_hat of both libraries over independent runs.
    torch.manual_seed(0)
    np.random.seed(0)
    n_check = sizes[0]
    ours_lz = run_ours(ys, n_check, filters=runs, compile=None).tolist()
    theirs_lz = [run_particles(fk, n_check) for _ in progress(range(runs), "particles log Z", args)]
    (m_ours, se_ours), (m_theirs, se_theirs) = mean_se(ours_lz), mean_se(theirs_lz)
    z = abs(m_ours - m_theirs) / math.hypot(se_ours, se_theirs)
    print(f"\nlog Z_hat, N = {n_check}, T = {T}, {runs} runs each: SMC {m_ours:.3f} +- {se_ours:.3f}, "
          f"particles {m_theirs:.3f} +- {se_theirs:.3f}  (difference {z:.1f} standard errors; must be < 5)")

    prof = profile_steps(ys, 1000, repeats)
    order = ["user step under Pyro's handlers", "site log-densities", "centring the weight terms", "normalisation and the rest of the step",
             "recording (ESS, means, histories)", "resampling", "run() outside the steps", "whole step"]
    print_table(["stage", "us / step", "share of a step"], [[k, prof[k], f"{100 * prof[k] / prof['whole step']:.0f}%"] for k in order],
                title=f"Where one SMC step goes on Pyro's handlers (compile=False, N = 1000, T = {T}, B = 1, validation on)")

    compiled_profiles = {}
    for n in sizes[:2]:
        compiled_profiles[n] = profile_compiled(ys, n, repeats)
    order = ["the compiled loop (the rest of the run)", "replay (the recording's call)", "resampling (replayed steps)",
             "the program on the handlers (init, the verifying step)", "engine Python around them", "run() outside the steps"]
    print_table(["stage"] + [f"N = {n} us / step" for n in compiled_profiles],
                [[k] + [compiled_profiles[n].get(k, 0.0) for n in compiled_profiles] for k in order],
                title=f"Where a compiled step goes (recording kept, T = {T}, B = 1, per step of the run)")

    write_results(
        "particles_speed",
        {
            "settings": {"model": "SV", "alpha": ALPHA, "sigma": SIGMA, "beta": BETA, "dtype": "float64", "resampling": "systematic",
                         "ess_threshold": 0.5, "repeats": repeats, "horizons": horizons, "sizes": sizes, "batches": batches},
            "goal": "B = 1 at most 1.0x particles at N = 1000, at most 1.3x the hand-written floor at every N; ahead per filter from 10 filters",
            "single": single,
            "batched": batched,
            "log_evidence_check": {"N": n_check, "T": T, "runs": runs, "ours_mean": m_ours, "ours_se": se_ours,
                                   "particles_mean": m_theirs, "particles_se": se_theirs, "z": z, "agree": z < 5},
            "profile_us_per_step": prof,
            "profile_compiled_us_per_step": {str(n): v for n, v in compiled_profiles.items()},
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
