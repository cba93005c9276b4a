"""Sinkhorn forward, adjoint and transport against a plain batched mat-vec of the same shapes.

The bound: every stage of OT resampling is a handful of passes over ``(B, N, N)`` matrices, and
the cheapest such pass that does arithmetic is a batched mat-vec ``torch.bmm(v, K)`` with ``v``
of shape ``(B, 1, N)`` (memory-bound: each entry of ``K`` read once). Each stage is timed in the
same process as that mat-vec, interleaved, medians, and its throughput is compared with it:

* ``passes``: the stage's passes over ``(B, N, N)`` tensors, counted in an untimed run (every
  ATen op that reads or writes a tensor of ``B N N`` entries, views excluded: products, exps,
  in-place updates, copies, reductions);
* ``time / mat-vec``: the stage's time in units of one mat-vec;
* ``ratio = passes * t(mat-vec) / time``: the stage's throughput per pass over the matrix
  against the mat-vec's. 1 means the stage runs each of its passes as fast as a mat-vec; the
  rest is overhead (Python, small ops, allocations). Goal (issue 28): ``>= 0.5``.

Stages, on the resampling problem (a 2-d cloud of ``N`` standard normal points, ``a`` uniform,
``b = softmax(2 randn)``, the ensemble transform's scale-normalised cost, epsilon 0.5, threshold
1e-3, annealing 0.75):

* ``solve``: ``sinkhorn_solve(cost, log_a, log_b, ...)`` under ``no_grad`` (the forward solve);
* ``adjoint``: ``implicit_adjoint`` on the converged plan with a random incoming gradient (the
  implicit backward's linear solve);
* ``transport``: ``ensemble_solve(x, log_b, settings, plan=False)`` forward (cost, solve and the
  barycentric projection), and its backward (``x_new.backward``: adjoint and the gradients in
  ``x`` and ``log_b``).

Also timed, as a second yardstick: ``floor``, the least an eager PyTorch transport forward can do
on the same problem. It is written here, not in the package: the standardised cost as one thin
product, the kernel as one ``exp2``, as many plain Sinkhorn iterations as the package's transport
took (two mat-vecs, two divisions, the L1 row error and one host read each), and the barycentric
projection; no zero-mass handling, overflow guard, over-relaxation, convergence diagnostics or
state for a backward pass. ``transport forward / floor`` is the package's forward time over it:
what the guards and diagnostics cost, as against the per-op overhead of eager PyTorch, which the
floor pays too.

Shapes: ``(B, N)`` = (32, 100), (8, 500), (4, 1000), (2, 2000), float32 and float64.

Run: ``python benchmarks/resampling/bench_sinkhorn_bound.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f2, print_table, progress, setup, timeit_interleaved, write_results, yn
from pyro_smc.ops.ensemble import ensemble_solve
from pyro_smc.ops.sinkhorn import SinkhornSettings, implicit_adjoint, sinkhorn_solve, transport_plan

EPSILON, THRESHOLD, SCALING = 0.5, 1e-3, 0.75
SHAPES = [(32, 100), (8, 500), (4, 1000), (2, 2000)]
GOAL = 0.5
MATVECS_PER_SAMPLE = 10


class PassCounter(TorchDispatchMode):
    """Counts the ATen ops that read or write a tensor of at least ``size`` entries, views (ops
    whose output shares its input's storage) excluded. A dispatch mode, so the autograd engine's
    calls into a backward pass count too."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.passes = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        view = func._schema.is_mutable is False and any(o.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for o in outs for i in ins)
        if not view and any(t.numel() >= self.size for t in ins + outs):
            self.passes += 1
        return out


def make_problem(b: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, 2, generator=g, dtype=dtype)
    scale2 = 2 * x.var(dim=-2, unbiased=False).amax(-1)
    cost = torch.cdist(x, x).square() / scale2[:, None, None]
    log_a = torch.full((b, n), -math.log(n), dtype=dtype)
    log_b = (2 * torch.randn(b, n, generator=g, dtype=dtype)).log_softmax(-1)
    return x, cost, log_a, log_b


def floor_transport(x: torch.Tensor, log_b: torch.Tensor, iterations: int) -> torch.Tensor:
    """The minimal eager transport forward of the module docstring (``floor``): ``x_new`` ``(B, N, D)``."""
    n, d = x.shape[-2:]
    centre = x.mean(-2, keepdim=True)
    x_c = x - centre
    x_s = x_c / x_c.std(-2, unbiased=False, keepdim=True)
    sq = x_s.square().sum(-1, keepdim=True)
    left = torch.cat([x_s, sq, torch.ones_like(sq)], -1)
    right = torch.cat([-2 * x_s, torch.ones_like(sq), sq], -1) * (-1 / (math.log(2) * EPSILON * d))
    kernel = torch.bmm(left, right.transpose(1, 2)).exp2_()  # exp(-C / eps)
    a, b = torch.full_like(log_b, 1 / n).unsqueeze(1), log_b.exp().unsqueeze(1)
    au = a
    for _ in range(iterations):
        bv = b / torch.bmm(au, kernel)
        kv = torch.bmm(bv, kernel.transpose(1, 2))
        torch.linalg.vector_norm(torch.addcmul(a, au, kv, value=-1), 1, -1).tolist()
        au = a / kv
    moved = torch.bmm(torch.cat([bv * x_c.transpose(1, 2), bv], 1), kernel.transpose(1, 2))
    return (moved[:, :-1] / moved[:, -1:]).transpose(1, 2) + centre


def floor_check() -> float:
    """Largest difference of ``x_new`` between the floor iterated to convergence and the
    package's transform solved to 1e-10 (float64, 4 x 50): the floor computes the same transform.
    At the benchmark's threshold the two differ by more, since the floor's plain iterations
    converge more slowly than the package's over-relaxed ones."""
    x, _, _, log_b = make_problem(4, 50, torch.float64)
    ours = ensemble_solve(x, log_b, SinkhornSettings(EPSILON, SCALING, 1e-10, 10000), plan=False).x_new
    return float((floor_transport(x, log_b, 5000) - ours).abs().max())


def stages(b: int, n: int, dtype: torch.dtype) -> dict:
    """The timed callables of one shape, each returning nothing."""
    x, cost, log_a, log_b = make_problem(b, n, dtype)
    settings = SinkhornSettings(EPSILON, SCALING, THRESHOLD, 1000)
    with torch.no_grad():
        result = sinkhorn_solve(cost, log_a, log_b, EPSILON, SCALING, THRESHOLD, 1000)
        plan = transport_plan(cost, log_a, log_b, result.f, result.g, EPSILON)
        sqrt_a, sqrt_b = (log_a / 2).exp(), (log_b / 2).exp()
        kernel = plan / (sqrt_a.unsqueeze(-1) * sqrt_b.unsqueeze(-2))
        grad_g = torch.randn(b, n, generator=torch.Generator().manual_seed(1), dtype=dtype)
        grad_g = grad_g - grad_g.mean(-1, keepdim=True)
    v = torch.rand(b, 1, n, dtype=dtype)
    kernel_t = kernel.transpose(1, 2)
    probe = torch.randn(b, n, 2, generator=torch.Generator().manual_seed(2), dtype=dtype)

    # Ten back to back per sample (the time of one is taken as a tenth): a single mat-vec of
    # 40 us is at the mercy of the timer and of the scheduler on a shared machine.
    def matvec():  # the faster orientation of the two is the bound
        for _ in range(MATVECS_PER_SAMPLE):
            torch.bmm(v, kernel)

    def matvec_t():
        for _ in range(MATVECS_PER_SAMPLE):
            torch.bmm(v, kernel_t)

    def solve():
        with torch.no_grad():
            sinkhorn_solve(cost, log_a, log_b, EPSILON, SCALING, THRESHOLD, 1000)

    def adjoint():
        with torch.no_grad():
            implicit_adjoint(kernel, sqrt_a, sqrt_b, torch.zeros_like(grad_g), grad_g, THRESHOLD * 1e-2)

    with torch.no_grad():
        transport_iterations = int(ensemble_solve(x, log_b, settings, plan=False).solve.num_iterations.max())

    def floor():
        with torch.no_grad():
            floor_transport(x, log_b, transport_iterations)

    state = {}

    def transport_forward():
        xr, lb = x.clone().requires_grad_(), log_b.clone().requires_grad_()
        state["out"] = ensemble_solve(xr, lb, settings, plan=False).x_new

    def transport_backward():
        state["out"].backward(probe)

    return {
        "matvec": matvec,
        "matvec_t": matvec_t,
        "solve": solve,
        "adjoint": adjoint,
        "transport_forward": transport_forward,
        "transport_backward": transport_backward,
        "floor": floor,
    }, int(result.num_iterations.max())


def measure(b: int, n: int, dtype: torch.dtype, repeats: int) -> dict:
    fns, iterations = stages(b, n, dtype)
    passes = {}
    for name, fn in fns.items():
        if name == "transport_backward":
            fns["transport_forward"]()
        with PassCounter(b * n * n) as counter:
            fn()
        passes[name] = counter.passes // (MATVECS_PER_SAMPLE if name.startswith("matvec") else 1)
    # Interleaved rounds in the order of ``fns``: each transport backward follows its forward.
    t = {name: r["median_s"] for name, r in timeit_interleaved(fns, repeats).items()}
    t["matvec"] = min(t["matvec"], t.pop("matvec_t")) / MATVECS_PER_SAMPLE
    rec = {"B": b, "N": n, "iterations": iterations, "matvec_us": 1e6 * t["matvec"], "stages": {}}
    for name in ("solve", "adjoint", "transport_forward", "transport_backward", "floor"):
        rec["stages"][name] = {
            "ms": 1e3 * t[name],
            "passes": passes[name],
            "time_over_matvec": t[name] / t["matvec"],
            "ratio": passes[name] * t["matvec"] / t[name],
        }
    rec["transport_forward_over_floor"] = t["transport_forward"] / t["floor"]
    return rec


def summary_cells(d: dict) -> dict:
    """The cells of this benchmark's row in the summary table of ``benchmarks/README.md``, from a result file's content ``d``.

    The row shows each stage's throughput per pass over the ``(B, N, N)`` matrix against a plain
    batched mat-vec of the same shape. :func:`_common.write_results` stores them in the file.
    """
    recs = d["results"]
    worst = {s: min(r["stages"][s]["ratio"] for r in recs) for s in ("solve", "adjoint", "transport_forward", "transport_backward")}
    n_list = ", ".join(str(r["N"]) for r in recs)
    return {
        "ours": f"N = {n_list}: throughput / mat-vec throughput, worst over N: " + "; ".join(f"{k.replace('_', ' ')} {f2(v)}" for k, v in worst.items()),
        "anchor": "`torch.bmm(v, K)`, a batched mat-vec of the same (B, N, N), same process, interleaved",
        "comparison": "; ".join(
            f"N = {r['N']}: solve {f2(r['stages']['solve']['ratio'])} ({r['stages']['solve']['passes']} passes, {f2(r['stages']['solve']['time_over_matvec'])} mat-vecs)"
            for r in recs
        ),
        "goal": f"solve, adjoint and transport each >= {GOAL} (issue 28)",
        "met": f"{yn(min(worst.values()) >= GOAL)} (worst {f2(min(worst.values()))})",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()
    setup(args)
    dtype = getattr(torch, args.dtype)
    shapes = [(4, 50), (2, 200)] if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    records = [measure(b, n, dtype, repeats) for b, n in progress(shapes, "shapes", args)]
    rows = []
    for r in records:
        for name, s in r["stages"].items():
            rows.append([r["B"], r["N"], name, r["matvec_us"], s["ms"], s["passes"], s["time_over_matvec"], s["ratio"], r["iterations"]])
    print_table(
        ["B", "N", "stage", "mat-vec us", "ms", "passes", "time / mat-vec", "ratio", "iterations"],
        rows,
        title=f"Sinkhorn stages against a batched mat-vec, {args.dtype}, median of {repeats}; ratio = passes * t(mat-vec) / t (goal >= {GOAL})",
    )
    check = floor_check()
    print(f"floor iterated to convergence against the package's transform: max |x_new difference| {check:.1e}")
    print("transport forward / floor (a minimal eager forward, see the docstring): " + ", ".join(f"N = {r['N']}: {f2(r['transport_forward_over_floor'])}" for r in records))
    write_results(
        "bench_sinkhorn_bound",
        {
            "settings": {"epsilon": EPSILON, "threshold": THRESHOLD, "scaling": SCALING, "dtype": args.dtype, "repeats": repeats},
            "goal": f"ratio >= {GOAL} for solve, adjoint and transport",
            "results": records,
            "floor_check_max_abs_difference": check,
        },
        dtype=dtype,
        summary=summary_cells,
        label=args.dtype,
        run=args.dtype,
    )


if __name__ == "__main__":
    main()
