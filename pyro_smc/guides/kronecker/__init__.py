"""Kronecker-structured and flow posteriors for weight matrices: :class:`AutoKroneckerFlow`.

One module per concept: ``flow`` (the guide, an ``AutoGuide``), ``kinds`` (the posterior families
K-Diag, K-Linear and K-Nonlinear as strategy objects; subclass ``KroneckerKind`` for a new one)
and ``transforms`` (the invertible maps applied to every row and column of a matrix).
"""

from pyro_smc.guides.kronecker.flow import AutoKroneckerFlow
from pyro_smc.guides.kronecker.kinds import DiagKind, KroneckerKind, LinearKind, NonlinearKind

__all__ = ["AutoKroneckerFlow", "DiagKind", "KroneckerKind", "LinearKind", "NonlinearKind"]
