r"""Gaussian projections: the moments of ``a = f(x) + noise`` for ``x ~ N(m, P)``.

Every Gaussian filter, smoother and EP update in pyro_smc reduces a nonlinear map to three
numbers, the mean ``mu_a``, covariance ``S_a`` and input-output covariance ``C = Cov[x, a]``
of ``a`` under a Gaussian ``x``, and then treats the map as the implicit linear model
``a = J x + c + eps`` with ``J = C^T P^{-1}``, ``c = mu_a - J m`` and
``Cov[eps] = S_a - J P J^T``. The three projections differ only in how they
get the moments:

* ``"linearization"`` (EKF/EKS; GP-EKS for GPs): ``J = df/dx`` at ``m`` by autograd (the GP
  posterior-mean Jacobian), ``mu_a = f(m)``, ``S_a = J P J^T (+ GP variance at m)``.
* ``"unscented"`` (UKF/URTSS): sigma points through ``f``; for a GP the mean predictive
  variance over the sigma points is added.
* ``"moment_matching"`` (GP-ADF/GP-RTSS/GPADS): the exact moments of an SE-ARD GP at a
  Gaussian input. A plain callable has no exact moments; it falls back to ``"unscented"``.

Example:
    >>> import torch
    >>> from pyro_smc.infer.projections import project
    >>> m, P = torch.zeros(1, dtype=torch.float64), torch.eye(1, dtype=torch.float64)
    >>> mu, S, C = project(lambda x: 2 * x, m, P, 0, "linearization", noise_cov=0.5 * P)
    >>> S.item(), C.item()
    (4.5, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pyro_smc.models.nonlinear_gaussian import is_gp
from pyro_smc.ops.unscented import sigma_points, unscented_moments

__all__ = ["PROJECTIONS", "project", "unscented_settings"]

PROJECTIONS = ("moment_matching", "linearization", "unscented")


def unscented_settings(unscented: dict | None, factor: str) -> dict | None:
    """Sigma-point settings for ``factor`` (``"transition"`` or ``"observation"``).

    ``unscented`` is either one dict of ``alpha``, ``beta``, ``kappa`` for every factor, or a dict
    with ``"transition"`` and/or ``"observation"`` keys holding such dicts (Kamthe et al. use
    ``kappa = 3`` for the dynamics and ``kappa = 2`` for the measurement).
    """
    if not unscented:
        return None
    if set(unscented) <= {"transition", "observation"}:
        return unscented.get(factor)
    unknown = set(unscented) - {"alpha", "beta", "kappa"}
    if unknown:
        raise ValueError(f"unscented: unknown keys {sorted(unknown)}; use alpha, beta, kappa or transition/observation dicts")
    return unscented


def project(
    fn: Callable | object,
    mean: Tensor,
    cov: Tensor,
    t: int,
    kind: str,
    noise_cov: Tensor | None = None,
    takes_time: bool = False,
    unscented: dict | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Moments of ``fn(x) + noise`` for ``x ~ N(mean, cov)``.

    Args:
        fn: a callable ``f(x)`` / ``f(x, t)`` batched over leading dims, or a ``MultiOutputGP``.
        mean: ``(d,)``.
        cov: ``(d, d)``.
        t: time index passed to ``fn`` when ``takes_time``.
        kind: one of :data:`PROJECTIONS`.
        noise_cov: additive noise covariance ``(e, e)`` (or ``None``).
        takes_time: whether a callable ``fn`` takes ``t`` as its second argument.
        unscented: keyword arguments ``alpha``, ``beta``, ``kappa`` of the unscented transform.

    Returns:
        ``(mu_a (e,), S_a (e, e), C (d, e))``.
    """
    gp = is_gp(fn)
    if kind == "moment_matching" and not gp:
        kind = "unscented"
    if kind == "moment_matching":
        mu, S, C = fn.predict_moments(mean, cov)
    elif kind == "linearization":
        if gp:
            mu, J, var = fn.linearize(mean)
            S = J @ cov @ J.transpose(-1, -2) + torch.diag_embed(var)
        else:

            def f(x: Tensor) -> Tensor:
                return fn(x, t) if takes_time else fn(x)

            mu = f(mean)
            J = torch.autograd.functional.jacobian(f, mean, create_graph=torch.is_grad_enabled(), vectorize=True)
            S = J @ cov @ J.transpose(-1, -2)
        C = cov @ J.transpose(-1, -2)
    elif kind == "unscented":
        gp_var = []

        def values(points: Tensor) -> Tensor:
            if gp:
                mu, var = fn.predict(points)
                gp_var.append(var)
                return mu
            return fn(points, t) if takes_time else fn(points)

        mu, S, C = unscented_moments(values, mean, cov, **(unscented or {}))
        if gp:
            _, wm, _ = sigma_points(mean, cov, **(unscented or {}))
            S = S + torch.diag_embed(wm @ gp_var[0])
    else:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
    if noise_cov is not None:
        S = S + noise_cov
    return mu, (S + S.transpose(-1, -2)) / 2, C
