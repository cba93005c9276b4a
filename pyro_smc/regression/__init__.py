"""Regressors for the value and score functions of online variational filtering (Campbell et al., 2021).

See ``docs/math/streaming.md#value-function-regression``.

At each time step the filter draws ``N`` samples ``x_i`` ``(N, d)`` with targets ``y_i`` (``(N,)`` for
the value function ``V_t``, ``(N, P)`` for a parameter score ``S_t``), fits a regressor and then
backpropagates through ``regressor(x)`` into reparameterised samples. Hence every regressor here

* predicts differentiably in ``x`` (never in the training data: ``fit`` detaches inputs and targets,
  and nothing stored afterwards requires grad);
* costs constant memory and time per fit (``N`` fixed; nothing accumulates across fits);
* keeps dtype and device of the fit inputs, and round-trips through :meth:`Regressor.state_dict`.

Three regressors share one interface:

* :class:`QuadraticRegressor`: ridge least squares on quadratic features; exact for quadratic
  targets (the linear-Gaussian case, where ``V_t`` is quadratic).
* :class:`KernelRidgeRegressor`: RBF kernel ridge regression with a median-heuristic bandwidth.
* :class:`MLPRegressor`: a small MLP trained by Adam, warm-started from the previous fit.

:func:`make_regressor` builds one from a name. This package is pure torch, one module per concept:
``pyro_smc.regression.base`` (the :class:`Regressor` interface and shared numerics), ``quadratic``,
``kernel_ridge``, ``mlp`` (one regressor each) and ``factory`` (:func:`make_regressor`).

Example:
    >>> import torch
    >>> from pyro_smc.regression import make_regressor
    >>> x = torch.randn(200, 2, dtype=torch.float64)
    >>> reg = make_regressor("quadratic").fit(x, (x ** 2).sum(-1))
    >>> x_new = torch.ones(5, 2, dtype=torch.float64, requires_grad=True)
    >>> v = reg(x_new)  # (5,), differentiable in x_new
    >>> v.sum().backward()
    >>> v.shape, torch.allclose(x_new.grad, 2 * x_new.detach(), atol=1e-6)
    (torch.Size([5]), True)
"""

from pyro_smc.regression.base import Regressor
from pyro_smc.regression.factory import make_regressor
from pyro_smc.regression.kernel_ridge import KernelRidgeRegressor
from pyro_smc.regression.mlp import MLPRegressor
from pyro_smc.regression.quadratic import QuadraticRegressor

__all__ = ["Regressor", "QuadraticRegressor", "KernelRidgeRegressor", "MLPRegressor", "make_regressor"]
