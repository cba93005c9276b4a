"""Cost of differentiable OT resampling against systematic resampling (forward + backward).

Model: the paper's 2-d linear-Gaussian SSM with ``A = diag(theta)``, ``theta`` a leaf tensor
requiring grad (start value (0.5, 0.5)), Q = I, C = I, R = 0.1 I, x_1 ~ N(0, I), T = 150 steps
of data simulated at theta = (0.5, 0.5). ``SMC(num_filters=32, num_particles=100)``, resampling at
ESS < N / 2. One timed call is the forward pass ``smc.run(ys)`` plus
``(-smc.log_evidence.mean()).backward()``.

Contenders: ``SystematicResampler`` (gradients drop the resampling terms) and
``OTResampler(epsilon=0.5)`` with ``gradient="implicit"`` (annealing ``scaling=0.75``, the
default, and ``scaling=0``), ``"last_step"`` and ``"unroll"``. Goal: OT implicit <= 3x systematic.

Run: ``python benchmarks/bench_ot_cost.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import pyro.distributions as dist
import torch

from _common import add_common_args, f3, print_table, progress, ratio, setup, write_results, yn
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import OTResampler, SystematicResampler


class DiagSSM:
    """The linear-Gaussian SSM with ``A = diag(theta)``; same init/step protocol as LinearGaussianSSM."""

    def __init__(self, theta: torch.Tensor, q: float = 1.0, r: float = 0.1):
        self.theta = theta
        d = theta.shape[0]
        self.scale_q = (q**0.5) * torch.eye(d)
        self.scale_r = (r**0.5) * torch.eye(d)
        self.scale_0 = torch.eye(d)
        self.init_mean = torch.zeros(d)
        self._t = 0

    def init(self, state):
        self._t = 0

    def step(self, state, y=None):
        t = self._t
        if "x" in state:
            prior = dist.MultivariateNormal(state["x"] * self.theta, scale_tril=self.scale_q)
        else:
            prior = dist.MultivariateNormal(self.init_mean, scale_tril=self.scale_0)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        return pyro.sample(f"y_{t}", dist.MultivariateNormal(x, scale_tril=self.scale_r), obs=y)


def simulate(T: int, seed: int = 0) -> torch.Tensor:
    eye = torch.eye(2)
    ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    return ssm.simulate(T, generator=torch.Generator().manual_seed(seed))[1]


def one_call(resampler, ys, num_filters, num_particles):
    theta = torch.tensor([0.5, 0.5], requires_grad=True)
    model = DiagSSM(theta)
    start = time.perf_counter()
    smc = SMC(model, num_particles=num_particles, num_filters=num_filters, resampler=resampler).run(ys)
    loss = -smc.log_evidence.mean()
    mid = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    return mid - start, end - mid, float(loss.detach()), theta.grad.clone(), float(smc.resampled.float().mean())


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows OT resampling's forward + backward cost against systematic resampling.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    res, s = d["results"], d.get("settings", {})
    default, base = res["ot_implicit_scaling0.75"], res["systematic"]
    others = {"scaling 0": "ot_implicit_scaling0", "last_step": "ot_last_step_scaling0.75", "unroll": "ot_unroll_scaling0.75"}
    others = {label: res[key] for label, key in others.items() if key in res}
    size = f"{s['num_filters']} filters x {s['num_particles']} particles, T = {s['T']}: " if {"num_filters", "num_particles", "T"} <= s.keys() else ""
    return {
        "ours": f"{size}OT implicit (default) {f3(default['total_s'])} s forward + backward "
        f"({f3(default['forward_s'])} + {f3(default['backward_s'])})",
        "anchor": f"`SystematicResampler` {f3(base['total_s'])} s ({f3(base['forward_s'])} + {f3(base['backward_s'])})",
        "comparison": f"OT / systematic {ratio(default['ratio_over_systematic'])}"
        + (" (" + ", ".join(f"{k} {ratio(v['ratio_over_systematic'])}" for k, v in others.items()) + ")" if others else ""),
        "goal": d.get("goal", "ratio OT implicit / systematic <= 3"),
        "met": f"{yn(default['ratio_over_systematic'] <= 3)} ({ratio(default['ratio_over_systematic'])})",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup(args)
    T = 15 if args.quick else 150
    B, N = (4, 20) if args.quick else (32, 100)
    repeats = 1 if args.quick else args.repeats
    eps = 0.5

    contenders = {
        "systematic": SystematicResampler(),
        "ot_implicit_scaling0.75": OTResampler(epsilon=eps, scaling=0.75, gradient="implicit"),
        "ot_implicit_scaling0": OTResampler(epsilon=eps, scaling=0.0, gradient="implicit"),
        "ot_last_step_scaling0.75": OTResampler(epsilon=eps, scaling=0.75, gradient="last_step"),
        "ot_unroll_scaling0.75": OTResampler(epsilon=eps, scaling=0.75, gradient="unroll"),
    }
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    ys = simulate(T)

    # Warm-up, then interleaved repeats (robust to drifting load on a shared machine).
    for r in progress(contenders.values(), "warm-up", args):
        one_call(r, ys, B, N)
    samples = {k: {"fwd": [], "bwd": [], "loss": [], "grad": [], "resampled": []} for k in contenders}
    for _ in progress(range(repeats), "repeats", args):
        for name, r in contenders.items():
            fwd, bwd, loss, grad, resampled = one_call(r, ys, B, N)
            s = samples[name]
            s["fwd"].append(fwd)
            s["bwd"].append(bwd)
            s["loss"].append(loss)
            s["grad"].append(grad.tolist())
            s["resampled"].append(resampled)

    base = statistics.median(a + b for a, b in zip(samples["systematic"]["fwd"], samples["systematic"]["bwd"]))
    rows, records = [], {}
    for name, s in samples.items():
        total = statistics.median(a + b for a, b in zip(s["fwd"], s["bwd"]))
        rec = {
            "forward_s": statistics.median(s["fwd"]),
            "backward_s": statistics.median(s["bwd"]),
            "total_s": total,
            "total_min_s": min(a + b for a, b in zip(s["fwd"], s["bwd"])),
            "ratio_over_systematic": total / base,
            "ms_per_step": 1e3 * total / T,
            "neg_mean_log_evidence": statistics.median(s["loss"]),
            "grad_theta_last_repeat": s["grad"][-1],
            "fraction_of_steps_resampled": statistics.median(s["resampled"]),
        }
        records[name] = rec
        rows.append([name, rec["forward_s"], rec["backward_s"], total, rec["ratio_over_systematic"], rec["fraction_of_steps_resampled"], rec["neg_mean_log_evidence"]])
    print_table(
        ["resampler", "fwd s", "bwd s", "fwd+bwd s", "ratio", "resampled", "-mean logZ"],
        rows,
        title=f"Forward+backward of -log_evidence.mean(), B={B} filters, N={N}, T={T}, eps={eps}, float32, median of {repeats}",
    )
    print("goal: OT implicit / systematic <= 3")
    write_results(
        "bench_ot_cost",
        {
            "settings": {"num_filters": B, "num_particles": N, "T": T, "epsilon": eps, "threshold": 1e-3, "max_iter": 100, "ess_threshold": 0.5, "repeats": repeats, "warmup": 1},
            "goal": "ratio OT implicit / systematic <= 3",
            "results": records,
        },
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
