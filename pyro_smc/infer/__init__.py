"""Inference algorithms: :class:`SMC` and its loss :class:`SMCELBO`; :class:`EPSmoother` and the
Gaussian filters and smoothers it refines, with their projections (:class:`Linearization`,
:class:`Unscented`, :class:`MomentMatching`, subclasses of :class:`Projection`);
:func:`fit_evidence` to learn a model's parameters from the evidence; :class:`OnlineVariationalFilter`."""

from pyro_smc.infer.ep_smoother import EPConvergenceWarning, EPSmoother
from pyro_smc.infer.evidence_fit import fit_evidence
from pyro_smc.infer.gaussian_smoothers import (
    GaussianSmootherResult,
    extended_kalman_filter,
    extended_rts_smoother,
    gaussian_filter,
    gaussian_smoother,
    gp_adf,
    gp_rtss,
    unscented_kalman_filter,
    unscented_rts_smoother,
)
from pyro_smc.infer.online import OnlineFilterWarning, OnlineVariationalFilter
from pyro_smc.infer.projections import Linearization, MomentMatching, Projection, Unscented
from pyro_smc.infer.smc import SMC, ParticleDegeneracyWarning, SMCFailedError
from pyro_smc.infer.smc_elbo import SMCELBO

__all__ = [
    "SMC",
    "SMCELBO",
    "EPSmoother",
    "EPConvergenceWarning",
    "GaussianSmootherResult",
    "Linearization",
    "MomentMatching",
    "OnlineVariationalFilter",
    "OnlineFilterWarning",
    "ParticleDegeneracyWarning",
    "Projection",
    "Unscented",
    "SMCFailedError",
    "extended_kalman_filter",
    "fit_evidence",
    "extended_rts_smoother",
    "gaussian_filter",
    "gaussian_smoother",
    "gp_adf",
    "gp_rtss",
    "unscented_kalman_filter",
    "unscented_rts_smoother",
]
