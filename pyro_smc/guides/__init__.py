"""Guides: Kronecker-structured and flow posteriors for weight matrices.

Modules:
    kronecker_flow: ``AutoKroneckerFlow`` (K-Diag, K-Linear, K-Nonlinear).
    matrix_transforms: invertible maps applied to every row / column of a matrix (K-Nonlinear).
"""

from pyro_smc.guides.kronecker_flow import AutoKroneckerFlow

__all__ = ["AutoKroneckerFlow"]
