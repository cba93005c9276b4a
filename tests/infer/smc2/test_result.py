"""SMC2's step records and their stacked result."""

import math

import torch

from pyro_smc.infer.smc2.result import SMC2Result, SMC2StepRecord


def test_stack_orders_records_and_averages_acceptance():
    records = [
        SMC2StepRecord(torch.tensor(-1.0), torch.tensor(10.0), False, (), 10),
        SMC2StepRecord(torch.tensor(-2.0), torch.tensor(4.0), True, (0.5, 0.25, 0.0), 20),
        SMC2StepRecord(torch.tensor(-0.5), torch.tensor(9.0), False, (), 20),
    ]
    out = SMC2Result.stack(records, torch.tensor(-3.5))
    assert out.log_evidence_increments.tolist() == [-1.0, -2.0, -0.5]
    assert out.ess.tolist() == [10.0, 4.0, 9.0]
    assert out.rejuvenated.tolist() == [False, True, False]
    rates = out.acceptance_rates.tolist()
    assert math.isnan(rates[0]) and rates[1] == 0.25 and math.isnan(rates[2])
    assert out.move_acceptance_rates == ((), (0.5, 0.25, 0.0), ())
    assert out.acceptance_rates.dtype == out.log_evidence.dtype
    assert out.num_particles.tolist() == [10, 20, 20]
