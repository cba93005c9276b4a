r"""The iterated extended RTS smoother (IEKS): Gauss-Newton on the whole trajectory.

See ``docs/engines/ep.md#high-dimensional-ep-lorenz-96``.

The extended smoother linearises each map at the filter's own means, which are poor where the
filter is poor. The iterated smoother (Bell, 1994) instead linearises every map at a fixed
*nominal* trajectory :math:`\bar x_{0:T-1}`, the previous iteration's smoothed means:

.. math::

    f(x_t) \approx f(\bar x_t) + F_t (x_t - \bar x_t), \qquad
    g(x_t) \approx g(\bar x_t) + G_t (x_t - \bar x_t),

with :math:`F_t`, :math:`G_t` the Jacobians at :math:`\bar x_t`, and runs the Kalman (RTS)
smoother of that linear-Gaussian model. The first iteration is the extended smoother; each
later one is a Gauss-Newton step on :math:`-\log p(x_{0:T-1}, y)`, so a converged IEKS mean is a
stationary point of the joint density (a MAP trajectory), and on a linear model every iteration
is the Kalman smoother. Unlike EP, the covariances come only from the last linearisation: the
iteration refines the means, not the spread.

:class:`NominalLinearization` is the projection of one iteration: the Taylor expansion at
``nominal[t]`` whatever the Gaussian it is evaluated at, so that the filter and smoother of
:func:`~pyro_smc.infer.gaussian_smoother` and its variants compute the linear model's Kalman smoother unchanged.

Example:
    >>> import torch
    >>> from pyro_smc.infer.gaussian.iterated import iterated_extended_rts_smoother
    >>> from pyro_smc.models import NonlinearGaussianSSM
    >>> one = torch.ones(1, 1, dtype=torch.float64)
    >>> ssm = NonlinearGaussianSSM(
    ...     lambda x: 0.9 * x + 0.2 * torch.sin(x), 0.1 * one,
    ...     lambda x: x**2 / 5, 0.1 * one,
    ...     torch.ones(1, dtype=torch.float64), one,
    ... )
    >>> _, ys = ssm.simulate(30, generator=torch.Generator().manual_seed(0))
    >>> out = iterated_extended_rts_smoother(ssm, ys, num_iter=10)
    >>> out.means.shape, out.first_sweep is not None, len(out.history) <= 10
    (torch.Size([30, 1]), True, True)

References:
    Bell (1994). The iterated Kalman smoother as a Gauss-Newton method. SIAM J. Optim. 4(3).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.infer.gaussian.projections import Projection, _value_and_jacobian
from pyro_smc.infer.gaussian.result import EPIteration, GaussianSmootherResult
from pyro_smc.infer.gaussian.smoothers import extended_rts_smoother, gaussian_smoother
from pyro_smc.models.nonlinear_gaussian import is_gp
from pyro_smc.models.protocol import GaussianStateSpaceModel
from pyro_smc.ops.gaussian import moment_change, moment_change_floor

__all__ = ["NominalLinearization", "iterated_extended_rts_smoother"]


class NominalLinearization(Projection):
    r"""First-order Taylor expansion at a fixed nominal trajectory, not at the input's mean.

    At time ``t`` the map is replaced by :math:`a \approx f(\bar x_t) + J (x - \bar x_t)` with
    :math:`J = \partial f / \partial x` at :math:`\bar x_t` = ``nominal[t]``, so for
    :math:`x \sim \mathcal N(m, P)` ``map_moments`` returns :math:`\mu = f(\bar x_t) + J (m - \bar x_t)`
    ``(e,)``, :math:`S = J P J^\top` ``(e, e)`` (plus a GP map's variance at :math:`\bar x_t`) and
    :math:`C = P J^\top` ``(d, e)``. With ``nominal[t]`` equal to ``m`` it is :class:`Linearization`.

    Args:
        nominal: ``(T, d)`` the linearisation point of each time step (the transition at ``t``,
            which maps :math:`x_t` to the mean of :math:`x_{t+1}`, and the observation at ``t``
            are both expanded at ``nominal[t]``).

    Raises:
        ValueError: ``nominal`` is not a ``(T, d)`` tensor of finite values; (from
            ``map_moments``) a time step outside ``0 .. T-1``.

    Example:
        At the nominal point itself it is the extended (Taylor) projection:

        >>> import torch
        >>> from pyro_smc.infer import Linearization
        >>> from pyro_smc.infer.gaussian.iterated import NominalLinearization
        >>> fn, P = (lambda x, t: torch.sin(x)), 0.3 * torch.eye(2)
        >>> m = torch.tensor([0.5, -1.0])
        >>> here = NominalLinearization(m.expand(4, 2)).map_moments(fn, m, P, 3)
        >>> taylor = Linearization().map_moments(fn, m, P, 3)
        >>> all(torch.allclose(a, b) for a, b in zip(here, taylor))
        True
    """

    def __init__(self, nominal: Tensor):
        if not isinstance(nominal, Tensor) or nominal.dim() != 2:
            raise ValueError(f"nominal must be a (T, d) tensor, got {getattr(nominal, 'shape', type(nominal).__name__)}")
        if not bool(torch.isfinite(nominal).all()):
            raise ValueError("nominal has non-finite entries")
        self.nominal = nominal

    def map_moments(self, fn, mean: Tensor, cov: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Moments of the map's Taylor expansion at ``nominal[t]`` for ``N(mean, cov)`` (see :meth:`Projection.map_moments`)."""
        if not 0 <= int(t) < self.nominal.shape[0]:
            raise ValueError(f"NominalLinearization: time step {t} is outside the nominal trajectory (0 .. {self.nominal.shape[0] - 1})")
        at = self.nominal[int(t)]
        if is_gp(fn):
            value, J, var = fn.linearize(at)
            extra = torch.diag_embed(var)
        else:
            value, J = _value_and_jacobian(fn, at, t)
            extra = None
        mu = value + (J @ (mean - at).unsqueeze(-1)).squeeze(-1)
        S = J @ cov @ J.transpose(-1, -2)
        return mu, S if extra is None else S + extra, cov @ J.transpose(-1, -2)

    def __repr__(self) -> str:
        return f"NominalLinearization(T={self.nominal.shape[0]})"


def iterated_extended_rts_smoother(ssm: GaussianStateSpaceModel, observations: Tensor, num_iter: int = 10, tol: float = 1e-6) -> GaussianSmootherResult:
    r"""The iterated extended RTS smoother (Bell, 1994): the extended smoother, then up to
    ``num_iter - 1`` Kalman smoothers of the model linearised at the previous smoothed means.

    Args:
        ssm: a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel` (state dim ``d``).
        observations: ``(T, e)``, NaN for missing entries (the rule of the Gaussian smoothers).
        num_iter: the most smoother passes, the extended smoother included (1: the EKS).
        tol: stop when no smoothed mean or covariance entry changed by more than this, in units
            of the marginal's spread (:func:`~pyro_smc.ops.gaussian.moment_change`): the same in any
            units of the state.

    Returns:
        :class:`~pyro_smc.infer.gaussian.result.GaussianSmootherResult`: the last pass's
        ``means (T, d)`` and ``covariances (T, d, d)``, ``first_sweep`` (the extended smoother),
        ``history`` (one :class:`~pyro_smc.infer.gaussian.result.EPIteration` per pass: its
        largest change, ``inf`` for the first, and 0 skipped), ``converged`` (stopped on
        ``tol``; ``True`` for ``num_iter=1``), and the last pass's filter evidence
        ``log_evidence`` (the exact evidence of the linearised model).

    Raises:
        ValueError: ``num_iter < 1`` or ``tol <= 0``, and the errors of
            :func:`~pyro_smc.infer.gaussian_smoother`.

    Example:
        On a linear-Gaussian model every pass is the Kalman smoother:

        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2, dtype=torch.float64)
        >>> zero = torch.zeros(2, dtype=torch.float64)
        >>> ssm = LinearGaussianSSM(0.9 * eye, eye, eye, eye, zero, eye)
        >>> _, ys = ssm.simulate(6)
        >>> out = iterated_extended_rts_smoother(ssm, ys)
        >>> kalman = ssm.rts_smoother(ys)
        >>> out.converged, len(out.history), torch.allclose(out.means, kalman.means)
        (True, 2, True)
    """
    if int(num_iter) != num_iter or num_iter < 1:
        raise ValueError(f"num_iter must be an integer >= 1, got {num_iter!r}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}")
    first = result = extended_rts_smoother(ssm, observations)
    history, converged = [EPIteration(float("inf"), 0)], int(num_iter) == 1
    for _ in range(int(num_iter) - 1):
        new = gaussian_smoother(ssm, observations, NominalLinearization(result.means.detach()))
        change = moment_change(new.means, new.covariances, result.means, result.covariances)
        history.append(EPIteration(change, 0))
        result = new
        if change <= max(tol, moment_change_floor(result.means.dtype)):
            converged = True
            break
    return GaussianSmootherResult(
        result.means,
        result.covariances,
        first_sweep=first,
        history=tuple(history),
        converged=converged,
        log_evidence=result.log_evidence,
        log_evidence_increments=result.log_evidence_increments,
    )
