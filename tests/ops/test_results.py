"""The typed results: one log-evidence name, deprecated names that warn, EP history records."""

import pytest
import torch

from pyro_smc.ops import kalman
from pyro_smc.ops.results import EPIteration, FilterResult, GaussianSmootherResult, SmootherResult


def test_filter_result_sums_its_increments():
    inc = torch.tensor([[-1.0, -2.0], [-0.5, 0.25]])  # (T, batch)
    z = torch.zeros(2, 2, 1)
    out = FilterResult(z, z, z, z, inc)
    torch.testing.assert_close(out.log_evidence, torch.tensor([-1.5, -1.75]))
    with pytest.warns(FutureWarning, match="log_evidence_increments"):
        assert out.log_likelihoods is inc
    assert len(out) == 5 and out[4] is inc  # still a plain named tuple


def test_results_are_re_exported_where_they_began():
    from pyro_smc.infer.gaussian_smoothers import GaussianSmootherResult as moved

    assert kalman.FilterResult is FilterResult and kalman.SmootherResult is SmootherResult
    assert moved is GaussianSmootherResult
    assert SmootherResult(torch.zeros(1, 1), torch.zeros(1, 1, 1)).log_evidence is None


def test_ep_iteration_reads_like_the_old_dicts_with_a_warning():
    it = EPIteration(change=0.5, skipped=2)
    assert (it.change, it.skipped) == (0.5, 2) and it[0] == 0.5 and tuple(it) == (0.5, 2)
    with pytest.warns(FutureWarning, match=r"history\[k\]\.skipped"):
        assert it["skipped"] == 2


def test_gaussian_smoother_result_defaults_and_old_name():
    out = GaussianSmootherResult(torch.zeros(2, 1), torch.ones(2, 1, 1))
    assert out.history == () and out.converged and out.log_evidence is None and out.first_sweep is None
    with pytest.warns(FutureWarning, match="GaussianSmootherResult.log_evidence"):
        assert out.log_likelihood is None
