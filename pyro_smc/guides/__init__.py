"""Guides: Kronecker-structured and flow posteriors for weight matrices; the streaming filter family.

Modules:
    kronecker_flow: ``AutoKroneckerFlow`` (K-Diag, K-Linear, K-Nonlinear).
    kronecker_kinds: the posterior families as strategy objects (``DiagKind``, ``LinearKind``,
        ``NonlinearKind``; subclass ``KroneckerKind`` for a new one).
    matrix_transforms: invertible maps applied to every row / column of a matrix (K-Nonlinear).
    streaming_family: ``StreamingFamily``, the filtering marginal plus backward kernels (the
        per-step variational family the online filter trains).
    streaming: ``StreamingFilterGuide``, that family usable online or as a whole-trajectory guide.
"""

from pyro_smc.guides.kronecker_flow import AutoKroneckerFlow
from pyro_smc.guides.streaming import StreamingFilterGuide
from pyro_smc.guides.streaming_family import StreamingFamily

__all__ = ["AutoKroneckerFlow", "StreamingFamily", "StreamingFilterGuide"]
