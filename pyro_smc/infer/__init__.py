"""Inference algorithms: :class:`SMC` and its loss :class:`SMCELBO`; :class:`EPSmoother` and the
Gaussian filters and smoothers it refines, with their projections (:class:`Linearization`,
:class:`Unscented`, :class:`MomentMatching`, subclasses of :class:`Projection`);
:func:`fit_evidence` to learn a model's parameters from the evidence; :class:`OnlineVariationalFilter`;
the particle MCMC kernels :class:`PMMH` and :class:`ParticleGibbs` and the sequential parameter
posterior :class:`SMC2`, over a model's ``PyroSample`` static parameters."""

from pyro_smc.infer.gaussian import (
    EPConvergenceWarning,
    EPSmoother,
    GaussianSmootherResult,
    Linearization,
    MomentMatching,
    Projection,
    Unscented,
    extended_kalman_filter,
    extended_rts_smoother,
    iterated_extended_rts_smoother,
    NominalLinearization,
    fit_evidence,
    gaussian_filter,
    gaussian_smoother,
    gp_adf,
    gp_rtss,
    unscented_kalman_filter,
    unscented_rts_smoother,
)
from pyro_smc.infer.pmcmc import PMMH, AdaptiveRandomWalk, ParticleGibbs
from pyro_smc.infer.smc2 import SMC2, SMC2Result
from pyro_smc.infer.online import OnlineFilterWarning, OnlineVariationalFilter
from pyro_smc.infer.smc import SMC, SMCELBO, ParticleDegeneracyWarning, SMCFailedError

__all__ = [
    "SMC",
    "SMCELBO",
    "EPSmoother",
    "EPConvergenceWarning",
    "GaussianSmootherResult",
    "Linearization",
    "MomentMatching",
    "NominalLinearization",
    "PMMH",
    "ParticleGibbs",
    "AdaptiveRandomWalk",
    "SMC2",
    "SMC2Result",
    "OnlineVariationalFilter",
    "OnlineFilterWarning",
    "ParticleDegeneracyWarning",
    "Projection",
    "Unscented",
    "SMCFailedError",
    "extended_kalman_filter",
    "fit_evidence",
    "extended_rts_smoother",
    "iterated_extended_rts_smoother",
    "gaussian_filter",
    "gaussian_smoother",
    "gp_adf",
    "gp_rtss",
    "unscented_kalman_filter",
    "unscented_rts_smoother",
]
