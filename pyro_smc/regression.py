"""Value- and score-function regressors of the online variational filter (the public import path).

The code lives in ``pyro_smc.infer.regression``, beside its only user, the online filter;
this module re-exports it so that ``from pyro_smc.regression import make_regressor`` keeps working.

Example:
    >>> import torch
    >>> from pyro_smc.regression import make_regressor
    >>> x = torch.randn(50, 2, dtype=torch.float64)
    >>> make_regressor("quadratic").fit(x, (x ** 2).sum(-1))(x[:3]).shape
    torch.Size([3])
"""

from pyro_smc.infer.regression import KernelRidgeRegressor, MLPRegressor, QuadraticRegressor, Regressor, make_regressor

__all__ = ["Regressor", "QuadraticRegressor", "KernelRidgeRegressor", "MLPRegressor", "make_regressor"]
