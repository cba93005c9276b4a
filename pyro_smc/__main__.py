"""Quick-start demo: ``python -m pyro_smc``.

Runs the differentiable particle filter with optimal-transport resampling on the built-in 2-d
linear-Gaussian model of Corenflos et al. (2021) and prints the log-evidence estimate beside the
exact Kalman value, the gradient beside the exact score, and the time taken.

It runs on one torch thread unless told otherwise (``--threads``, or ``OMP_NUM_THREADS`` set):
its operations are small batched ones, for which torch's default of one intra-op thread per core
costs several times the work in synchronisation, and more on a loaded machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pyro_smc import SMC
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.ops.kalman import kalman_filter
from pyro_smc.resamplers import OTResampler, SystematicResampler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pyro_smc", description=__doc__.splitlines()[0])
    parser.add_argument("--num-particles", type=int, default=100)
    parser.add_argument("--num-filters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--epsilon", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1, or OMP_NUM_THREADS when set)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    torch.manual_seed(args.seed)
    eye = torch.eye(2)
    theta = torch.tensor([0.5, 0.5])
    ssm = LinearGaussianSSM(torch.diag(theta), eye, eye, 0.1 * eye, torch.zeros(2), eye)
    _, ys = ssm.simulate(args.steps)

    exact_theta = theta.clone().requires_grad_()
    exact = kalman_filter(ys, torch.diag(exact_theta), eye, eye, 0.1 * eye, torch.zeros(2), eye).log_evidence
    (score,) = torch.autograd.grad(exact, exact_theta)

    # Every run first (their progress bars go to stderr), then the table: the bars never land
    # between its rows.
    rows = []
    for name, resampler in [("OT (eps=%g)" % args.epsilon, OTResampler(epsilon=args.epsilon)), ("systematic", SystematicResampler())]:
        ssm_theta = theta.clone().requires_grad_()
        ssm.A = torch.diag(ssm_theta)
        start = time.perf_counter()
        smc = SMC(ssm, num_particles=args.num_particles, num_filters=args.num_filters, resampler=resampler, progress_bar=True).run(ys)
        (grad,) = torch.autograd.grad(smc.log_evidence.mean(), ssm_theta)
        elapsed = time.perf_counter() - start
        lz = smc.log_evidence.detach()
        rows.append(
            f"{name:<22}{lz.mean():>16.2f} +- {lz.std():<8.2f}{exact.item():>12.2f}"
            f"{'(%.1f, %.1f)' % tuple(grad.tolist()):>22}{elapsed:>8.2f}s"
        )
    print(f"2-d linear Gaussian model, T = {args.steps}, theta = (0.5, 0.5)")
    print(f"{'resampler':<22}{'log Z_hat (mean +- sd)':>28}{'exact':>12}{'d/dtheta (mean)':>22}{'time':>9}")
    print("\n".join(rows))
    print(f"{'exact Kalman score':<62}{'(%.1f, %.1f)' % tuple(score.tolist()):>22}")
    print(f"{args.num_filters} filters x {args.num_particles} particles, forward + backward, {torch.get_num_threads()} torch thread(s)")


if __name__ == "__main__":
    main()
