"""GPU scale-out: OT-SMC up to 10^4 particles and 256 filters, and AutoKroneckerFlow on a conv net.

Runs where CUDA is present (``--device cuda``, the default); elsewhere it prints why and exits, or
smoke-tests itself on the CPU with ``--device cpu --quick``. Every engine runs unchanged on the
device: the models and data are built with ``torch.set_default_device(device)``, so Pyro's prior
constants land on it too.

1. OT-SMC: the 2-d linear-Gaussian model of Corenflos et al. (2021) (A = 0.5 I, Q = I, C = I,
   R = 0.1 I), T = 20 steps, resampling at every step (``ess_threshold=1``, the worst case).
   ``OTResampler(epsilon=0.5)`` against ``SystematicResampler``: forward + backward of
   ``-log_evidence.mean()`` w.r.t. the transition matrix, ms per time step, for (N, B) in
   {(100, 256), (1000, 16), (1000, 256), (10^4, 1), (10^4, 8)} (an N = 10^4 kernel is 400 MB per
   filter in float32, which is what bounds B there). Also the peak CUDA memory of each run.
2. ``AutoKroneckerFlow`` on the conv BNN of ``bench_bnn_digits.py`` (sklearn digits, batch 128):
   time per SVI step of AutoNormal, K-Diag, K-Linear and K-Nonlinear, interleaved.

Run: ``python benchmarks/gpu/bench_gpu.py`` on a GPU machine (``--quick`` for a smoke run). Writes
``benchmarks/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, g3, print_table, progress, ratio, setup, write_results
from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.resamplers import OTResampler, SystematicResampler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def smc_case(device, N: int, B: int, T: int, resampler) -> dict:
    eye = torch.eye(2)
    A = (0.5 * eye).requires_grad_(True)
    ssm = LinearGaussianSSM(A, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    _, ys = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye).simulate(T)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    smc = SMC(ssm, num_particles=N, num_filters=B, resampler=resampler, ess_threshold=1.0).run(ys)
    (-smc.log_evidence.mean()).backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"ms_per_step": 1e3 * seconds / T, "peak_mib": peak, "finite": bool(torch.isfinite(smc.log_evidence).all())}


def bnn_timing(device, steps: int, args=None) -> dict:
    from benchmarks.kronecker.bench_bnn_digits import BATCH, ConvBNN, load_data, make_guide

    xtr, ytr, _, _ = load_data(0, "conv")
    xtr, ytr = xtr.to(device), ytr.to(device)
    names = ["AutoNormal", "K-Diag", "K-Linear", "K-Nonlinear"]
    svis = {}
    for name in names:
        pyro.set_rng_seed(0)
        model = ConvBNN()
        guide = make_guide(name, model)
        # Separate parameter names per guide (the K-guides would share them).
        guide._pyro_name = name.replace("-", "")
        svis[name] = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), pyro.infer.Trace_ELBO())
        for _ in range(5):
            svis[name].step(xtr, ytr, BATCH)
    times = {name: [] for name in names}
    for r in progress(range(steps), "conv BNN: rounds", args):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            svis[name].step(xtr, ytr, BATCH)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["AutoNormal"])
    return {name: {"ms_per_step": 1e3 * statistics.median(t), "x_autonormal": statistics.median(t) / base} for name, t in times.items()}


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows ms per step on the device, OT against systematic and the conv BNN's guides.
    :func:`_common.write_results` stores them in the file, as its summary record.
    """
    smc, bnn = d.get("smc") or [], d.get("bnn_conv") or {}
    if not smc and not bnn:
        raise ValueError("neither 'smc' nor 'bnn_conv'")
    key = lambda e: f"({e['N']}, {e['B']})"  # noqa: E731
    head, anchor, comp = [], [], []
    if smc:
        head.append("OT ms/step at (N, filters) " + ", ".join(f"{key(e)} {g3(e['ot']['ms_per_step'])}" for e in smc))
        peak = max(smc, key=lambda e: (e["N"], e["B"]))
        if peak["ot"].get("peak_mib") is not None:
            head[-1] += f" (peak {peak['ot']['peak_mib']:.0f} MiB at {key(peak)})"
        anchor.append("systematic " + ", ".join(f"{key(e)} {g3(e['systematic']['ms_per_step'])}" for e in smc))
        comp.append("OT / systematic " + ", ".join(f"{key(e)} {ratio(e['ot_over_systematic'])}" for e in smc))
    if bnn:
        ks = [k for k in bnn if k != "AutoNormal"]
        head.append("conv BNN ms/step " + ", ".join(f"{k} {g3(bnn[k]['ms_per_step'])}" for k in ks))
        if "AutoNormal" in bnn:
            anchor.append(f"AutoNormal {g3(bnn['AutoNormal']['ms_per_step'])} ms/step")
        comp.append("x AutoNormal " + ", ".join(f"{k} {f2(bnn[k]['x_autonormal'])}" for k in ks))
    return {
        "ours": "; ".join(head),
        "anchor": "; ".join(anchor),
        "comparison": "; ".join(comp),
        "goal": "none stated (scale-out run)",
        "met": "n/a",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    setup(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine (or --device cpu --quick to smoke-test)")
        return
    torch.set_default_device(device)
    cases = [(100, 4), (1000, 2)] if args.quick else [(100, 256), (1000, 16), (1000, 256), (10_000, 1), (10_000, 8)]
    T = 5 if args.quick else 20
    rows, smc_results = [], []
    for N, B in progress(cases, "OT-SMC: (N, B)", args):
        entry = {"N": N, "B": B, "T": T}
        for label, resampler in (("systematic", SystematicResampler()), ("ot", OTResampler(epsilon=0.5))):
            pyro.set_rng_seed(0)
            smc_case(device, N, B, 2, resampler)  # warm-up (kernel compilation, allocator)
            pyro.set_rng_seed(0)
            entry[label] = smc_case(device, N, B, T, resampler)
        entry["ot_over_systematic"] = entry["ot"]["ms_per_step"] / entry["systematic"]["ms_per_step"]
        smc_results.append(entry)
        rows.append([N, B, entry["systematic"]["ms_per_step"], entry["ot"]["ms_per_step"], entry["ot_over_systematic"], entry["ot"]["peak_mib"]])
    print_table(["N", "filters", "systematic ms/step", "OT ms/step", "OT / systematic", "OT peak MiB"], rows, title=f"OT-SMC on {device}")
    bnn = bnn_timing(device, 3 if args.quick else 100, args)
    print_table(["guide", "ms/step", "x AutoNormal"], [[k, v["ms_per_step"], v["x_autonormal"]] for k, v in bnn.items()], title=f"conv BNN on {device}")
    name = "gpu" if device.type == "cuda" else "gpu.cpu"
    write_results(name, {"device": str(device), "smc": smc_results, "bnn_conv": bnn}, summary=summary_cells)


if __name__ == "__main__":
    main()
