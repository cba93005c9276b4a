"""Ready-made state-space models and the protocols they satisfy (:class:`StateSpaceModel`, the
``init``/``step`` protocol of :class:`pyro_smc.SMC`; :class:`GaussianStateSpaceModel`, what the
Gaussian engines read)."""

from pyro_smc.models.chaotic_rnn import ChaoticRNN
from pyro_smc.models.lorenz96 import Lorenz96SSM
from pyro_smc.models.linear_gaussian import DiagonalLinearGaussianSSM, LinearGaussianSSM
from pyro_smc.models.neural_ssm import LocallyOptimalProposal, NeuralProposal, NeuralSSM
from pyro_smc.models.nonlinear_gaussian import NonlinearGaussianSSM, time_dependent
from pyro_smc.models.protocol import GaussianStateSpaceModel, StateSpaceModel

__all__ = [
    "ChaoticRNN",
    "DiagonalLinearGaussianSSM",
    "GaussianStateSpaceModel",
    "LinearGaussianSSM",
    "LocallyOptimalProposal",
    "Lorenz96SSM",
    "NeuralProposal",
    "NeuralSSM",
    "NonlinearGaussianSSM",
    "StateSpaceModel",
    "time_dependent",
]
