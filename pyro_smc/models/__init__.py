"""Ready-made state-space models in the ``init``/``step`` protocol of :class:`pyro_smc.SMC`."""

from pyro_smc.models.chaotic_rnn import ChaoticRNN
from pyro_smc.models.linear_gaussian import DiagonalLinearGaussianSSM, LinearGaussianSSM
from pyro_smc.models.nonlinear_gaussian import NonlinearGaussianSSM

__all__ = ["ChaoticRNN", "DiagonalLinearGaussianSSM", "LinearGaussianSSM", "NonlinearGaussianSSM"]
