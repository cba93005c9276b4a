"""The typed results: one log-evidence name."""

import torch

from pyro_smc.ops import kalman
from pyro_smc.ops.results import FilterResult, SmootherResult


def test_filter_result_sums_its_increments():
    inc = torch.tensor([[-1.0, -2.0], [-0.5, 0.25]])  # (T, batch)
    z = torch.zeros(2, 2, 1)
    out = FilterResult(z, z, z, z, inc)
    torch.testing.assert_close(out.log_evidence, torch.tensor([-1.5, -1.75]))
    assert len(out) == 5 and out[4] is inc  # still a plain named tuple


def test_results_are_re_exported_where_they_began():
    assert kalman.FilterResult is FilterResult and kalman.SmootherResult is SmootherResult
    assert SmootherResult(torch.zeros(1, 1), torch.zeros(1, 1, 1)).log_evidence is None
