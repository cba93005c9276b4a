"""pyro_smc: differentiable SMC and friends for Pyro.

    >>> from pyro_smc import SMC, SMCELBO, EPSmoother, OnlineVariationalFilter
"""

from pyro_smc.infer import SMC, SMCELBO, EPSmoother, OnlineVariationalFilter
from pyro_smc.progress import logger  # noqa: F401  (the ``pyro_smc`` logger, with its NullHandler)

__version__ = "0.2.0.dev0"
__all__ = ["SMC", "SMCELBO", "EPSmoother", "OnlineVariationalFilter"]
