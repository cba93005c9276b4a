"""Progress bars (on in interactive use only) and the ``pyro_smc`` logger."""

import io
import logging

import pytest
import torch

import pyro_smc.progress as progress_module
from pyro_smc import SMC, SMCELBO, EPSmoother, OnlineVariationalFilter
from pyro_smc.guides import StreamingFilterGuide
from pyro_smc.infer import fit_evidence
from pyro_smc.models import LinearGaussianSSM
from pyro_smc.progress import progress_enabled


def _ssm(a=0.5):
    eye = torch.eye(1)
    return LinearGaussianSSM(a * eye, eye, eye, 0.5 * eye, torch.zeros(1), eye)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_auto_is_on_in_a_terminal_and_off_under_pytest_and_ci(monkeypatch):
    assert progress_enabled(None) is False  # pytest sets PYTEST_CURRENT_TEST
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("PYRO_SMC_PROGRESS_BAR", raising=False)
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert progress_enabled(None) is True
    monkeypatch.setenv("CI", "true")
    assert progress_enabled(None) is False
    monkeypatch.delenv("CI")
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a pipe or a file: no bar
    assert progress_enabled(None) is False
    assert progress_enabled(True) is True and progress_enabled(False) is False
    monkeypatch.setenv("PYRO_SMC_PROGRESS_BAR", "1")  # the process-wide switch
    assert progress_enabled(None) is True and progress_enabled(False) is False
    monkeypatch.setenv("PYRO_SMC_PROGRESS_BAR", "0")
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert progress_enabled(None) is False


@pytest.mark.parametrize("make", [
    lambda bar: SMC(_ssm(), num_particles=4, progress_bar=bar),
    lambda bar: EPSmoother(_ssm(), progress_bar=bar),
    lambda bar: OnlineVariationalFilter(_ssm(), StreamingFilterGuide(1), progress_bar=bar),
], ids=["SMC", "EPSmoother", "OnlineVariationalFilter"])
def test_a_progress_bar_that_is_not_a_bool_is_refused_at_construction(make):
    with pytest.raises(TypeError, match="progress_bar"):
        make("yes")
    make(None), make(True), make(False)


def test_bars_are_drawn_when_asked(monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    ssm = _ssm()
    _, ys = ssm.simulate(20)
    smc = SMC(ssm, num_particles=10, store_history=True, progress_bar=True).run(ys)
    smc.smooth(3)
    EPSmoother(ssm, max_iter=3, progress_bar=True).smooth(ys)
    err = capsys.readouterr().err
    assert "SMC" in err and "SMC.smooth (ffbs)" in err and "EPSmoother (sequential)" in err
    SMC(ssm, num_particles=10, progress_bar=False).run(ys)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_every_ep_sweep_is_logged(schedule, caplog):
    ssm = _ssm()
    _, ys = ssm.simulate(15)
    with caplog.at_level(logging.DEBUG, logger="pyro_smc"):
        result = EPSmoother(ssm, max_iter=6, schedule=schedule, projection="unscented").smooth(ys)
    sweeps = [r for r in caplog.records if r.name == "pyro_smc" and r.getMessage().startswith("EPSmoother: sweep")]
    assert len(sweeps) == len(result.history) >= 1
    assert sweeps[-1].getMessage().startswith(f"EPSmoother: sweep {len(result.history)},")


def test_fit_evidence_logs_every_step_and_silences_the_smoothers_bar(caplog, monkeypatch, capsys):
    from pyro.nn import PyroModule, PyroParam

    from pyro_smc.models import NonlinearGaussianSSM

    class Drift(PyroModule):
        def __init__(self):
            super().__init__()
            self.b = PyroParam(torch.tensor(0.0))

        def forward(self, x):
            return 0.8 * x + self.b * torch.sin(x)

    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    one = torch.eye(1)
    _, ys = _ssm(0.8).simulate(20)
    smoother = EPSmoother(NonlinearGaussianSSM(Drift(), 0.5 * one, lambda x: x, 0.3 * one, torch.zeros(1), one),
                          projection="unscented", tol=1e-4, progress_bar=True)
    with caplog.at_level(logging.DEBUG, logger="pyro_smc"):
        losses = fit_evidence(smoother, ys, num_steps=4, lr=0.05, progress_bar=True)
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fit_evidence: step")]
    assert len(steps) == len(losses) == 4
    err = capsys.readouterr().err
    assert "fit_evidence" in err and "EPSmoother" not in err  # one bar: the fit's
    assert smoother.progress_bar is True  # restored afterwards


def test_the_elbo_never_draws_a_bar():
    ssm = _ssm()
    _, ys = ssm.simulate(5)
    elbo = SMCELBO(num_particles=50)
    elbo.loss(ssm, None, ys)
    assert elbo.smc.progress_bar is False


def test_the_package_logger_is_silent_by_default():
    logger = logging.getLogger("pyro_smc")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
