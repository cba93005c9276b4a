"""Inference algorithms: :class:`SMC` and its loss :class:`SMCELBO`."""

from pyro_smc.infer.smc import SMC, SMCFailedError
from pyro_smc.infer.smc_elbo import SMCELBO

__all__ = ["SMC", "SMCELBO", "SMCFailedError"]
