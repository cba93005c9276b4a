"""The two cliffs of the Gaussian smoothers' speed work, old against new in one process.

1. ``extended_rts_smoother`` (linearisation) when a parameter of the transition map requires
   grad: forward + backward of ``log_evidence``, time per time step at T = 250 ... 2000 (flat
   when each step's Jacobian pass walks only that step's graph). ``old`` is the previous
   ``_value_and_jacobian`` (its Jacobian taken through the attached mean, so each step's
   ``autograd.grad`` walked every earlier step's graph), patched in.
2. ``EPSmoother(schedule="parallel", max_iter=1)`` at T = 10^4 on the pendulum: the single sweep
   as one smoother pass (new) against the sweep of ``4 T`` message updates (old), and
   ``max_iter=3`` for scale.

Run: ``python benchmarks/gaussian/bench_linearisation_grad.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import add_common_args, f2, met_summary, print_table, setup, timeit_interleaved, write_results
from benchmarks.gaussian.bench_ep_pendulum import make_ssm, simulate
from pyro_smc import EPSmoother
from pyro_smc.infer import extended_rts_smoother
from pyro_smc.infer.gaussian import projections, recorded
from pyro_smc.infer.gaussian.sequential import SequentialSchedule
from pyro_smc.models import NonlinearGaussianSSM


def old_value_and_jacobian(fn, mean, t):
    """The previous implementation (before issue 28's fix), for the comparison."""
    mu = fn(mean, t)
    create_graph = torch.is_grad_enabled() and mu.requires_grad
    with torch.enable_grad():
        z = mean.new_zeros(mean.shape[:-1] + (mu.shape[-1], mean.shape[-1]), requires_grad=True)
        copies = fn((mean if create_graph else mean.detach()).unsqueeze(-2) + z, t)
        total = copies.diagonal(dim1=-2, dim2=-1).sum()
        (J,) = torch.autograd.grad(total, z, grad_outputs=torch.ones_like(total), create_graph=create_graph)
    return mu, J


@contextlib.contextmanager
def old_linearisation():
    new = projections._value_and_jacobian
    projections._value_and_jacobian = recorded._value_and_jacobian = old_value_and_jacobian
    try:
        yield
    finally:
        projections._value_and_jacobian = recorded._value_and_jacobian = new


@contextlib.contextmanager
def old_single_sweep():
    new = SequentialSchedule.smoother_sweep
    SequentialSchedule.smoother_sweep = lambda self, problem: None  # the sweep of message updates
    try:
        yield
    finally:
        SequentialSchedule.smoother_sweep = new


def drift_model():
    a = torch.tensor(0.8, requires_grad=True)
    one = torch.eye(1)
    ssm = NonlinearGaussianSSM(lambda x: a * x + torch.sin(x), 0.5 * one, lambda x: x + 0.2 * x**3 / (1 + x**2), 0.3 * one, torch.zeros(1), one)
    return ssm, a


def ertss_grad(ssm, a, ys):
    (g,) = torch.autograd.grad(extended_rts_smoother(ssm, ys).log_evidence, a)
    return g


FLAT = 1.5  # the largest T's time per step within this factor of the smallest T's


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in ``benchmarks/README.md``, from a result file's content
    ``d``: ERTSS's time per step with a parameter requiring grad across T (flat: linear in T),
    and ``EPSmoother(max_iter=1)`` against the old single sweep and ``max_iter=3``."""
    ertss = {int(T): v["us_per_step"] for T, v in d["ertss"].items()}
    lengths = sorted(ertss)
    new = [ertss[T]["new"] for T in lengths]
    old = {T: ertss[T]["old"] for T in lengths if "old" in ertss[T]}
    ep = d["ep_max_iter_1_s"]
    steps = d["settings"]["ep_steps"]
    return {
        "ours": "ERTSS fwd + bwd with a parameter requiring grad, us/step at T = "
        + " / ".join(str(T) for T in lengths) + ": " + " / ".join(f"{v:.0f}" for v in new)
        + f"; EP max_iter=1 at T = {steps}: {ep['new']:.2f} s (max_iter=3: {ep['max_iter=3']:.2f} s)",
        "anchor": "the previous implementation, same process: ERTSS "
        + " / ".join(f"{old[T]:.0f}" for T in old) + f" us/step; EP max_iter=1 {ep['old']:.2f} s",
        "comparison": f"largest / smallest T per step {f2(new[-1] / new[0])}; EP max_iter=1 old / new {f2(ep['old'] / ep['new'])}",
        "goal": f"time per step flat in T (within {FLAT}x); EP max_iter=1 no slower than max_iter=3 (issue 28)",
        "met": met_summary({"flat in T": new[-1] <= FLAT * new[0], "EP max_iter=1 <= max_iter=3": ep["new"] <= ep["max_iter=3"]}),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ep-steps", type=int, default=10_000)
    parser.add_argument("--old-max-steps", type=int, default=1000, help="the longest series the old (quadratic) ERTSS runs on")
    args = parser.parse_args()
    setup(args)
    lengths = (50, 100) if args.quick else (250, 500, 1000, 2000)
    ssm, a = drift_model()
    rows, ertss = [], {}
    for T in lengths:
        with torch.no_grad():
            _, ys = ssm.simulate(T, generator=torch.Generator().manual_seed(0))

        def old(ys=ys):
            with old_linearisation():
                return ertss_grad(ssm, a, ys)

        # The old one is quadratic in T (minutes per call at T = 2000): timed once from T = 1000
        # on, and not at all above --old-max-steps.
        new = lambda ys=ys: ertss_grad(ssm, a, ys)  # noqa: E731
        fns = {"old": old, "new": new} if T <= args.old_max_steps else {"new": new}
        timing = timeit_interleaved(fns, repeats=args.repeats if T < 1000 else 1, warmup=int(T == lengths[0]), desc=f"ERTSS T={T}", args=args)
        us = {k: v["median_s"] / T * 1e6 for k, v in timing.items()}
        diff = float((old() - new()).abs()) if "old" in us else float("nan")
        ertss[T] = {"us_per_step": us, "grad_abs_difference": diff}
        old_us = f"{us['old']:.0f}" if "old" in us else "-"
        ratio = f2(us["old"] / us["new"]) if "old" in us else "-"
        rows.append([f"ERTSS fwd+bwd, T = {T}", old_us, f"{us['new']:.0f}", ratio, f"{diff:.1e}"])
    steps = 300 if args.quick else args.ep_steps
    pend = make_ssm()
    _, ys = simulate(0, steps - 1)
    one = EPSmoother(pend, projection="unscented", schedule="parallel", max_iter=1)
    three = EPSmoother(pend, projection="unscented", schedule="parallel", max_iter=3, tol=1e-12)

    def one_old():
        with old_single_sweep():
            return one.smooth(ys)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timing = timeit_interleaved({"old": one_old, "new": lambda: one.smooth(ys), "max_iter=3": lambda: three.smooth(ys)}, repeats=args.repeats, desc="EP max_iter=1", args=args)
        diff = float((one_old().means - one.smooth(ys).means).abs().max())
    ep = {k: v["median_s"] for k, v in timing.items()}
    rows.append([f"EP parallel max_iter=1, T = {steps} (s)", f"{ep['old']:.2f}", f"{ep['new']:.2f}", f2(ep["old"] / ep["new"]), f"{diff:.1e}"])
    rows.append([f"EP parallel max_iter=3, T = {steps} (s)", "", f"{ep['max_iter=3']:.2f}", "", ""])
    print_table(["case", "old (us/step)", "new (us/step)", "old / new", "max |diff|"], rows, title=f"float64, {args.threads} thread(s)")
    payload = {"settings": {"lengths": list(lengths), "ep_steps": steps, "repeats": args.repeats}, "ertss": ertss, "ep_max_iter_1_s": ep, "ep_means_abs_difference": diff}
    write_results("bench_linearisation_grad", payload, dtype=torch.float64, summary=summary_cells)


if __name__ == "__main__":
    main()
