"""The Gaussian engines' results: EP history records, defaults, immutability."""

import dataclasses

import pytest
import torch

from pyro_smc.infer import GaussianSmootherResult as exported
from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult


def test_ep_iteration_is_a_named_tuple():
    it = EPIteration(change=0.5, skipped=2)
    assert (it.change, it.skipped) == (0.5, 2) and it[0] == 0.5 and tuple(it) == (0.5, 2)


def test_gaussian_smoother_result_defaults():
    out = GaussianSmootherResult(torch.zeros(2, 1), torch.ones(2, 1, 1))
    assert out.history == () and out.converged and out.log_evidence is None and out.first_sweep is None
    assert exported is GaussianSmootherResult


def test_gaussian_smoother_result_is_immutable():
    out = GaussianSmootherResult(torch.zeros(2, 1), torch.ones(2, 1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.converged = False
