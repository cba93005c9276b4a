"""pyro_smc: differentiable SMC and friends for Pyro.

    >>> from pyro_smc import SMC, SMCELBO, EPSmoother
"""

from pyro_smc.infer import SMC, SMCELBO, EPSmoother

__version__ = "0.1.0"
__all__ = ["SMC", "SMCELBO", "EPSmoother"]
