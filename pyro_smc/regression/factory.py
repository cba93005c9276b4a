"""Build a regressor from its name: the ``regressor=`` argument of the online variational filter."""

from __future__ import annotations

from typing import Any, Union

from pyro_smc.regression.base import Regressor
from pyro_smc.regression.kernel_ridge import KernelRidgeRegressor
from pyro_smc.regression.mlp import MLPRegressor
from pyro_smc.regression.quadratic import QuadraticRegressor

__all__ = ["make_regressor"]


_REGRESSORS = {"quadratic": QuadraticRegressor, "kernel": KernelRidgeRegressor, "mlp": MLPRegressor}


def make_regressor(spec: Union[str, Regressor], **kwargs: Any) -> Regressor:
    """Build a regressor from a name, passing ``kwargs`` to its constructor, or return an instance as is.

    Args:
        spec: ``"quadratic"``, ``"kernel"``, ``"mlp"`` or a :class:`Regressor` instance.
        **kwargs: constructor arguments; not allowed with an instance.

    Example:
        >>> type(make_regressor("kernel", ridge=1e-3)).__name__
        'KernelRidgeRegressor'
    """
    if isinstance(spec, Regressor):
        if kwargs:
            raise ValueError(f"spec is already a Regressor instance; kwargs {sorted(kwargs)} cannot be applied")
        return spec
    if not isinstance(spec, str) or spec not in _REGRESSORS:
        raise ValueError(f"spec must be one of {sorted(_REGRESSORS)} or a Regressor instance, got {spec!r}")
    return _REGRESSORS[spec](**kwargs)
