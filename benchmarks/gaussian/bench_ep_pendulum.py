"""Pendulum tracking from Sarkka and Svensson, *Bayesian Filtering and Smoothing* (2nd ed., 2023).

Model (the book's examples 7.6 / 8.19 / 13.2 / 14.10 and its code, github.com/EEA-sensors/Bayesian-Filtering-and-Smoothing):

    x = (angle, angular velocity),  dt = 0.01,  g = 9.81,  qc = 0.01,  R = 0.1
    x_k = (x1 + dt x2,  x2 - g sin(x1) dt)_{k-1} + q_{k-1},  q ~ N(0, qc [[dt^3/3, dt^2/2], [dt^2/2, dt]])
    y_k = sin(x1_k) + r_k,  r_k ~ N(0, R),  k = 1, ..., 500

The true trajectory starts at x_0 = (1.5, 0); the filters start from the prior m_0 = (0, 0),
P_0 = I on x_0 and predict before the first measurement. We model x_0..x_500 (T = 501) with
``y_0`` missing and score the angle RMSE over k = 1..500, as the book's notebooks do.

Data: the book's own data set (``benchmarks/data/pendulum_sarkka_svensson_2023.json``, simulated
by its MATLAB code with ``rng(1)``, MIT licence) on which its notebooks print ERTS 0.0574,
URTS 0.0366 and IPLS 0.0347, plus ``--seeds`` trajectories simulated here from the same model.

Contenders: EKF/ERTS (``extended_rts_smoother``), UKF/URTS (``unscented_rts_smoother``, the
book's sigma points alpha = 1, beta = 0, kappa = 3 - n, the library default), and
``EPSmoother`` with ``"linearization"`` and ``"unscented"`` projections (plain EP: power 1,
damping 1, up to ``--max-iter`` sweeps, tol 1e-6). The book's IPLS (iterated posterior
linearisation smoother, Gauss-Hermite order 3, 10 iterations) is not in the library; its
number is the anchor for the iterated smoothers.

Run: ``python benchmarks/gaussian/bench_ep_pendulum.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, f3, f4, met_summary, print_table, progress, setup, write_results
from pyro_smc import EPSmoother
from pyro_smc.infer import extended_kalman_filter, extended_rts_smoother, unscented_kalman_filter, unscented_rts_smoother
from pyro_smc.models import NonlinearGaussianSSM

DT, G, QC, R = 0.01, 9.81, 0.01, 0.1
STEPS = 500
X0 = (1.5, 0.0)
DATA = Path(__file__).resolve().parents[1] / "data" / "pendulum_sarkka_svensson_2023.json"
# The book's notebooks on its data set (python/example_notebooks/pendulum_*.ipynb, angle RMSE).
ANCHORS = {"EKF": 0.1683, "ERTS": 0.0574, "UKF": 0.0952, "URTS": 0.0366, "IPLS (book)": 0.0347}


def transition(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[..., 0] + DT * x[..., 1], x[..., 1] - G * torch.sin(x[..., 0]) * DT], -1)


def observation(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x[..., :1])


def process_cov() -> torch.Tensor:
    return QC * torch.tensor([[DT**3 / 3, DT**2 / 2], [DT**2 / 2, DT]], dtype=torch.float64)


def make_ssm() -> NonlinearGaussianSSM:
    f64 = torch.float64
    return NonlinearGaussianSSM(transition, process_cov(), observation, R * torch.eye(1, dtype=f64), torch.zeros(2, dtype=f64), torch.eye(2, dtype=f64))


def book_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``(angles (501,), ys (501, 1))`` of the book's data set with x_0 prepended and y_0 = NaN."""
    d = json.loads(DATA.read_text())
    angles = torch.tensor([X0[0]] + d["angle"], dtype=torch.float64)
    ys = torch.tensor([math.nan] + d["y"], dtype=torch.float64).unsqueeze(-1)
    return angles, ys


def simulate(seed: int, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """A trajectory from x_0 = (1.5, 0) like the book's ``pendulum_sim.m``: ``(angles, ys)`` as :func:`book_data`."""
    gen = torch.Generator().manual_seed(seed)
    chol_q = torch.linalg.cholesky(process_cov())
    x = torch.tensor(X0, dtype=torch.float64)
    angles, ys = [x[0]], [torch.tensor(math.nan, dtype=torch.float64)]
    for _ in range(steps):
        x = transition(x) + chol_q @ torch.randn(2, generator=gen, dtype=torch.float64)
        angles.append(x[0])
        ys.append(torch.sin(x[0]) + math.sqrt(R) * torch.randn((), generator=gen, dtype=torch.float64))
    return torch.stack(angles), torch.stack(ys).unsqueeze(-1)


def angle_rmse(result, angles: torch.Tensor) -> float:
    return float(((result.means[1:, 0] - angles[1:]) ** 2).mean().sqrt())


def run_all(ssm, angles, ys, max_iter: int) -> dict:
    out = {}

    def record(name, fn):
        start = time.perf_counter()
        result = fn()
        out[name] = {"rmse": angle_rmse(result, angles), "seconds": time.perf_counter() - start}
        if result.history:
            out[name]["sweeps"] = len(result.history)
            out[name]["converged"] = bool(result.converged)
            out[name]["skipped"] = int(sum(h.skipped for h in result.history))
            out[name]["first_sweep_rmse"] = angle_rmse(result.first_sweep, angles)

    record("EKF", lambda: extended_kalman_filter(ssm, ys))
    record("ERTS", lambda: extended_rts_smoother(ssm, ys))
    record("UKF", lambda: unscented_kalman_filter(ssm, ys))
    record("URTS", lambda: unscented_rts_smoother(ssm, ys))
    record("EP linearization", lambda: EPSmoother(ssm, "linearization", max_iter=max_iter).smooth(ys))
    record("EP unscented", lambda: EPSmoother(ssm, "unscented", max_iter=max_iter).smooth(ys))
    return out


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows angle RMSE of the smoothers against the book's.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    book, ours = d["anchors_book"], d["book_data"]
    shared = [k for k in ("EKF", "ERTS", "UKF", "URTS") if k in book and k in ours]
    eps = [k for k in ("EP linearization", "EP unscented") if k in ours]
    sims = d.get("simulated", {})
    sim_mean = {k: statistics.mean(s[k]["rmse"] for s in sims.values()) for k in eps if sims and all(k in s for s in sims.values())}
    matches = {k: round(ours[k]["rmse"], 4) == round(book[k], 4) for k in shared}
    ipls = next((v for k, v in book.items() if k.startswith("IPLS")), None)
    best_ep = min(eps, key=lambda k: ours[k]["rmse"]) if eps else None
    comparison = f"equal to the book to 4 decimals: {sum(matches.values())}/{len(matches)} ({', '.join(k for k, v in matches.items() if v)})"
    if ipls is not None and best_ep:
        comparison += f"; {best_ep} / IPLS {f2(ours[best_ep]['rmse'] / ipls)}"
    return {
        "ours": "angle RMSE on the book's data: " + ", ".join(f"{k} {f4(ours[k]['rmse'])}" for k in ("ERTS", "URTS", *eps) if k in ours)
        + ("; mean of simulations: " + ", ".join(f"{k} {f3(v)}" for k, v in sim_mean.items()) if sim_mean else ""),
        "anchor": "Sarkka and Svensson (2023): " + ", ".join(f"{k} {f4(v)}" for k, v in book.items()),
        "comparison": comparison,
        "goal": "match the book (main README)",
        "met": met_summary(matches),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--seeds", type=int, default=5, help="simulated trajectories besides the book's data set")
    parser.add_argument("--max-iter", type=int, default=10, help="EP sweeps at most (plain EP, tol 1e-6)")
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)  # no gradients needed; the linearization's Jacobians use autograd internally
    steps = 60 if args.quick else STEPS
    num_seeds = 1 if args.quick else args.seeds
    max_iter = 3 if args.quick else args.max_iter
    ssm = make_ssm()

    angles, ys = book_data()
    book = run_all(ssm, angles[: steps + 1], ys[: steps + 1], max_iter)
    seeds = {}
    for seed in progress(range(num_seeds), "simulations"):
        a, y = simulate(seed, steps)
        seeds[seed] = run_all(ssm, a, y, max_iter)

    rows = []
    for name in book:
        vals = torch.tensor([seeds[s][name]["rmse"] for s in seeds])
        se = float(vals.std() / math.sqrt(len(vals))) if len(vals) > 1 else float("nan")
        sweeps = book[name].get("sweeps", "")
        rows.append([name, book[name]["rmse"], ANCHORS.get(name, ""), float(vals.mean()), se, sweeps, book[name]["seconds"]])
    rows.append(["IPLS (book)", "", ANCHORS["IPLS (book)"], "", "", "", ""])
    print_table(
        ["method", "book data RMSE", "book's number", f"mean of {num_seeds} sims", "se", "EP sweeps", "s (book data)"],
        rows,
        title=f"Pendulum angle RMSE, {steps} steps, prior N(0, I) on x_0, EP power 1, damping 1, max {max_iter} sweeps",
    )
    write_results(
        "bench_ep_pendulum",
        {
            "settings": {"dt": DT, "g": G, "qc": QC, "R": R, "steps": steps, "x0_true": X0, "prior": "N(0, I) on x_0", "ep_max_iter": max_iter,
                         "ep_power": 1.0, "ep_damping": 1.0, "unscented": "alpha 1, beta 0, kappa 3 - n (library default = book)"},
            "anchors_book": ANCHORS,
            "book_data": book,
            "simulated": {str(k): v for k, v in seeds.items()},
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
