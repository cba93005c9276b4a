"""Checkpoint and resume: a stream killed mid-run and resumed continues bit-identically."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import pyro, torch
    torch.set_num_threads(1)
    from pyro_smc import SMC, OnlineVariationalFilter
    from pyro_smc.guides import StreamingFilterGuide
    from pyro_smc.models import DiagonalLinearGaussianSSM
    from pyro_smc.resamplers import OTResampler

    engine, mode, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    T, slow = 12, mode == "killed"
    ys = DiagonalLinearGaussianSSM(torch.full((2,), 0.8), torch.full((2,), 1.0), 0.5, 0.3).as_linear_gaussian().simulate(
        T, generator=torch.Generator().manual_seed(0))[1]
    pyro.clear_param_store()
    torch.manual_seed(1)
    model = DiagonalLinearGaussianSSM(torch.full((2,), 0.4), torch.full((2,), 0.5), 0.5, 0.3)
    if engine == "smc":
        runner = SMC(model, num_particles=64, num_filters=2, resampler=OTResampler(epsilon=0.5))
        runner.init()
    else:
        runner = OnlineVariationalFilter(model, StreamingFilterGuide(2), num_iterations=3, num_regression_samples=32,
                                         learn_parameters=True)
    ckpt = os.path.join(workdir, engine + ".pt")
    start = 0
    if mode == "resume":
        state = torch.load(ckpt, weights_only=False)
        runner.load_state_dict(state)
        start = state["t"]
    for t in range(start, T):
        runner.step(ys[t])
        if mode != "full":
            torch.save(runner.state_dict(), ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # atomic: a kill never leaves half a checkpoint
        if slow:
            # Give the parent time to kill us mid-stream; from t = 6 on wait for it however loaded
            # the machine is, so the stream can never finish first.
            time.sleep(0.3 if t < 6 else 600)
    if engine == "smc":
        out = {"log_evidence": runner.log_evidence, "means": runner.filtering_means["x"], "state": runner.state["x"]}
    else:
        out = {"elbo": runner.elbo, "mean": runner.filtering_distribution().mean, **runner.parameters()}
    torch.save(out, os.path.join(workdir, engine + "." + mode + ".out"))
    """
)


def _run(tmp_path, engine, mode):
    return subprocess.Popen([sys.executable, str(tmp_path / "stream.py"), engine, mode, str(tmp_path)], env={**os.environ, "PYTHONHASHSEED": "0"})


@pytest.mark.parametrize("engine", ["smc", "online"])
def test_killed_stream_resumes_bit_identically(engine, tmp_path):
    (tmp_path / "stream.py").write_text(SCRIPT)
    full = _run(tmp_path, engine, "full")
    killed = _run(tmp_path, engine, "killed")
    ckpt = tmp_path / f"{engine}.pt"
    deadline = time.time() + 300
    try:
        # Kill once a checkpoint from the middle of the stream exists.
        while time.time() < deadline and killed.poll() is None:
            if ckpt.exists() and torch.load(ckpt, weights_only=False)["t"] >= 4:
                break
            time.sleep(0.05)
        assert killed.poll() is None, "the stream finished before it could be killed"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    t_killed = torch.load(ckpt, weights_only=False)["t"]
    assert 4 <= t_killed < 12
    assert _run(tmp_path, engine, "resume").wait(timeout=300) == 0
    assert full.wait(timeout=300) == 0
    expected = torch.load(tmp_path / f"{engine}.full.out", weights_only=False)
    got = torch.load(tmp_path / f"{engine}.resume.out", weights_only=False)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_smc_checkpoints_hold_no_parameters():
    """As the README says: ``SMC.state_dict`` holds the filters, not the parameters. A PyroParam and
    a module weight changed after the checkpoint keep their new values after ``load_state_dict``,
    and no tensor in the checkpoint is a parameter."""
    import pyro

    from pyro_smc import SMC
    from pyro_smc.models import NeuralSSM

    pyro.clear_param_store()
    torch.manual_seed(0)
    model = NeuralSSM(2, hidden_dim=4)
    ys = torch.randn(4, 2)
    smc = SMC(model, num_particles=8).run(ys)
    checkpoint = smc.state_dict()
    with torch.no_grad():
        model.transition_scale = torch.full((2,), 0.123)
        model.transition_net[0].weight.fill_(0.5)
    smc.load_state_dict(checkpoint)
    torch.testing.assert_close(model.transition_scale, torch.full((2,), 0.123))
    assert bool((model.transition_net[0].weight == 0.5).all())
    params = {id(p) for p in model.parameters()}

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from tensors(v)

    assert not any(isinstance(t, torch.nn.Parameter) or id(t) in params for t in tensors(checkpoint))
