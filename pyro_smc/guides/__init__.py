"""Guides: Kronecker-structured and flow posteriors for weight matrices (in progress).

Modules:
    matrix_transforms: invertible maps applied to every row / column of a matrix (K-Nonlinear).
"""

__all__: list[str] = []
