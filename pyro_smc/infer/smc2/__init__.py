"""SMC^2 (:class:`SMC2`): the sequential posterior of a state-space model's static parameters and
its evidence, each parameter particle carrying a particle filter.

One module per concept: ``engine`` (the loop, the reweighting and the estimates), ``filters``
(the inner filters as one batched ``SMC``: their parameters' layout, replays, reindexing and
merging), ``rejuvenation`` (the fitted Gaussian proposal and the particle marginal
Metropolis-Hastings move) and ``result`` (a step's record and the run's stacked records).
"""

from pyro_smc.infer.smc2.engine import SMC2
from pyro_smc.infer.smc2.filters import InnerFilters
from pyro_smc.infer.smc2.rejuvenation import GaussianProposal
from pyro_smc.infer.smc2.result import SMC2Result, SMC2StepRecord

__all__ = ["GaussianProposal", "InnerFilters", "SMC2", "SMC2Result", "SMC2StepRecord"]
