"""The shared argument checks (pyro_smc.checks): canonical values back, one message each."""

import math

import pytest
import torch

from pyro_smc.checks import boolean, nonnegative_float, positive_float, positive_int, unit_interval


@pytest.mark.parametrize("check, good, bad, message", [
    (positive_int, [(1, 1), (7, 7)], [0, -1, 1.0, True, "3", None], "must be an integer >= 1"),
    (unit_interval, [(1, 1.0), (0.25, 0.25)], [0, 0.0, -0.5, 1.5, math.nan, True, "0.5"], r"must lie in \(0, 1\]"),
    (positive_float, [(2, 2.0), (1e-9, 1e-9)], [0, -1.0, math.inf, math.nan, True, None], "must be a finite number > 0"),
    (nonnegative_float, [(0, 0.0), (3.5, 3.5)], [-1e-9, math.inf, math.nan, False], "must be a finite number >= 0"),
    (boolean, [(True, True), (False, False)], [1, 0, "yes", torch.tensor(True)], "must be True or False"),
])
def test_checks_return_canonical_values_and_name_the_argument(check, good, bad, message):
    for value, expected in good:
        out = check("arg", value)
        assert out == expected and type(out) is type(expected)
    for value in bad:
        with pytest.raises(ValueError, match=f"^arg {message}, got "):
            check("arg", value)
