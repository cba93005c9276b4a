"""The variance of ``log Z_hat``: bootstrap against the auxiliary filter and SQMC, at equal N (issue 30).

Two models, one simulated data set each, float64:

* ``lg``: linear-Gaussian, ``d = 2``, ``x_t = 0.9 x_{t-1} + N(0, I)``, ``y_t = x_t + N(0, 0.25 I)``,
  ``x_0 ~ N(0, I)``; ``log p(y)`` exact by Kalman, so the bias of ``log Z_hat`` is reported too.
  The look-ahead is exact, :math:`\\eta_t = p(y_t \\mid x_{t-1})`, and the guided proposal is the
  locally optimal :math:`p(x_t \\mid x_{t-1}, y_t)`: with both the filter is fully adapted.
* ``sv``: stochastic volatility with the parameters of Pitt and Shephard (1999)
  (``mu = -1.02``, ``rho = 0.9702``, ``sigma = 0.178``), ``y_t ~ N(0, exp(x_t))``; the guided
  proposal and the look-ahead are theirs (a Gaussian from a first-order expansion of
  :math:`\\log g` around the predictive mean, and the matching :math:`\\eta_t`).

Contenders (``N`` particles each, systematic resampling when the ESS falls below ``N / 2``; SQMC
resamples at every step, as Gerber and Chopin do):

* ``bootstrap``: ``SMC(model)``; ``aux. bootstrap``: ``SMC(model, auxiliary=True)`` (the model's
  transition proposes, the look-ahead chooses the ancestors); ``guided``: ``SMC(model, guide)``;
  ``APF``: ``SMC(model, guide, auxiliary=True)``; ``SQMC``: ``SMC(model, qmc=True)``;
  ``SQMC + APF``: ``SMC(model, guide, auxiliary=True, qmc=True)``.
* The same six in ``particles`` (Chopin's library, NumPy): ``Bootstrap``, ``AuxiliaryBootstrap``,
  ``GuidedPF``, ``AuxiliaryPF``, each with ``qmc=False``, and ``Bootstrap`` / ``AuxiliaryPF`` with
  ``qmc=True``, on the same data.

``log Z_hat`` variance over ``R`` independent runs (``SMC``: ``num_filters=R`` in one pass;
``particles``: ``R`` runs); the ratio ``var(bootstrap) / var(contender)`` within each library is the
variance reduction. Time: one filter (``B = 1``) per contender, the two libraries interleaved in
one process, medians.

Run: ``python benchmarks/smc/bench_apf_sqmc.py`` (``--quick``: a smoke run).
Results: ``results/smc/apf_sqmc.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, load_average, print_table, setup, timeit_interleaved, write_results
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM

CONTENDERS = ("bootstrap", "aux. bootstrap", "guided", "APF", "SQMC", "SQMC + APF")
SV = {"mu": -1.02, "rho": 0.9702, "sigma": 0.178}


# --- the linear-Gaussian model with its look-ahead and locally optimal proposal -------------------


class LookAheadLG(LinearGaussianSSM):
    def look_ahead(self, state, y):
        cov = self.C @ self.Q @ self.C.T + self.R
        return dist.MultivariateNormal(state["x"] @ (self.C @ self.A).T, cov).log_prob(y)


class OptimalLG:
    """``p(x_t | x_{t-1}, y_t)`` and ``eta_t = p(y_t | x_{t-1})``: the fully adapted filter."""

    def __init__(self, ssm):
        self.ssm = ssm

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        s = self.ssm
        mean, cov = (state["x"] @ s.A.T, s.Q) if "x" in state else (s.init_mean, s.init_cov)
        gain = cov @ s.C.T @ torch.linalg.inv(s.C @ cov @ s.C.T + s.R)
        loc = mean + (y - mean @ s.C.T) @ gain.T
        pyro.sample(f"x_{self.t}", dist.MultivariateNormal(loc, cov - gain @ s.C @ cov))
        self.t += 1

    def look_ahead(self, state, y):
        return LookAheadLG.look_ahead(self.ssm, state, y)


# --- stochastic volatility with Pitt and Shephard's proposal and look-ahead ------------------------


def _predictive_mean(x):
    return SV["mu"] + SV["rho"] * (x - SV["mu"])


def _xhat(mean, sd, y):
    # The mode of N(mean, sd^2) times the first-order expansion of log N(y; 0, e^x) around mean.
    return mean + 0.5 * sd**2 * (y**2 * torch.exp(-mean) - 1.0)


class StochVol:
    def __init__(self):
        self.sd0 = SV["sigma"] / math.sqrt(1 - SV["rho"] ** 2)

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        if "x" in state:
            prior = dist.Normal(_predictive_mean(state["x"]), SV["sigma"])
        else:
            prior = dist.Normal(torch.tensor(SV["mu"]), self.sd0)
        state["x"] = pyro.sample(f"x_{self.t}", prior)
        pyro.sample(f"y_{self.t}", dist.Normal(0.0, torch.exp(0.5 * state["x"])), obs=y)
        self.t += 1

    def look_ahead(self, state, y):
        mean = _predictive_mean(state["x"])
        xhat = _xhat(mean, SV["sigma"], y)
        # log of the integral of f(x | x_prev) times the expanded g, up to a constant.
        centred, centred_hat = mean - SV["mu"], xhat - SV["mu"]
        return 0.5 / SV["sigma"] ** 2 * (centred_hat**2 - centred**2) - 0.5 * y**2 * torch.exp(-mean) * (1.0 + centred)


class PittShephard:
    def __init__(self, model):
        self.model = model

    def init(self, state):
        self.t = 0

    def step(self, state, y):
        if "x" in state:
            loc, sd = _xhat(_predictive_mean(state["x"]), SV["sigma"], y), SV["sigma"]
        else:
            # As particles' StochVol.proposal0: the expansion around 0.
            sd = self.model.sd0
            loc = _xhat(torch.zeros_like(y), sd, y)
        pyro.sample(f"x_{self.t}", dist.Normal(loc, sd))
        self.t += 1

    def look_ahead(self, state, y):
        return self.model.look_ahead(state, y)


# --- the contenders -------------------------------------------------------------------------------


def ours(name, model, guide, N, B):
    options = {
        "bootstrap": (None, {}),
        "aux. bootstrap": (None, {"auxiliary": True}),
        "guided": (guide, {}),
        "APF": (guide, {"auxiliary": True}),
        "SQMC": (None, {"qmc": True}),
        "SQMC + APF": (guide, {"auxiliary": True, "qmc": True}),
    }[name]
    return lambda ys: SMC(model, options[0], num_particles=N, num_filters=B, compile=False, **options[1]).run(ys).log_evidence


def theirs(name, fk_ssm, data, N):
    import particles
    from particles import state_space_models as ssms

    kind, qmc = {
        "bootstrap": (ssms.Bootstrap, False),
        "aux. bootstrap": (ssms.AuxiliaryBootstrap, False),
        "guided": (ssms.GuidedPF, False),
        "APF": (ssms.AuxiliaryPF, False),
        "SQMC": (ssms.Bootstrap, True),
        "SQMC + APF": (ssms.AuxiliaryPF, True),
    }[name]

    def run():
        pf = particles.SMC(fk=kind(ssm=fk_ssm, data=data), N=N, resampling="systematic", ESSrmin=0.5, qmc=qmc, collect=None)
        pf.run()
        return pf.logLt

    return run


def build(model_name, T, seed):
    from particles import kalman
    from particles import state_space_models as ssms

    torch.manual_seed(seed)
    np.random.seed(seed)
    if model_name == "lg":
        eye = torch.eye(2)
        model = LookAheadLG(0.9 * eye, eye, eye, 0.25 * eye, torch.zeros(2), eye)
        ys = model.simulate(T)[1]
        fk = kalman.MVLinearGauss(F=0.9 * np.eye(2), G=np.eye(2), covX=np.eye(2), covY=0.25 * np.eye(2), mu0=np.zeros(2), cov0=np.eye(2))
        return model, OptimalLG(model), ys, fk, list(ys.numpy()), float(model.log_evidence(ys))
    fk = ssms.StochVol(**SV)
    _, data = fk.simulate(T)
    ys = torch.tensor(np.array(data).reshape(T))
    model = StochVol()
    return model, PittShephard(model), ys, fk, [float(v) for v in ys], None


def measure(model_name, T, N, R, repeats, seed=0):
    model, guide, ys, fk, data, exact = build(model_name, T, seed)
    rows = {}
    for name in CONTENDERS:
        torch.manual_seed(seed + 1)
        log_z = ours(name, model, guide, N, R)(ys).detach().numpy()
        np.random.seed(seed + 1)
        run = theirs(name, fk, data, N)
        log_z_p = np.array([run() for _ in range(R)])
        rows[name] = {"ours": _stats(log_z, exact), "particles": _stats(log_z_p, exact)}
    single = {f"ours {n}": _bound(ours(n, model, guide, N, 1), ys) for n in CONTENDERS}
    timing = timeit_interleaved({**single, **{f"particles {n}": theirs(n, fk, data, N) for n in CONTENDERS}}, repeats=repeats)
    for name in CONTENDERS:
        for lib in ("ours", "particles"):
            rows[name][lib]["time_s"] = timing[f"{lib} {name}"]["median_s"]
            rows[name][lib]["variance_reduction"] = rows["bootstrap"][lib]["var"] / rows[name][lib]["var"]
    return {"model": model_name, "T": T, "N": N, "R": R, "exact_log_evidence": exact, "rows": rows}


def _bound(run, ys):
    return lambda: run(ys)


def _stats(log_z, exact):
    out = {"mean": float(np.mean(log_z)), "var": float(np.var(log_z, ddof=1)), "sd_of_var": float(np.var(log_z, ddof=1) * math.sqrt(2 / (len(log_z) - 1)))}
    if exact is not None:
        out["bias"] = out["mean"] - exact
        out["bias_se"] = float(np.std(log_z, ddof=1) / math.sqrt(len(log_z)))
    return out


def summary_cells(d: dict) -> dict:
    """This benchmark's row in the summary table (``_common.summary_record``)."""
    parts = []
    for result in d["results"]:
        rows = result["rows"]
        parts.append(
            f"{result['model']}: APF {rows['APF']['ours']['variance_reduction']:.1f}x, SQMC {rows['SQMC']['ours']['variance_reduction']:.1f}x, "
            f"SQMC+APF {rows['SQMC + APF']['ours']['variance_reduction']:.1f}x"
        )
    anchor = [
        f"{r['model']}: APF {r['rows']['APF']['particles']['variance_reduction']:.1f}x, SQMC {r['rows']['SQMC']['particles']['variance_reduction']:.1f}x"
        for r in d["results"]
    ]
    met = all(r["rows"][n]["ours"]["variance_reduction"] > 1 for r in d["results"] for n in ("APF", "SQMC"))
    return {
        "ours": "; ".join(parts),
        "anchor": "particles " + "; ".join(anchor),
        "comparison": "log Z variance reduction over bootstrap at equal N",
        "goal": "APF and SQMC reduce the log Z variance (ratio > 1)",
        "met": "yes" if met else "no",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=300, help="independent runs R per contender")
    parser.add_argument("--particles", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    setup(args)
    torch.set_default_dtype(torch.float64)
    if args.quick:
        args.runs, args.steps, args.repeats = 20, 20, 1
    results = [measure(m, args.steps, args.particles, args.runs, args.repeats) for m in ("lg", "sv")]
    for result in results:
        table = []
        for name in CONTENDERS:
            row = result["rows"][name]
            table.append(
                [
                    name,
                    row["ours"]["var"],
                    row["ours"]["variance_reduction"],
                    row["ours"].get("bias", float("nan")),
                    row["ours"]["time_s"] * 1e3,
                    row["particles"]["var"],
                    row["particles"]["variance_reduction"],
                    row["particles"]["time_s"] * 1e3,
                ]
            )
        headers = ["contender", "var SMC", "ratio SMC", "bias SMC", "ms SMC", "var particles", "ratio particles", "ms particles"]
        print_table(headers, table, title=f"{result['model']}: T = {result['T']}, N = {result['N']}, R = {result['R']} runs")
    print(f"load average: {load_average()}")
    write_results(
        "apf_sqmc",
        {
            "settings": {
                "runs": args.runs,
                "particles": args.particles,
                "steps": args.steps,
                "ess_threshold": 0.5,
                "resampling": "systematic",
                "dtype": "float64",
                "load_average": load_average(),
            },
            "results": results,
        },
        dtype=torch.float64,
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
