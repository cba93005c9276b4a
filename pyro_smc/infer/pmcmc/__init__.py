"""Particle MCMC for Pyro state-space models, as :mod:`pyro.infer.mcmc` kernels over a model's
``PyroSample`` static parameters (:class:`~pyro_smc.infer.static_parameters.StaticParameters`).

One module per concept: ``pmmh`` (:class:`PMMH`, particle marginal Metropolis-Hastings with the
``SMC`` log-evidence), ``proposals`` (:class:`AdaptiveRandomWalk`, shared by both kernels),
``csmc`` (:class:`ConditionalSMC`, the conditional sweep with ancestor sampling), ``paths``
(:class:`~pyro_smc.infer.pmcmc.paths.PathReplay`, the model scored along a fixed path, centred
and non-centred) and ``gibbs`` (:class:`ParticleGibbs`).
"""

from pyro_smc.infer.pmcmc.csmc import ConditionalSMC, Trajectory, trajectory_log_density
from pyro_smc.infer.pmcmc.gibbs import ParticleGibbs
from pyro_smc.infer.pmcmc.pmmh import PMMH
from pyro_smc.infer.pmcmc.proposals import AdaptiveRandomWalk

__all__ = ["AdaptiveRandomWalk", "ConditionalSMC", "PMMH", "ParticleGibbs", "Trajectory", "trajectory_log_density"]
