"""Ready-made state-space models in the ``init``/``step`` protocol of :class:`pyro_smc.SMC`."""

from pyro_smc.models.linear_gaussian import LinearGaussianSSM

__all__ = ["LinearGaussianSSM"]
