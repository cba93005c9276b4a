"""pyro_smc.SMC against pyro.infer.SMCFilter on the paper's linear-Gaussian model (forward only).

Model: d = 2, A = 0.5 I, Q = I, C = I, R = 0.1 I, x_1 ~ N(0, I), T = 150. Both filters use
systematic resampling at ESS < N / 2. Three timings per N:

* ``SMCFilter``: ``pyro.infer.SMCFilter(model, guide, N, max_plate_nesting=0)``, ``init()`` then
  ``step(y)`` per observation; its weights are computed under ``torch.no_grad``.
* ``ours+guide``: ``SMC(model, guide, num_particles=N)`` with the same bootstrap guide.
* ``ours``: ``SMC(model, num_particles=N)`` (no guide: the model's transition is the proposal,
  one trace per step instead of two).

``SMC`` keeps the autograd graph of the log-weights; here no parameter requires grad, so
``log_evidence.requires_grad`` is False and no graph is built (that is the fair comparison with
SMCFilter's no_grad weights; with parameters requiring grad ours would also record a graph).

Run: ``python benchmarks/smc/bench_smcfilter.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SMCFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, print_table, progress, setup, slash, timeit_interleaved, write_results, yn
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import SystematicResampler


class BootstrapGuide:
    """Proposes ``x_t`` from the model's transition (from the prior at the first step)."""

    def __init__(self, ssm: LinearGaussianSSM):
        self.ssm = ssm
        self._t = 0

    def init(self, state):
        self._t = 0
        self._scale_q = torch.linalg.cholesky(self.ssm.Q)
        self._scale_0 = torch.linalg.cholesky(self.ssm.init_cov)

    def step(self, state, y=None):
        t = self._t
        if "x" in state:
            proposal = dist.MultivariateNormal(state["x"] @ self.ssm.A.transpose(-1, -2), scale_tril=self._scale_q)
        else:
            proposal = dist.MultivariateNormal(self.ssm.init_mean, scale_tril=self._scale_0)
        pyro.sample(f"x_{t}", proposal)
        self._t = t + 1


def make_ssm(theta: float = 0.5) -> LinearGaussianSSM:
    eye = torch.eye(2)
    return LinearGaussianSSM(theta * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)


def run_smcfilter(ssm, guide, ys, n):
    smc = SMCFilter(ssm, guide, num_particles=n, max_plate_nesting=0)
    smc.init()
    for y in ys:
        smc.step(y)
    return smc


def run_ours(ssm, guide, ys, n):
    return SMC(ssm, guide, num_particles=n, resampler=SystematicResampler()).run(ys)


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows forward cost per step against ``pyro.infer.SMCFilter``.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    res = sorted(d["results"], key=lambda r: r["num_particles"])
    ns = " / ".join(str(r["num_particles"]) for r in res)
    boot = [r["ratio_ours_bootstrap_over_smcfilter"] for r in res]
    guide = [r["ratio_ours_guide_over_smcfilter"] for r in res]
    return {
        "ours": f"forward ms/step at N = {ns}: ours (guide=None) {slash([r['ours_bootstrap_ms_per_step'] for r in res], f2)}; "
        f"ours + guide {slash([r['ours_guide_ms_per_step'] for r in res], f2)}",
        "anchor": f"`pyro.infer.SMCFilter` {slash([r['smcfilter_ms_per_step'] for r in res], f2)} ms/step",
        "comparison": f"ours / SMCFilter {slash(boot, f2)}; ours + guide / SMCFilter {slash(guide, f2)}",
        "goal": d.get("goal", "ratio ours/SMCFilter <= 1 (aim 0.5)"),
        "met": f"guide=None: {yn(max(boot) <= 1)}; + guide: {yn(max(guide) <= 1)}; aim 0.5: {yn(max(boot) <= 0.5)}",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    setup(args)

    particles = [100] if args.quick else [100, 1000]
    T = 20 if args.quick else 150
    repeats = 2 if args.quick else args.repeats

    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    ssm = make_ssm(0.5)
    _, ys = ssm.simulate(T)
    exact = float(ssm.log_evidence(ys))
    guide = BootstrapGuide(ssm)

    rows, records = [], []
    for n in progress(particles, "particle counts", args):
        timings = timeit_interleaved(
            {
                "smcfilter": lambda n=n: run_smcfilter(ssm, guide, ys, n),
                "ours_guide": lambda n=n: run_ours(ssm, guide, ys, n),
                "ours_bootstrap": lambda n=n: run_ours(ssm, None, ys, n),
            },
            repeats=repeats,
        )
        t_ref, t_guide, t_boot = timings["smcfilter"], timings["ours_guide"], timings["ours_bootstrap"]
        # Sanity: both estimate the same log-evidence; SMCFilter has no log_evidence attribute,
        # so only ours is compared with the Kalman value.
        ours = run_ours(ssm, None, ys, n)
        log_z = float(ours.log_evidence[0])
        ms = lambda t: 1e3 * t["median_s"] / T  # noqa: E731
        rec = {
            "num_particles": n,
            "T": T,
            "smcfilter_ms_per_step": ms(t_ref),
            "ours_guide_ms_per_step": ms(t_guide),
            "ours_bootstrap_ms_per_step": ms(t_boot),
            "ratio_ours_guide_over_smcfilter": t_guide["median_s"] / t_ref["median_s"],
            "ratio_ours_bootstrap_over_smcfilter": t_boot["median_s"] / t_ref["median_s"],
            "timings": timings,
            "ours_log_evidence": log_z,
            "kalman_log_evidence": exact,
            "ours_log_evidence_requires_grad": bool(ours.log_evidence.requires_grad),
        }
        records.append(rec)
        rows.append([n, ms(t_ref), ms(t_guide), ms(t_boot), rec["ratio_ours_guide_over_smcfilter"], rec["ratio_ours_bootstrap_over_smcfilter"], log_z - exact])

    print_table(
        ["N", "SMCFilter ms/step", "ours+guide ms/step", "ours ms/step", "ratio guide", "ratio boot", "logZ-Kalman"],
        rows,
        title=f"Forward time per step, T={T}, d=2, float32, median of {repeats} (goal: ratio <= 1, aim 0.5)",
    )
    print(
        "Notes: SMCFilter computes weights under no_grad; ours keeps the autograd graph of the log-weights "
        "when parameters require grad (none do here, log_evidence.requires_grad = "
        f"{records[0]['ours_log_evidence_requires_grad']})."
    )
    write_results(
        "bench_smcfilter",
        {
            "settings": {"T": T, "theta": 0.5, "resampler": "systematic", "ess_threshold": 0.5, "repeats": repeats, "warmup": 1},
            "goal": "ratio ours/SMCFilter <= 1 (aim 0.5)",
            "results": records,
        },
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
