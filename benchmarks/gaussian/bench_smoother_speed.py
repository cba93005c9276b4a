"""Time per time step of the Gaussian filters and smoothers and of EP on a long series.

The pendulum of Sarkka and Svensson's book (2-d state, 1-d observation, ``dt = 0.01``; the model
of ``bench_ep_pendulum.py``), one simulated trajectory of ``--steps`` time steps (default 10^4),
float64, one thread. Contenders, interleaved within each repeat (median of ``--repeats`` after one
warm-up):

* ``floor``: a hand-written unscented filter and RTS smoother in plain PyTorch, written for this
  model only (no checks, no missing data, fixed sigma-point weights, the backward pass by a loop):
  what a user who writes the recursion by hand pays per step on this machine;
* ``unscented_kalman_filter``, ``unscented_rts_smoother`` (URTSS), ``extended_rts_smoother``
  (ERTSS), the library's, with their checks; their forward pass is recorded once per run and
  replayed (``pyro_smc/infer/gaussian/recorded.py``);
* ``URTSS eager`` and ``ERTSS eager``: the same inside ``recording(False)``, the lean steps run
  from Python (what a time-dependent map or a partly observed step gets);
* ``EPSmoother(schedule="parallel")`` and ``schedule="sequential"`` with the unscented
  projection, ``max_iter=3``: the time per sweep is the total over 3 sweeps (the first is the
  plain smoother); the sequential schedule runs on the first ``--ep-steps`` steps only (default
  2000; it is linear in T) and is reported per time step.

Goals (issue 28): URTSS and ERTSS <= 100 us per time step; EP's parallel schedule well under the
sequential one and within 3x of one URTSS pass per sweep.

Run: ``python benchmarks/gaussian/bench_smoother_speed.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, met_summary, print_table, setup, timeit_interleaved, write_results
from benchmarks.gaussian.bench_ep_pendulum import make_ssm, observation, simulate, transition
from pyro_smc import EPSmoother
from pyro_smc.infer import extended_rts_smoother, unscented_kalman_filter, unscented_rts_smoother
from pyro_smc.infer.gaussian.recorded import recording

GOAL_US = 100.0
EP_SWEEPS = 3


def hand_written_urtss(ssm, ys: torch.Tensor) -> torch.Tensor:
    """The floor: an unscented filter and RTS smoother for this model, written out by hand."""
    d = ssm.init_mean.shape[-1]
    lam = 3.0 - d  # alpha 1, beta 0, kappa 3 - d: the library's default
    wm = torch.full((2 * d + 1,), 0.5 / (d + lam), dtype=ys.dtype)
    wm[0] = lam / (d + lam)
    spread = math.sqrt(d + lam)
    Q, R = ssm.transition_cov, ssm.observation_cov

    def ut(f, m, P):
        off = spread * torch.linalg.cholesky(P).mT
        dx = torch.cat([torch.zeros_like(off[:1]), off, -off])
        v = f(m + dx)
        mu = wm @ v
        dv = v - mu
        w = (dv * wm[:, None]).mT
        return mu, w @ dv, (w @ dx).mT

    m, P = ssm.init_mean, ssm.init_cov
    fm, fP, pm, pP, cross = [], [], [], [], []
    for t in range(ys.shape[0]):
        if t > 0:
            M, S, C = ut(transition, m, P)
            m, P = M, S + Q
            pm.append(m)
            pP.append(P)
            cross.append(C)
        if not bool(torch.isnan(ys[t]).all()):
            mu, Sy, Cy = ut(observation, m, P)
            Kt = torch.cholesky_solve(Cy.mT, torch.linalg.cholesky(Sy + R))
            m = m + (ys[t] - mu) @ Kt
            P = P - Cy @ Kt
            P = (P + P.mT) / 2
        fm.append(m)
        fP.append(P)
    ms, Ps = [fm[-1]], [fP[-1]]
    for t in range(len(fm) - 2, -1, -1):
        G = torch.linalg.solve(pP[t], cross[t].mT).mT
        ms.append(fm[t] + G @ (ms[-1] - pm[t]))
        Ps.append(fP[t] + G @ (Ps[-1] - pP[t]) @ G.mT)
    return torch.stack(ms[::-1])


def eager(engine, ssm, ys):
    """``engine`` with the recorded forward pass turned off."""
    with recording(False):
        return engine(ssm, ys)


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows microseconds per time step against the hand-written floor and the goals.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    us, goals = d["us_per_step"], d["goals"]
    return {
        "ours": ", ".join(f"{k} {us[k]:.0f}" for k in ("UKF", "URTSS", "ERTSS")) + " us/step; EP per sweep: "
        + ", ".join(f"{k} {us[k]:.0f}" for k in ("EP parallel", "EP sequential")) + f" us/step (T = {d['settings']['steps']})",
        "anchor": f"hand-written UKF + RTS in PyTorch: {us['floor']:.0f} us/step",
        "comparison": f"URTSS / floor {f2(us['URTSS'] / us['floor'])}, EP parallel / URTSS {f2(us['EP parallel'] / us['URTSS'])}, "
        f"EP sequential / parallel {f2(us['EP sequential'] / us['EP parallel'])}",
        "goal": "URTSS and ERTSS <= 100 us/step; EP parallel within 3x of URTSS per sweep (issue 28)",
        "met": met_summary(goals),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=10_000, help="time steps T")
    parser.add_argument("--ep-steps", type=int, default=2000, help="time steps of the sequential EP run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup(args)
    steps, ep_steps = (300, 100) if args.quick else (args.steps, min(args.ep_steps, args.steps))
    ssm = make_ssm()
    _, ys = simulate(0, steps - 1)
    parallel = EPSmoother(ssm, projection="unscented", schedule="parallel", max_iter=EP_SWEEPS, tol=1e-12)
    sequential = EPSmoother(ssm, projection="unscented", schedule="sequential", max_iter=EP_SWEEPS, tol=1e-12)
    contenders = {
        "floor": lambda: hand_written_urtss(ssm, ys),
        "UKF": lambda: unscented_kalman_filter(ssm, ys),
        "URTSS": lambda: unscented_rts_smoother(ssm, ys),
        "ERTSS": lambda: extended_rts_smoother(ssm, ys),
        "URTSS eager": lambda: eager(unscented_rts_smoother, ssm, ys),
        "ERTSS eager": lambda: eager(extended_rts_smoother, ssm, ys),
        "EP parallel": lambda: parallel.smooth(ys),
        "EP sequential": lambda: sequential.smooth(ys[:ep_steps]),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EP stops at max_iter on purpose (a fixed number of sweeps)
        timing = timeit_interleaved(contenders, repeats=args.repeats, desc="smoothers", args=args)
    per = {"EP parallel": steps * EP_SWEEPS, "EP sequential": ep_steps * EP_SWEEPS}
    us = {name: t["median_s"] / per.get(name, steps) * 1e6 for name, t in timing.items()}
    error = float((unscented_rts_smoother(ssm, ys).means - hand_written_urtss(ssm, ys)).abs().max())
    recorded_vs_eager = {
        "URTSS": float((unscented_rts_smoother(ssm, ys).means - eager(unscented_rts_smoother, ssm, ys).means).abs().max()),
        "ERTSS": float((extended_rts_smoother(ssm, ys).means - eager(extended_rts_smoother, ssm, ys).means).abs().max()),
    }
    goals = {
        "URTSS <= 100 us": us["URTSS"] <= GOAL_US,
        "ERTSS <= 100 us": us["ERTSS"] <= GOAL_US,
        "EP parallel <= 3x URTSS": us["EP parallel"] <= 3 * us["URTSS"],
        "EP parallel < sequential": us["EP parallel"] < us["EP sequential"],
    }
    rows = [[name, f"{v:.0f}", f2(v / us["floor"])] for name, v in us.items()]
    print_table(["contender", "us per step (EP: per sweep)", "/ floor"], rows, title=f"pendulum, T = {steps}, float64, {args.threads} thread(s)")
    print(f"URTSS means against the hand-written floor's: max |difference| {error:.2e}")
    print("recorded against eager means, max |difference|: " + ", ".join(f"{k} {v:.2e}" for k, v in recorded_vs_eager.items()))
    for name, ok in goals.items():
        print(f"  {name}: {'met' if ok else 'not met'}")
    payload = {
        "settings": {"steps": steps, "ep_steps": ep_steps, "ep_sweeps": EP_SWEEPS, "repeats": args.repeats, "model": "pendulum (bench_ep_pendulum.py)"},
        "timing": timing,
        "us_per_step": us,
        "urtss_vs_floor_max_abs_difference": error,
        "recorded_vs_eager_max_abs_difference": recorded_vs_eager,
        "goals": goals,
    }
    write_results("bench_smoother_speed", payload, dtype=torch.float64, summary=summary_cells)


if __name__ == "__main__":
    main()
