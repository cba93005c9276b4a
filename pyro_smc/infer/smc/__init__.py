"""Differentiable sequential Monte Carlo (:class:`SMC`, the successor of ``pyro.infer.SMCFilter``)
and its loss (:class:`SMCELBO`).

One module per concept: ``engine`` (the loop and its results), ``step`` (one step's phases:
propose, weigh, summarise, maybe resample), ``state`` (what is carried between steps: the
particles and the weights), ``result`` (a step's record and the run's stacked records),
``importance`` (a step's importance weight from the traces), ``scores`` (the score-function
terms that need the step's state), ``schedule`` (what ``run`` feeds each step), ``checks``
(input checks and warnings), ``smoothing`` (the stored history and the particle smoothers),
``checkpoint`` (``state_dict``), ``compiled`` (a step recorded once and replayed), ``elbo``
(``SMCELBO``), and the options that resample at the start of a step: ``first_stage`` (that
resampling), ``auxiliary`` (the auxiliary filter's look-ahead) and ``qmc`` (SQMC's inverse-CDF
draws).
"""

from pyro_smc.infer.smc.checks import NonReparameterizedGradientWarning, ParticleDegeneracyWarning
from pyro_smc.infer.smc.compiled import CompileFallbackWarning
from pyro_smc.infer.smc.elbo import SMCELBO
from pyro_smc.infer.smc.engine import SMC
from pyro_smc.infer.smc.importance import SMCFailedError
from pyro_smc.infer.smc.result import SMCResult, StepRecord
from pyro_smc.infer.smc.state import ParticleWeights, SMCState

__all__ = [
    "CompileFallbackWarning",
    "NonReparameterizedGradientWarning",
    "ParticleDegeneracyWarning",
    "ParticleWeights",
    "SMC",
    "SMCELBO",
    "SMCFailedError",
    "SMCResult",
    "SMCState",
    "StepRecord",
]
