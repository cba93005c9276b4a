"""make_regressor: names, constructor arguments, instances; the public names of ``pyro_smc.regression``."""

import pytest

from pyro_smc.regression import KernelRidgeRegressor, MLPRegressor, QuadraticRegressor, Regressor, make_regressor


def test_make_regressor():
    assert isinstance(make_regressor("quadratic"), QuadraticRegressor)
    assert isinstance(make_regressor("kernel", bandwidth=2.0), KernelRidgeRegressor)
    assert make_regressor("kernel", bandwidth=2.0).bandwidth == 2.0
    mlp = make_regressor("mlp", hidden_dims=(8,))
    assert isinstance(mlp, MLPRegressor) and mlp.hidden_dims == (8,)
    assert make_regressor(mlp) is mlp
    assert all(isinstance(make_regressor(n), Regressor) for n in ("quadratic", "kernel", "mlp"))
    with pytest.raises(ValueError, match="spec.*'kernel'.*'mlp'.*'quadratic'"):
        make_regressor("gp")
    with pytest.raises(ValueError, match="kwargs"):
        make_regressor(mlp, num_steps=3)


def test_the_old_import_path_re_exports_the_same_objects():
    import pyro_smc.regression as new
    import pyro_smc.regression as old

    assert all(getattr(old, name) is getattr(new, name) for name in new.__all__)
    assert old.__all__ == new.__all__
