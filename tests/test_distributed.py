"""DistributedELBO with 2 CPU processes (gloo): averaged gradients equal the single-process ones."""

import subprocess
import sys
import textwrap

import pytest
import torch

WORKER = textwrap.dedent(
    """
    import os, sys
    import pyro, pyro.distributions as pdist, torch
    import torch.distributed as dist
    from pyro.infer import SVI, Trace_ELBO
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    from pyro_smc import SMCELBO
    from pyro_smc.distributed import DistributedELBO
    from pyro_smc.guides import AutoKroneckerFlow
    from pyro_smc.models import DiagonalLinearGaussianSSM

    case, rank, world, workdir, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "rendezvous"), rank=rank, world_size=world)

    def grads(module=None):
        if module is not None:  # parameters kept out of the store (module_local_params)
            return {name: p.grad.clone() for name, p in module.named_parameters()}
        store = pyro.get_param_store()
        return {name: store[name].unconstrained().grad.clone() for name in store.keys()}

    module = None
    if case in ("bnn", "bnn_local"):
        if case == "bnn_local":
            pyro.settings.set(module_local_params=True)
        g = torch.Generator().manual_seed(0)
        N = 40
        x, y = torch.randn(N, 3, generator=g), torch.randn(N, 2, generator=g)

        def model(x, y, subsample=None):
            w = pyro.sample("w", pdist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
            with pyro.plate("data", N, subsample=subsample) as idx:
                pyro.sample("y", pdist.Normal(x[idx] @ w, 0.5).to_event(1), obs=y[idx])

        batch = torch.arange(8, 32)                       # one global minibatch of 24
        shard = batch.chunk(world)[rank]                  # this rank's share
        guide = AutoKroneckerFlow(model, kind="linear")
        pyro.set_rng_seed(0)                              # same parameters and weight draws everywhere
        loss = DistributedELBO(Trace_ELBO()).loss_and_grads(model, guide, x, y, subsample=shard)
        if case == "bnn_local":
            assert not list(pyro.get_param_store().keys())
            module = guide
    else:
        ys = DiagonalLinearGaussianSSM(torch.full((2,), 0.8), torch.full((2,), 1.0), 0.5, 0.3).as_linear_gaussian().simulate(
            8, generator=torch.Generator().manual_seed(0))[1]
        model = DiagonalLinearGaussianSSM(torch.full((2,), 0.5), torch.full((2,), 0.7), 0.5, 0.3)
        filters = int(sys.argv[6])
        pyro.set_rng_seed(100 + rank)                     # independent filters on each rank
        loss = DistributedELBO(SMCELBO(num_particles=30, num_filters=filters)).loss_and_grads(model, None, ys)
    if rank == 0 or world == 1:
        torch.save({"loss": loss, "grads": grads(module)}, os.path.join(workdir, tag + ".pt"))
    if world > 1:
        # Without a clean teardown gloo's background threads can abort the process at exit
        # ("terminate called without an active exception"), failing the run after the work is done.
        dist.barrier()
        dist.destroy_process_group()
    """
)


def _launch(tmp_path, case, world, tag, *extra, ranks=None):
    """Runs ``world`` worker processes (or the given ranks, each alone) and loads rank 0's result."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ranks = range(world) if ranks is None else ranks
    procs = [subprocess.Popen([sys.executable, str(script), case, str(r), str(world), str(tmp_path), tag, *extra]) for r in ranks]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:  # a failed rank leaves the others blocked in a collective
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * len(procs), f"exit codes of ranks {list(ranks)}: {codes}"
    return torch.load(tmp_path / f"{tag}.pt")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("case", ["bnn", "bnn_local"])
def test_bnn_sharded_minibatch_gradients_match_the_full_batch(tmp_path, case):
    """Also with ``pyro.settings.set(module_local_params=True)``, where the guide's parameters
    live outside the param store: before, nothing was reduced there (each rank kept its own
    gradient, 42 from the union's, and the ranks' parameters drifted apart), with no warning."""
    two = _launch(tmp_path, case, 2, "two")
    one = _launch(tmp_path, case, 1, "one")
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) >= 3
    for name in one["grads"]:
        torch.testing.assert_close(two["grads"][name], one["grads"][name], rtol=1e-10, atol=1e-10)
    assert abs(two["loss"] - one["loss"]) < 1e-9 * abs(one["loss"])


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_smcelbo_filters_split_across_ranks(tmp_path):
    """Two ranks x 2 filters (seeds 100, 101) average to the mean over the 4 filters, which is what
    the single-process runs of each seed's 2 filters average to."""
    two = _launch(tmp_path, "smc", 2, "two", "2")
    # Each rank's work alone, in a one-process world (no process group): rank r keeps its seed 100 + r.
    singles = [_launch(tmp_path, "smc", 1, f"single{r}", "2", ranks=[r]) for r in (0, 1)]
    for name in two["grads"]:
        expected = (singles[0]["grads"][name] + singles[1]["grads"][name]) / 2
        torch.testing.assert_close(two["grads"][name], expected, rtol=1e-10, atol=1e-10)
    assert abs(two["loss"] - (singles[0]["loss"] + singles[1]["loss"]) / 2) < 1e-9
