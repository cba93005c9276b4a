"""Gaussian engines: the assumed-density Gaussian filters and RTS smoothers (EKF/EKS, UKF/URTSS,
GP-ADF/GP-RTSS), :class:`EPSmoother` that iterates on them, their projections, and
:func:`fit_evidence` to learn a model's parameters from their evidence.

Modules: ``smoothers`` (the filters and smoothers), ``projections`` (how a map's moments at a
Gaussian are found), ``ep`` (:class:`EPSmoother`), ``sequential`` and ``parallel`` (EP's
schedules, over the typed ``schedule`` records), ``factors`` (each factor's fitted linear model
and messages), ``sites`` (EP's site messages), ``observed`` (each step's observation status),
``result`` (the results), ``evidence_fit`` (:func:`fit_evidence`).
"""

from pyro_smc.infer.gaussian.ep import EPConvergenceWarning, EPSmoother
from pyro_smc.infer.gaussian.evidence_fit import fit_evidence
from pyro_smc.infer.gaussian.iterated import NominalLinearization, iterated_extended_rts_smoother
from pyro_smc.infer.gaussian.observed import ObservationStatus
from pyro_smc.infer.gaussian.projections import Linearization, MomentMatching, Projection, Unscented
from pyro_smc.infer.gaussian.result import EPIteration, EPState, GaussianSmootherResult
from pyro_smc.infer.gaussian.smoothers import (
    extended_kalman_filter,
    extended_rts_smoother,
    gaussian_filter,
    gaussian_smoother,
    gp_adf,
    gp_rtss,
    unscented_kalman_filter,
    unscented_rts_smoother,
)

__all__ = [
    "EPConvergenceWarning",
    "EPIteration",
    "EPSmoother",
    "EPState",
    "GaussianSmootherResult",
    "Linearization",
    "MomentMatching",
    "ObservationStatus",
    "Projection",
    "Unscented",
    "extended_kalman_filter",
    "extended_rts_smoother",
    "iterated_extended_rts_smoother",
    "NominalLinearization",
    "fit_evidence",
    "gaussian_filter",
    "gaussian_smoother",
    "gp_adf",
    "gp_rtss",
    "unscented_kalman_filter",
    "unscented_rts_smoother",
]
