"""pyro_smc: differentiable SMC and friends for Pyro.

>>> from pyro_smc import SMC, SMCELBO, EPSmoother, OnlineVariationalFilter
"""

from pyro_smc.infer import PMMH, SMC, SMC2, SMCELBO, EPSmoother, OnlineVariationalFilter, ParticleGibbs
from pyro_smc.progress import logger  # noqa: F401  (the ``pyro_smc`` logger, with its NullHandler)

__version__ = "0.2.0.dev0"
__all__ = ["SMC", "SMCELBO", "EPSmoother", "OnlineVariationalFilter", "PMMH", "ParticleGibbs", "SMC2"]
