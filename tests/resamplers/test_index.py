"""The index resamplers called directly: what they accept."""

import pytest
import torch

from pyro_smc.resamplers import MultinomialResampler, ResidualResampler, StratifiedResampler, SystematicResampler


@pytest.mark.parametrize("resampler", [SystematicResampler(), StratifiedResampler(), ResidualResampler(), MultinomialResampler()])
def test_unnormalised_log_weights_are_normalised_first(resampler):
    """Before: systematic, stratified and residual resampling read the log-weights as if they summed
    to one, so ``[0, 5, 1]`` copied particle 0 every time (weighted mean 1.01, new mean 0). The
    offspring of each particle now match the normalised weights' within 5 sigma of a binomial count."""
    torch.manual_seed(0)
    log_w = torch.tensor([0.0, 5.0, 1.0], dtype=torch.float64).expand(4000, 3)
    out = resampler.resample({"x": torch.arange(3.0, dtype=torch.float64).expand(4000, 3)}, log_w)
    counts = torch.stack([(out.ancestors == i).double().mean(-1).mean() for i in range(3)])
    w = log_w[0].softmax(-1)
    se = (w * (1 - w) / (3 * 4000)).sqrt()  # multinomial's spread bounds the others'
    assert ((counts - w).abs() < 5 * se + 1e-12).all(), (counts, w)
    assert torch.allclose(out.log_weights, torch.full_like(log_w, -torch.log(torch.tensor(3.0, dtype=torch.float64))))
