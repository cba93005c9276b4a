r"""Gaussian projections: the moments of :math:`a = f(x, t) + \mathrm{noise}` for :math:`x \sim \mathcal N(m, P)`.

See ``docs/math/ep.md#gaussian-projections``.

Every Gaussian filter, smoother and EP update in pyro_smc reduces a nonlinear map to three
moments, the mean :math:`\mu_a`, covariance :math:`S_a` and input-output covariance :math:`C = \operatorname{Cov}[x, a]`
of :math:`a` under a Gaussian :math:`x`, and then treats the map as the implicit linear model
:math:`a = J x + c + \epsilon` with :math:`J = C^\top P^{-1}`, :math:`c = \mu_a - J m` and
:math:`\operatorname{Cov}[\epsilon] = S_a - J P J^\top`. A projection is a strategy object, a :class:`Projection`, that
says how to get the moments:

* :class:`Linearization` (EKF/EKS; GP-EKS for GPs): :math:`J = \partial f / \partial x` at :math:`m` by autograd (the GP
  posterior-mean Jacobian), :math:`\mu_a = f(m)`, :math:`S_a = J P J^\top` (plus the GP variance at :math:`m`).
* :class:`Unscented` (UKF/URTSS): sigma points through ``f``; for a GP the mean predictive
  variance over the sigma points is added. Settings per factor:
  ``Unscented(kappa=3.0, observation=dict(kappa=2.0))``.
* :class:`MomentMatching` (GP-ADF/GP-RTSS/GPADS): the exact moments of an SE-ARD GP at a
  Gaussian input. A plain callable has no exact moments; it falls back to ``Unscented()`` (or
  the ``fallback=`` given).

A new projection is a subclass that implements :meth:`Projection.map_moments`; the engines
(:class:`pyro_smc.EPSmoother`, :func:`pyro_smc.infer.gaussian_filter`, ...) take it through
``projection=`` unchanged. The names ``"linearization"``, ``"unscented"`` and
``"moment_matching"`` stay accepted and mean the default objects (:func:`as_projection`).

``fn`` is what a :class:`~pyro_smc.models.protocol.GaussianStateSpaceModel` exposes as
``transition_fn``/``observation_fn``: a callable ``fn(x, t)`` batched over the leading dims of
``x``, or a GP posterior (``predict``, ``predict_moments``, ``linearize``).

Example:
    >>> import torch
    >>> from pyro_smc.infer import Linearization
    >>> m, P = torch.zeros(1, dtype=torch.float64), torch.eye(1, dtype=torch.float64)
    >>> mu, S, C = Linearization().moments(lambda x, t: 2 * x, m, P, 0, noise_cov=0.5 * P)
    >>> S.item(), C.item()
    (4.5, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pyro_smc.models.nonlinear_gaussian import is_gp, is_time_invariant
from pyro_smc.ops.unscented import sigma_points, unscented_moments

__all__ = ["PROJECTIONS", "Linearization", "MomentMatching", "Projection", "Unscented", "as_projection", "project"]

PROJECTIONS = ("moment_matching", "linearization", "unscented")
_UT_KEYS = ("alpha", "beta", "kappa")


class Projection:
    """How a Gaussian engine gets the moments of a map at a Gaussian input (the base class).

    Subclasses implement :meth:`map_moments`; :meth:`for_factor` lets a projection use different
    settings for the transition and the observation (the default: the same object for both).

    Example:
        A projection that knows the exact moments of the linear map ``fn(x, t) = 2 x``:

        >>> import torch
        >>> from pyro_smc.infer import Projection
        >>> class Doubling(Projection):
        ...     def map_moments(self, fn, mean, cov, t):
        ...         return 2 * mean, 4 * cov, 2 * cov          # mu (e,), S (e, e), C (d, e)
        >>> mu, S, C = Doubling().moments(
        ...     None, torch.zeros(1), torch.eye(1), 0, noise_cov=torch.eye(1)
        ... )
        >>> S                                                  # 4 P + noise
        tensor([[5.]])
    """

    def map_moments(self, fn, mean: Tensor, cov: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        r"""Moments of ``fn(x, t)`` (no noise) for :math:`x \sim \mathcal N(\mathtt{mean}, \mathtt{cov})`.

        Args:
            fn: a callable ``fn(x, t)`` batched over the leading dims of ``x``, or a GP posterior.
            mean: ``(d,)``.
            cov: ``(d, d)``.
            t: the time index passed to a callable.

        Returns:
            ``(mu (e,), S (e, e), C (d, e))``.
        """
        raise NotImplementedError

    def moments(self, fn, mean: Tensor, cov: Tensor, t: int, noise_cov: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        r"""Moments of ``fn(x, t) + noise`` with :math:`\mathrm{noise} \sim \mathcal N(0, \mathtt{noise\_cov})` (``None``: no noise).

        Returns:
            ``(mu_a (e,), S_a (e, e) symmetrised, C (d, e))``.
        """
        return _with_noise(*self.map_moments(fn, mean, cov, t), noise_cov)

    def map_moments_batch(self, fn, mean: Tensor, cov: Tensor, ts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`map_moments` at a batch of Gaussians, ``mean`` ``(B, d)`` and ``cov``
        ``(B, d, d)``, member ``b`` at time ``ts[b]``; returns ``(mu (B, e), S (B, e, e), C (B, d, e))``.

        The default calls :meth:`map_moments` once per member, so every subclass works; the
        built-in projections override it with one batched evaluation (the parallel EP schedule
        projects all ``T`` factors at once).
        """
        parts = [self.map_moments(fn, mean[b], cov[b], int(t)) for b, t in enumerate(ts)]
        return tuple(torch.stack(column) for column in zip(*parts))

    def moments_batch(self, fn, mean: Tensor, cov: Tensor, ts: Sequence[int], noise_cov: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`moments` at a batch of Gaussians (see :meth:`map_moments_batch`).

        Example:
            >>> import torch
            >>> from pyro_smc.infer import Unscented
            >>> means, covs = (
            ...     torch.randn(4, 2, dtype=torch.float64),
            ...     torch.eye(2, dtype=torch.float64).expand(4, 2, 2),
            ... )
            >>> fn = lambda x, t: torch.sin(x) + t
            >>> batched = Unscented().moments_batch(fn, means, covs, range(4))
            >>> one = Unscented().moments(fn, means[3], covs[3], 3)
            >>> all(torch.allclose(b[3], o) for b, o in zip(batched, one))
            True
        """
        return _with_noise(*self.map_moments_batch(fn, mean, cov, ts), noise_cov)

    def for_factor(self, factor: str) -> Projection:
        """The projection to use for ``factor`` (``"transition"`` or ``"observation"``)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Linearization(Projection):
    r"""First-order Taylor expansion at the mean (EKF/EKS; GP-EKF/GP-EKS for a GP).

    ``map_moments`` returns :math:`\mu = f(m)` ``(e,)``, :math:`S = J P J^\top` ``(e, e)`` (plus the GP
    variance at :math:`m`) and :math:`C = P J^\top` ``(d, e)``, with :math:`J = \partial f / \partial x` at :math:`m` by autograd.

    Example:
        For ``f(x) = x^2`` at ``m = 1`` the Jacobian is 2, so ``S = 4 P``:

        >>> import torch
        >>> from pyro_smc.infer import Linearization
        >>> mu, S, C = Linearization().map_moments(
        ...     lambda x, t: x**2, torch.ones(1), 0.5 * torch.eye(1), 0
        ... )
        >>> mu.item(), S.item(), C.item()
        (1.0, 2.0, 1.0)
    """

    def map_moments(self, fn, mean: Tensor, cov: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, covariance and cross-covariance of ``fn`` at ``N(m, P)`` by its first-order Taylor expansion at ``m`` (see :meth:`Projection.map_moments`)."""
        if is_gp(fn):
            mu, J, var = fn.linearize(mean)
            S = J @ cov @ J.transpose(-1, -2) + torch.diag_embed(var)
        else:
            mu, J = _value_and_jacobian(fn, mean, t)
            S = J @ cov @ J.transpose(-1, -2)
        return mu, S, cov @ J.transpose(-1, -2)

    def map_moments_batch(self, fn, mean: Tensor, cov: Tensor, ts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`map_moments` for a batch of Gaussians at once."""
        if is_gp(fn) or is_time_invariant(fn):
            return self.map_moments(fn, mean, cov, 0)  # one call on the (B, e, d) copies
        return super().map_moments_batch(fn, mean, cov, ts)


def _value_and_jacobian(fn, mean: Tensor, t: int) -> tuple[Tensor, Tensor]:
    # f(m) (..., e) and J = df/dx at m (..., e, d) from one batched call and one backward pass:
    # f is evaluated at e copies m + z_i of the mean (fn is batched over leading dims), and the
    # gradient of sum_i f_i(m + z_i) in z_i is row i of J. Cheaper than
    # torch.autograd.functional.jacobian, which vmaps e backward passes. J is always taken at
    # the detached mean, so that the backward pass walks this call's graph only, not every
    # earlier step's (which made a long run quadratic in T). When f(m) is differentiable the
    # graph of that pass is kept (create_graph: dJ/dtheta flows), and dJ/dm is put back by
    # _JacobianInMean.
    mu = fn(mean, t)
    create_graph = torch.is_grad_enabled() and mu.requires_grad
    J = _jacobian_at(fn, mean.detach(), t, mu.shape[-1], create_graph)
    if create_graph and mean.requires_grad:
        J = J + _JacobianInMean.apply(mean, fn, t, mu.shape[-1])
    return mu, J


def _jacobian_at(fn, at: Tensor, t: int, e: int, create_graph: bool) -> Tensor:
    # J (..., e, d) at ``at`` by the copies m + z_i (see _value_and_jacobian).
    with torch.enable_grad():
        z = at.new_zeros(at.shape[:-1] + (e, at.shape[-1]), requires_grad=True)
        copies = fn(at.unsqueeze(-2) + z, t)  # (..., e, e): row i at copy i
        total = copies.diagonal(dim1=-2, dim2=-1).sum()
        # An explicit seed: autograd's default one tests the output's size as a tensor, which a
        # recorded step (recorded.py) would see as a data-dependent branch.
        (J,) = torch.autograd.grad(total, z, grad_outputs=torch.ones_like(total), create_graph=create_graph)
    return J


class _JacobianInMean(torch.autograd.Function):
    # Zero in value; its backward is the vector-Jacobian product of m -> J(m) at the step's
    # mean, from J recomputed at a fresh leaf: the dependence of the Jacobian on the mean, without
    # a graph that reaches back through the earlier steps. First derivatives only: the graph of
    # dJ/dtheta is taken at the detached mean, so a second derivative would miss the mixed term
    # d2J/dtheta dm: a backward pass that builds a graph (create_graph) raises rather than be wrong.

    @staticmethod
    def forward(ctx, mean: Tensor, fn, t: int, e: int) -> Tensor:
        ctx.save_for_backward(mean)
        ctx.fn, ctx.t, ctx.e = fn, t, e
        return mean.new_zeros(mean.shape[:-1] + (e, mean.shape[-1]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linearisation (Linearization, extended_rts_smoother, EP with projection='linearization') is differentiable once: "
                "a backward pass with create_graph=True through it is not supported; use finite differences of the gradient, "
                "or the unscented projection, for second derivatives"
            )
        (mean,) = ctx.saved_tensors
        with torch.enable_grad():
            at = mean.detach().requires_grad_()
            J = _jacobian_at(ctx.fn, at, ctx.t, ctx.e, True)
            # A linear map's Jacobian is a constant, with no graph to differentiate.
            (g,) = torch.autograd.grad(J, at, grad, allow_unused=True) if J.requires_grad else (None,)
        return (torch.zeros_like(mean) if g is None else g), None, None, None


class Unscented(Projection):
    """The unscented transform (UKF/URTSS).

    Args:
        alpha, beta, kappa: sigma-point settings for both factors (``None``: the defaults of
            :func:`pyro_smc.ops.unscented.sigma_points`, ``1``, ``0`` and ``max(3 - d, 0)``).
        transition, observation: dicts of ``alpha``/``beta``/``kappa`` that override the shared
            settings for that factor (Kamthe et al. use ``kappa = 3`` for the dynamics and
            ``kappa = 2`` for the measurement).

    ``map_moments`` returns ``mu (e,)``, ``S (e, e)`` and ``C (d, e)`` from the sigma points.

    Raises:
        ValueError: a per-factor dict has a key other than ``alpha``, ``beta`` or ``kappa``.

    Example:
        The transform is exact for a linear map, and ``for_factor`` applies the overrides:

        >>> import torch
        >>> from pyro_smc.infer import Unscented
        >>> ut = Unscented(kappa=3.0, observation=dict(kappa=2.0))
        >>> mu, S, C = ut.map_moments(lambda x, t: 2 * x, torch.zeros(2), torch.eye(2), 0)
        >>> torch.allclose(S, 4 * torch.eye(2)), torch.allclose(C, 2 * torch.eye(2))
        (True, True)
        >>> ut.for_factor("observation")
        Unscented(kappa=2.0)
    """

    def __init__(
        self, alpha: float | None = None, beta: float | None = None, kappa: float | None = None, *, transition: dict | None = None, observation: dict | None = None
    ):
        self.settings = {k: v for k, v in zip(_UT_KEYS, (alpha, beta, kappa)) if v is not None}
        self.per_factor = {}
        for name, overrides in (("transition", transition), ("observation", observation)):
            overrides = dict(overrides or {})
            unknown = set(overrides) - set(_UT_KEYS)
            if unknown:
                raise ValueError(f"Unscented({name}=...): unknown keys {sorted(unknown)}; use alpha, beta, kappa")
            self.per_factor[name] = overrides

    def for_factor(self, factor: str) -> Unscented:
        """This projection, or one with the settings ``per_factor`` gives for ``factor``."""
        if not self.per_factor.get(factor):
            return self
        return Unscented(**{**self.settings, **self.per_factor[factor]})

    def map_moments_batch(self, fn, mean: Tensor, cov: Tensor, ts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`map_moments` for a batch of Gaussians at once."""
        if is_gp(fn) or is_time_invariant(fn):
            return self.map_moments(fn, mean, cov, 0)  # one call on the (B, 2d + 1, d) sigma points
        ts = [int(t) for t in ts]
        return unscented_moments(lambda points: torch.stack([fn(p, t) for p, t in zip(points, ts)]), mean, cov, **self.settings)

    def moments(self, fn, mean: Tensor, cov: Tensor, t: int, noise_cov: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        r"""Moments of ``fn(x, t) + noise`` at :math:`x \sim \mathcal N(\mathtt{mean}, \mathtt{cov})`, :math:`\mathrm{noise} \sim \mathcal N(0, \mathtt{noise\_cov})` (see :meth:`Projection.moments`)."""
        # map_moments' S is already symmetric (and so is S + noise_cov): _with_noise's second
        # symmetrisation would return the same bits, so it is skipped on this per-step path; for a
        # callable the transform adds the noise itself, fused with its symmetrisation.
        if not is_gp(fn):
            return unscented_moments(lambda x: fn(x, t), mean, cov, **self.settings, noise_cov=noise_cov)
        mu, S, C = self.map_moments(fn, mean, cov, t)
        return mu, S if noise_cov is None else S + noise_cov, C

    def map_moments(self, fn, mean: Tensor, cov: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, covariance and cross-covariance of ``fn`` at ``N(m, P)`` by the unscented transform (see :meth:`Projection.map_moments`)."""
        if not is_gp(fn):
            return unscented_moments(lambda x: fn(x, t), mean, cov, **self.settings)
        gp_var = []

        def values(points: Tensor) -> Tensor:
            mu, var = fn.predict(points)
            gp_var.append(var)
            return mu

        mu, S, C = unscented_moments(values, mean, cov, **self.settings)
        _, wm, _ = sigma_points(mean, cov, **self.settings)
        return mu, S + torch.diag_embed(wm @ gp_var[0]), C

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.settings.items()] + [f"{k}={v!r}" for k, v in self.per_factor.items() if v]
        return f"Unscented({', '.join(args)})"


class MomentMatching(Projection):
    """Exact moments of a GP at a Gaussian input (GP-ADF/GP-RTSS); ``fallback`` (default
    :class:`Unscented`) for a plain callable, which has no exact moments.

    Args:
        fallback: the projection used for a callable that is not a GP posterior.

    ``map_moments`` returns ``mu (e,)``, ``S (e, e)`` and ``C (d, e)``.

    Example:
        A plain callable gets the fallback's moments:

        >>> import torch
        >>> from pyro_smc.infer import MomentMatching, Unscented
        >>> args = (lambda x, t: torch.sin(x), torch.zeros(1), torch.eye(1), 0)
        >>> mm = MomentMatching()
        >>> mm
        MomentMatching(fallback=Unscented())
        >>> all(
        ...     torch.equal(a, b)
        ...     for a, b in zip(mm.map_moments(*args), Unscented().map_moments(*args))
        ... )
        True
    """

    def __init__(self, fallback: Projection | None = None):
        self.fallback = Unscented() if fallback is None else fallback

    def for_factor(self, factor: str) -> MomentMatching:
        """The exact moments for a GP factor, the fallback projection for any other."""
        fallback = self.fallback.for_factor(factor)
        return self if fallback is self.fallback else MomentMatching(fallback)

    def map_moments(self, fn, mean: Tensor, cov: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Exact moments of a GP map at ``N(m, P)`` (see :meth:`Projection.map_moments`)."""
        if is_gp(fn):
            return fn.predict_moments(mean, cov)
        return self.fallback.map_moments(fn, mean, cov, t)

    def map_moments_batch(self, fn, mean: Tensor, cov: Tensor, ts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`map_moments` for a batch of Gaussians at once."""
        if is_gp(fn):
            return fn.predict_moments(mean, cov)
        return self.fallback.map_moments_batch(fn, mean, cov, ts)

    def __repr__(self) -> str:
        return f"MomentMatching(fallback={self.fallback!r})"


def _with_noise(mu: Tensor, S: Tensor, C: Tensor, noise_cov: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    # The moments of fn(x) + noise: S gains the noise covariance and is symmetrised.
    if noise_cov is not None:
        S = S + noise_cov
    return mu, (S + S.transpose(-1, -2)) / 2, C


def as_projection(projection: Projection | str) -> Projection:
    """The :class:`Projection` for ``projection``, an object or one of :data:`PROJECTIONS`.

    Example:
        >>> as_projection("moment_matching")
        MomentMatching(fallback=Unscented())
    """
    if isinstance(projection, Projection):
        return projection
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be a Projection or one of {PROJECTIONS}, got {projection!r}")
    return _default(projection, Unscented())


def _default(name: str, ut: Unscented) -> Projection:
    # The object a name stands for; ``ut`` is the sigma-point setting of the unscented ones.
    return {"linearization": Linearization(), "unscented": ut, "moment_matching": MomentMatching(ut)}[name]


def project(
    fn: Callable | object,
    mean: Tensor,
    cov: Tensor,
    t: int,
    kind: Projection | str,
    noise_cov: Tensor | None = None,
    takes_time: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Moments of ``fn(x) + noise`` for :math:`x \sim \mathcal N(\mathtt{mean}, \mathtt{cov})`: the functional form of
    :meth:`Projection.moments`, kept for existing callers.

    Args:
        fn: a callable ``f(x)`` (``f(x, t)`` when ``takes_time``) or a ``MultiOutputGP``.
        mean: ``(d,)``.
        cov: ``(d, d)``.
        t: time index passed to ``fn`` when ``takes_time``.
        kind: a :class:`Projection` or one of :data:`PROJECTIONS`.
        noise_cov: additive noise covariance ``(e, e)`` (or ``None``).
        takes_time: whether a callable ``fn`` takes ``t`` as its second argument.

    Returns:
        ``(mu_a (e,), S_a (e, e), C (d, e))``.
    """
    if isinstance(kind, Projection):
        strategy = kind
    elif kind in PROJECTIONS:
        strategy = _default(kind, Unscented())
    else:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
    if not is_gp(fn) and not takes_time:
        fn = (lambda f: lambda x, t: f(x))(fn)
    return strategy.moments(fn, mean, cov, t, noise_cov)
