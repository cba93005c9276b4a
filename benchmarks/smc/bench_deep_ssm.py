"""A deep state-space model learned from a data set of sequences with ``SMCELBO`` minibatches (issue 15).

**Task.** A data set of ``D = 200`` training and ``H = 50`` held-out sequences is simulated from a
stochastic Van der Pol oscillator (``mu = 1``, time step ``dt = 0.1`` made of four Euler steps)::

    x_0 ~ N(0, 1.5^2 I_2)
    x_t = F(x_{t-1}) + N(0, 0.1^2 I_2),    F: dx1/ds = x2, dx2/ds = mu (1 - x1^2) x2 - x1 over ds = dt
    y_t = x_t + N(0, 0.1^2 I_2)

with lengths drawn uniformly in ``[T/2, T]``, ``T = 50`` (a padded batch with ``lengths``). The
learned model is :class:`~pyro_smc.models.NeuralSSM` with the identity emission (``x_t = x_{t-1} +
MLP(x_{t-1}) + N(0, diag q^2)``, ``y_t = x_t + N(0, diag r^2)``, two hidden layers of 32, ``q`` and
``r`` learned from 0.5) and the proposal :class:`~pyro_smc.models.NeuralProposal`
(``q_phi(x_t | x_{t-1}, y_t)``, a diagonal Gaussian from a network of the same size, starting as a
random walk of scale 0.5).

**Training**, the same for every estimator and seed: ``SVI(model, proposal, ClippedAdam(lr = 0.01,
decaying to 0.001, clip_norm = 10), SMCELBO(num_particles = 32, num_sequences = D, resampler))``,
minibatches of ``B = 16`` sequences drawn without replacement (``svi.step(batch, lengths=...,
batched=True)``), ``steps`` steps (default 500). Estimators (the ``resampler`` argument):

* ``ot``: ``OTResampler(epsilon=0.5)``, implicit gradients through the transport;
* ``systematic``: ``SystematicResampler()``, resampling detached (the classic biased gradient);
* ``soft``: ``SoftResampler(0.5)``;
* ``stop_gradient``: ``SystematicResampler(gradient="stop_gradient")``, the Fisher-identity score of
  the evidence. It gives the model's parameters an (asymptotically) unbiased gradient and the
  proposal none at all (the evidence does not depend on the proposal), so its proposal stays the
  initial random walk.

**Evaluation**, no gradient, systematic resampling. The *model* is judged by its held-out
log-evidence, estimated with its locally optimal proposal
(:class:`~pyro_smc.models.LocallyOptimalProposal`, exact for a Gaussian transition and a linear
emission; a bootstrap filter's estimate of a learned model's evidence has a heavy lower tail at
these noise levels), so the learned proposal does not enter. The *proposal* is judged by the
held-out ELBO ``E[log Z_hat]`` of a filter with the learned proposal at the training size
``N = 32`` (a better proposal gives a tighter bound), beside the same ELBO with the locally optimal
proposal (the best a proposal can do). Every ``eval_every`` steps: the model's evidence with
``N = 256`` and the learned proposal's ELBO, one filter per held-out sequence. At the end:
``log (1/K sum_k Z_hat_k)`` per held-out sequence, ``K = 4`` filters of ``N = 1000`` each (locally
optimal, and learned, proposal), averaged over sequences (and divided by the number of observed
steps, per step); and the ELBOs at ``N = 32`` with ``K = 4``. The true model (a ``NeuralSSM`` whose
network is the Van der Pol step, evaluated the same way) is the ceiling; the untrained model is
the floor. ``seeds`` training runs per estimator (default 3) differ in their
initial weights, minibatches and filters; the data set is fixed.

Run: ``python benchmarks/smc/bench_deep_ssm.py`` (about 25 minutes on one core; ``--quick``: a smoke
run of a minute). Results: ``results/deep_ssm.json`` (``deep_ssm.quick.json`` under ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI
from pyro.optim import ClippedAdam

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` imports as a package
from benchmarks._common import add_common_args, f3, print_table, progress, setup, slash, write_results, yn
from pyro_smc import SMC, SMCELBO
from pyro_smc.models import LocallyOptimalProposal, NeuralProposal, NeuralSSM, NonlinearGaussianSSM
from pyro_smc.resamplers import OTResampler, SoftResampler, SystematicResampler

DT, MU, NOISE, INIT = 0.1, 1.0, 0.1, 1.5
ESTIMATORS = {
    "ot": lambda: OTResampler(epsilon=0.5),
    "systematic": lambda: SystematicResampler(),
    "soft": lambda: SoftResampler(0.5),
    "stop_gradient": lambda: SystematicResampler(gradient="stop_gradient"),
}


def van_der_pol(x: torch.Tensor) -> torch.Tensor:
    """The Van der Pol oscillator moved by ``dt = 0.1``: four Euler steps of ``dt / 4``, ``(..., 2) -> (..., 2)``.

    One Euler step of 0.1 is unstable for ``|x1| > 4.5`` (a 3-sigma start), four are stable to ``|x1| ~ 9``.
    """
    h = DT / 4
    for _ in range(4):
        x1, x2 = x[..., 0], x[..., 1]
        x = torch.stack([x1 + h * x2, x2 + h * (MU * (1 - x1**2) * x2 - x1)], dim=-1)
    return x


def true_model() -> NonlinearGaussianSSM:
    eye = torch.eye(2)
    return NonlinearGaussianSSM(van_der_pol, NOISE**2 * eye, lambda x: x, NOISE**2 * eye, torch.zeros(2), INIT**2 * eye)


class _VanDerPolResidual(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return van_der_pol(x) - x


def true_model_as_neural_ssm() -> NeuralSSM:
    """The data's model in the learned model's family (its network is the Van der Pol step), so it
    is evaluated by the same locally optimal proposal."""
    model = NeuralSSM(2, emission="identity", init_scale=INIT, transition_scale=NOISE, observation_scale=NOISE)
    model.transition_net = _VanDerPolResidual()
    return model


def make_data(num_train: int, num_test: int, T: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    truth = true_model()
    ys = torch.stack([truth.simulate(T, generator=generator)[1] for _ in range(num_train + num_test)])
    lengths = torch.randint(T // 2, T + 1, (num_train + num_test,), generator=generator)
    return {"train": ys[:num_train], "train_lengths": lengths[:num_train], "test": ys[num_train:], "test_lengths": lengths[num_train:]}


def _log_evidences(model, guide, ys, lengths, num_particles: int, num_filters: int) -> torch.Tensor:
    """``log Z_hat`` of ``K`` filters per held-out sequence, no gradient, ``(H, K)``."""
    K = num_filters
    with torch.no_grad():
        smc = SMC(model, guide, num_particles=num_particles, num_filters=ys.shape[0] * K)
        smc.run(ys.repeat_interleave(K, 0), lengths=lengths.repeat_interleave(K), batched=True)
    return smc.log_evidence.reshape(-1, K)


def held_out(model, guide, ys, lengths, num_particles: int, num_filters: int = 1) -> torch.Tensor:
    """Per sequence ``log (1/K sum_k Z_hat_k)``, ``(H,)``."""
    return torch.logsumexp(_log_evidences(model, guide, ys, lengths, num_particles, num_filters), -1) - math.log(num_filters)


def held_out_elbo(model, guide, ys, lengths, num_particles: int, num_filters: int) -> torch.Tensor:
    """Per sequence ``mean_k log Z_hat_k`` (the ELBO of the filter), ``(H,)``."""
    return _log_evidences(model, guide, ys, lengths, num_particles, num_filters).mean(-1)


def train(name: str, seed: int, data: dict, args) -> dict:
    pyro.clear_param_store()
    pyro.set_rng_seed(1000 + seed)
    model = NeuralSSM(2, emission="identity")
    guide = NeuralProposal(model)
    D = data["train"].shape[0]
    optim = ClippedAdam({"lr": 0.01, "lrd": 0.1 ** (1 / args.steps), "clip_norm": 10.0})
    svi = SVI(model, guide, optim, SMCELBO(num_particles=args.particles, resampler=ESTIMATORS[name](), num_sequences=D))
    losses, curve, step_times = [], [], []
    finite = True
    order = torch.randperm(D)
    for step in progress(range(args.steps + 1), f"{name} seed {seed}", args):
        if step % args.eval_every == 0:
            model_value = held_out(model, LocallyOptimalProposal(model), data["test"], data["test_lengths"], 256)
            elbo = held_out(model, guide, data["test"], data["test_lengths"], args.particles)
            curve.append({"step": step, "held_out": float(model_value.mean()), "held_out_elbo": float(elbo.mean())})
        if step == args.steps:
            break
        start = (step * args.batch) % D
        if start + args.batch > D:
            order = torch.randperm(D)
            start = 0
        idx = order[start : start + args.batch]
        t0 = time.perf_counter()
        loss = svi.step(data["train"][idx], lengths=data["train_lengths"][idx], batched=True)
        step_times.append(time.perf_counter() - t0)
        finite = finite and math.isfinite(loss)
        losses.append(loss / D)
    final = held_out(model, LocallyOptimalProposal(model), data["test"], data["test_lengths"], args.eval_particles, args.eval_filters)
    with_proposal = held_out(model, guide, data["test"], data["test_lengths"], args.eval_particles, args.eval_filters)
    elbo = held_out_elbo(model, guide, data["test"], data["test_lengths"], args.particles, args.eval_filters)
    elbo_optimal = held_out_elbo(model, LocallyOptimalProposal(model), data["test"], data["test_lengths"], args.particles, args.eval_filters)
    return {
        "estimator": name, "seed": seed, "train_loss_per_sequence": losses, "curve": curve,
        "final_held_out": float(final.mean()), "final_held_out_per_step": float(final.sum() / data["test_lengths"].sum()),
        "final_held_out_with_proposal": float(with_proposal.mean()), "final_held_out_elbo": float(elbo.mean()),
        "final_held_out_elbo_optimal_proposal": float(elbo_optimal.mean()),
        "step_s_median": statistics.median(step_times), "finite": finite,
        "transition_scale": model.transition_scale.detach().tolist(), "observation_scale": model.observation_scale.detach().tolist(),
    }


def summary_cells(d: dict) -> dict:
    """This benchmark's row in the summary table of ``benchmarks/README.md`` (see ``_common.summary_record``)."""
    rows = d["estimators"]
    names = list(rows)
    truth, floor = d["truth_held_out"], d["untrained_held_out"]
    return {
        "ours": f"Van der Pol data set (D = {d['settings']['train']}), NeuralSSM + NeuralProposal, {d['settings']['steps']} SVI steps: "
        f"held-out model log Z per sequence {'/'.join(names)} {slash([rows[n]['final_mean'] for n in names], f3)}, "
        f"ELBO with the learned proposal (N = {d['settings']['particles']}) {slash([rows[n]['final_elbo_mean'] for n in names], f3)} "
        f"(mean of {d['settings']['seeds']} seeds)",
        "anchor": f"true model {f3(truth)} (ELBO with its locally optimal proposal at the same N "
        f"{f3(d['truth_held_out_elbo_optimal_proposal'])}); untrained {f3(floor)}",
        "comparison": f"gap to the true model {slash([truth - rows[n]['final_mean'] for n in names], f3)} nats per sequence",
        "goal": "every estimator learns (held-out log Z above the untrained model's); curves reported",
        "met": yn(all(rows[n]["final_mean"] > floor for n in names)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=500, help="SVI steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="training runs per estimator")
    parser.add_argument("--batch", type=int, default=16, help="sequences per minibatch")
    parser.add_argument("--particles", type=int, default=32, help="particles per filter in training")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-particles", type=int, default=1000)
    parser.add_argument("--eval-filters", type=int, default=4)
    args = parser.parse_args()
    setup(args)
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.eval_particles, args.eval_filters = 20, 1, 10, 200, 1
    num_train, num_test, T = (40, 10, 20) if args.quick else (200, 50, 50)
    data = make_data(num_train, num_test, T)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    truth_model = true_model_as_neural_ssm()
    truth = held_out(truth_model, LocallyOptimalProposal(truth_model), data["test"], data["test_lengths"], args.eval_particles, args.eval_filters)
    truth_elbo = held_out_elbo(truth_model, LocallyOptimalProposal(truth_model), data["test"], data["test_lengths"], args.particles, args.eval_filters)
    pyro.clear_param_store()
    untrained_model = NeuralSSM(2, emission="identity")
    untrained = held_out(untrained_model, LocallyOptimalProposal(untrained_model), data["test"], data["test_lengths"], args.eval_particles, args.eval_filters)
    untrained_elbo = held_out_elbo(untrained_model, NeuralProposal(untrained_model), data["test"], data["test_lengths"], args.particles, args.eval_filters)
    started = time.perf_counter()
    runs = [train(name, seed, data, args) for seed in range(args.seeds) for name in ESTIMATORS]
    estimators = {}
    for name in ESTIMATORS:
        mine = [r for r in runs if r["estimator"] == name]
        finals = [r["final_held_out"] for r in mine]
        estimators[name] = {
            "final_mean": statistics.fmean(finals), "final_sd": statistics.stdev(finals) if len(finals) > 1 else math.nan,
            "final_per_step_mean": statistics.fmean(r["final_held_out_per_step"] for r in mine),
            "final_with_proposal_mean": statistics.fmean(r["final_held_out_with_proposal"] for r in mine),
            "final_elbo_mean": statistics.fmean(r["final_held_out_elbo"] for r in mine),
            "final_elbo_sd": statistics.stdev([r["final_held_out_elbo"] for r in mine]) if len(mine) > 1 else math.nan,
            "final_elbo_optimal_mean": statistics.fmean(r["final_held_out_elbo_optimal_proposal"] for r in mine),
            "step_ms": 1e3 * statistics.median(r["step_s_median"] for r in mine), "all_finite": all(r["finite"] for r in mine),
        }
    observed = float(data["test_lengths"].sum())
    rows = [[name, e["final_mean"], e["final_sd"], e["final_per_step_mean"], float(truth.mean()) - e["final_mean"], e["final_with_proposal_mean"],
             e["final_elbo_mean"], e["final_elbo_sd"], e["final_elbo_optimal_mean"], e["step_ms"], yn(e["all_finite"])]
            for name, e in estimators.items()]
    rows.append(["true model", float(truth.mean()), "", float(truth.sum()) / observed, 0.0, "", "", "", float(truth_elbo.mean()), "", ""])
    rows.append(["untrained", float(untrained.mean()), "", float(untrained.sum()) / observed, float(truth.mean() - untrained.mean()), "",
                 float(untrained_elbo.mean()), "", "", "", ""])
    print_table(["estimator", "model log Z / seq", "sd over seeds", "per step", "gap to truth", "with its proposal", f"ELBO N = {args.particles}",
                 "sd", "ELBO, optimal q", "ms / SVI step", "finite"], rows,
                title=f"Deep SSM on Van der Pol data, held-out sequences after {args.steps} steps ({args.seeds} seeds): model log Z "
                      f"(locally optimal proposal, K = {args.eval_filters} x N = {args.eval_particles}), with the learned proposal, and the ELBO at the training N")
    curve_steps = [c["step"] for c in runs[0]["curve"]]
    for key, what in (("held_out", "model log Z (locally optimal proposal, N = 256)"), ("held_out_elbo", f"ELBO with the learned proposal (N = {args.particles})")):
        print_table(["step"] + list(ESTIMATORS),
                    [[s] + [statistics.fmean(r["curve"][i][key] for r in runs if r["estimator"] == n) for n in ESTIMATORS]
                     for i, s in enumerate(curve_steps)],
                    title=f"Learning curves, held-out {what} per sequence, mean over seeds")
    write_results(
        "deep_ssm",
        {
            "settings": {"train": num_train, "test": num_test, "T": T, "steps": args.steps, "seeds": args.seeds, "batch": args.batch,
                         "particles": args.particles, "eval_every": args.eval_every, "eval_particles": args.eval_particles,
                         "eval_filters": args.eval_filters, "lr": 0.01, "lr_final": 0.001, "clip_norm": 10.0,
                         "data": {"model": "Van der Pol, Euler dt 0.1, mu 1", "noise": NOISE, "init_scale": INIT}},
            "truth_held_out": float(truth.mean()), "untrained_held_out": float(untrained.mean()),
            "truth_held_out_elbo_optimal_proposal": float(truth_elbo.mean()), "untrained_held_out_elbo": float(untrained_elbo.mean()),
            "estimators": estimators, "runs": runs, "wall_s": time.perf_counter() - started,
        },
        summary=summary_cells,
    )


if __name__ == "__main__":
    main()
