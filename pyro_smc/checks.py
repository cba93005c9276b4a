"""The argument checks every engine, guide and resampler shares, one message each.

Each check returns the value in its canonical Python type, or raises ``ValueError`` naming the
argument and showing the value it got, so that a user sees which setting to change.

Example:
    >>> from pyro_smc.checks import positive_int, unit_interval
    >>> positive_int("num_particles", 100), unit_interval("ess_threshold", 0.5)
    (100, 0.5)
    >>> positive_int("num_particles", 0)
    Traceback (most recent call last):
        ...
    ValueError: num_particles must be an integer >= 1, got 0
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["boolean", "int_at_least", "nonnegative_float", "positive_float", "positive_int", "unit_interval"]


def _is_real(value: Any) -> bool:
    # bool is an int subclass; True as a tolerance or a count is a mistake, not a 1.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int >= 1``.

    Example:
        >>> positive_int("max_iter", 10)
        10
    """
    return int_at_least(name, value, 1)


def int_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int >= minimum`` (a count that may be zero, a sample size of at least 2).

    Example:
        >>> int_at_least("num_iterations", 0, minimum=0)
        0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def unit_interval(name: str, value: Any) -> float:
    """``value`` as a float in ``(0, 1]`` (a fraction, a damping step, an ESS threshold).

    Example:
        >>> unit_interval("damping", 1)
        1.0
    """
    if not (_is_real(value) and 0 < value <= 1):
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def positive_float(name: str, value: Any) -> float:
    """``value`` as a finite float ``> 0`` (a regularisation, a tolerance, a learning rate).

    Example:
        >>> positive_float("epsilon", 0.5)
        0.5
    """
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def nonnegative_float(name: str, value: Any) -> float:
    """``value`` as a finite float ``>= 0`` (a jitter, a weight decay).

    Example:
        >>> nonnegative_float("jitter", 0)
        0.0
    """
    if not (_is_real(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (a truthy tensor or string is refused).

    Example:
        >>> boolean("store_history", True)
        True
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
