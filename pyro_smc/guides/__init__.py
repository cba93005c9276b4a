"""Guides: Kronecker-structured and flow posteriors for weight matrices; the streaming filter family.

Modules:
    kronecker: ``AutoKroneckerFlow`` (``kronecker.flow``: K-Diag, K-Linear, K-Nonlinear), the
        posterior families as strategy objects (``kronecker.kinds``: ``DiagKind``, ``LinearKind``,
        ``NonlinearKind``; subclass ``KroneckerKind`` for a new one)
        and the invertible maps applied to every row / column of a matrix (``kronecker.transforms``,
        K-Nonlinear).
    streaming: ``StreamingFamily`` (``streaming.family``), the filtering marginal plus backward
        kernels that the online filter trains, and ``StreamingFilterGuide`` (``streaming.guide``),
        that family usable online or as a whole-trajectory guide.
"""

from pyro_smc.guides.kronecker import AutoKroneckerFlow
from pyro_smc.guides.streaming import StreamingFamily, StreamingFilterGuide

__all__ = ["AutoKroneckerFlow", "StreamingFamily", "StreamingFilterGuide"]
