r"""Independent SE-ARD Gaussian processes, one per output, with exact moments at Gaussian inputs.

:class:`MultiOutputGP` holds ``E`` GP regressions :math:`y_a = f_a(x) + \mathcal N(0, \sigma_a^2)` on shared
inputs ``X`` ``(n, D)``, each with its own ARD lengthscales :math:`l_a` ``(D,)``, signal variance
:math:`\alpha_a^2` and noise :math:`\sigma_a^2` (zero prior mean, as ``pyro.contrib.gp.models.GPRegression``).
Hyperparameters are ``PyroParam``\ s constrained positive (optimised in log space) and named as in
``pyro.contrib.gp``: ``lengthscale`` ``(E, D)``, ``variance`` ``(E,)``, ``noise`` ``(E,)``.
:meth:`~MultiOutputGP.fit` maximises the exact log marginal likelihood of all ``E`` GPs at once.

Predictions (:meth:`~MultiOutputGP.predict`, :meth:`~MultiOutputGP.predict_moments`,
:meth:`~MultiOutputGP.linearize`) are of the latent ``f``; ``noisy=True`` adds :math:`\sigma_a^2`. They
are differentiable in the inputs ``x``, ``mean`` and ``cov``, in the hyperparameters and in the
data ``X``, ``Y`` (when made parameters, e.g. ``gp.X = torch.nn.Parameter(X)``), so the
hyperparameters can be fitted by maximising an evidence computed from the predictions (the
``log_evidence`` of :func:`~pyro_smc.infer.gp_rtss` or of :class:`~pyro_smc.EPSmoother`). The
posterior (Cholesky-based ``beta`` and :math:`(K + \sigma^2 I)^{-1}`) is computed with its autograd
graph whenever gradients are enabled and one of its inputs requires grad; otherwise it is
computed without a graph and cached until the hyperparameters or data change. Inside
:meth:`~MultiOutputGP.pinned_posterior` (or :func:`pinned_posteriors`) it is computed once and
shared by every prediction, which is how the Gaussian smoothers use it.
See ``docs/math/ep.md#gp-regression-with-se-ard-kernels`` and ``docs/math/ep.md#exact-moments-of-a-gp-at-a-gaussian-input``.

Example:
    >>> import torch
    >>> from pyro_smc.gp import MultiOutputGP
    >>> X = torch.linspace(-3, 3, 40, dtype=torch.float64).unsqueeze(-1)
    >>> Y = torch.cat([X.sin(), X.cos()], -1)
    >>> gp = MultiOutputGP(X, Y, noise=1e-4)
    >>> losses = gp.fit(num_steps=50, optimizer="lbfgs")
    >>> x = torch.tensor([[0.5]], dtype=torch.float64)
    >>> mean, var = gp.predict(x)
    >>> torch.allclose(mean, torch.cat([x.sin(), x.cos()], -1), atol=1e-2)
    True
    >>> M, V, C = gp.predict_moments(
    ...     torch.zeros(1, dtype=torch.float64), 0.01 * torch.eye(1, dtype=torch.float64)
    ... )
    >>> M.shape, V.shape, C.shape
    (torch.Size([2]), torch.Size([2, 2]), torch.Size([1, 2]))
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch
from pyro.nn import PyroModule, PyroParam
from torch import Tensor
from torch.distributions import constraints

from pyro_smc.models.nonlinear_gaussian import is_gp
from pyro_smc.ops.gp_moments import se_ard_kernel, se_ard_linearize, se_ard_moments, se_ard_predict

__all__ = ["MultiOutputGP", "pinned_posteriors"]


# Below this ratio of noise to signal variance a float32 posterior is untrustworthy (measured on 40
# inputs: at a ratio of 0.2 the float32 predictive variance is within 1e-4 of float64's (relative),
# at 2e-3 it is 18% off, at 2e-5 600 times too large).
_FLOAT32_MIN_NOISE_RATIO = 1e-2


class _Posterior(NamedTuple):
    X: Tensor  # (n, D)
    beta: Tensor  # (E, n)  (K_a + s_a^2 I)^{-1} y_a
    gram_inv: Tensor  # (E, n, n)
    lengthscale: Tensor  # (E, D)
    variance: Tensor  # (E,)
    noise: Tensor  # (E,)


def _finite_matrix(name: str, value: Tensor) -> None:
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} has non-finite entries (NaN or inf)")


def _hyperparameter(name: str, value: object, shape: tuple[int, ...], like: Tensor) -> Tensor:
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device).detach()
    try:
        value = value.expand(shape).clone()
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to shape {shape}, got {tuple(value.shape)}") from None
    if not torch.isfinite(value).all() or (value <= 0).any():
        raise ValueError(f"{name} must be positive and finite")
    return value


class MultiOutputGP(PyroModule):
    r"""``E`` independent SE-ARD GP regressions on shared inputs.

    Args:
        X: training inputs ``(n, D)``.
        Y: training targets ``(n, E)`` (or ``(n,)`` for one output).
        lengthscale: ARD lengthscales, broadcastable to ``(E, D)``; default: the standard
            deviation of each input dimension.
        variance: signal variances :math:`\alpha_a^2`, broadcastable to ``(E,)``; default: the variance
            of each output.
        noise: likelihood variances :math:`\sigma_a^2`, broadcastable to ``(E,)``; default:
            ``0.1 * variance``.
        jitter: added to the Gram diagonal with the noise, as in ``pyro.contrib.gp``.

    ``predict(x)`` with ``x`` ``(m, D)`` returns the predictive means and variances, each
    ``(m, E)``; ``predict_moments(mean (D,), cov (D, D))`` returns ``(M (E,), V (E, E),
    C (D, E))`` at a Gaussian input.

    All predictions are differentiable in the hyperparameters (through their unconstrained
    parameters) and in ``X`` and ``Y`` when these are made parameters (``gp.X =
    torch.nn.Parameter(X)`` or a ``PyroParam``), as well as in ``x``, ``mean`` and ``cov``.
    With gradients enabled and such an input requiring grad, every call rebuilds the posterior
    with its graph (and caches nothing); a long pass of predictions should run inside
    :meth:`pinned_posterior` to build it once. Under ``torch.no_grad()``, or when nothing
    requires grad, the posterior is computed without a graph and cached.

    Raises:
        ValueError: ``X`` is not ``(n, D)``, ``Y`` does not match it, an entry is not finite,
            ``jitter < 0``, or a hyperparameter has the wrong shape or is not positive.

    Example:
        With little noise the posterior mean interpolates the training targets:

        >>> import torch
        >>> from pyro_smc.gp import MultiOutputGP
        >>> X = torch.linspace(-2, 2, 10).unsqueeze(-1)                  # (n, D)
        >>> Y = torch.cat([X.sin(), X.cos()], -1)                        # (n, E)
        >>> gp = MultiOutputGP(X, Y, noise=1e-4)
        >>> mean, var = gp.predict(X[:3])
        >>> mean.shape, var.shape                                        # (m, E), (m, E)
        (torch.Size([3, 2]), torch.Size([3, 2]))
        >>> torch.allclose(mean, Y[:3], atol=1e-2)
        True
    """

    def __init__(
        self,
        X: Tensor,
        Y: Tensor,
        lengthscale: Tensor | float | None = None,
        variance: Tensor | float | None = None,
        noise: Tensor | float | None = None,
        jitter: float = 1e-6,
    ):
        super().__init__()
        if not isinstance(X, Tensor) or not X.is_floating_point():
            X = torch.as_tensor(X, dtype=torch.get_default_dtype())
        if X.dim() != 2 or X.shape[0] < 1:
            raise ValueError(f"X must have shape (n, D) with n >= 1, got {tuple(X.shape)}")
        Y = torch.as_tensor(Y, dtype=X.dtype, device=X.device)
        if Y.dim() == 1:
            Y = Y.unsqueeze(-1)
        if Y.dim() != 2 or Y.shape[0] != X.shape[0]:
            raise ValueError(f"Y must have shape ({X.shape[0]}, E) to match X, got {tuple(Y.shape)}")
        _finite_matrix("X", X)
        _finite_matrix("Y", Y)
        if jitter < 0 or not math.isfinite(jitter):
            raise ValueError(f"jitter must be non-negative, got {jitter}")
        self.register_buffer("X", X)
        self.register_buffer("Y", Y)
        self.jitter = float(jitter)
        E, D = Y.shape[1], X.shape[1]

        def data_scale(v: Tensor) -> Tensor:
            return torch.where(v > 0, v, torch.ones_like(v))

        if lengthscale is None:
            lengthscale = data_scale(X.std(0, unbiased=False)).expand(E, D)
        if variance is None:
            variance = data_scale(Y.var(0, unbiased=False))
        self.lengthscale = PyroParam(_hyperparameter("lengthscale", lengthscale, (E, D), X), constraints.positive)
        self.variance = PyroParam(_hyperparameter("variance", variance, (E,), X), constraints.positive)
        if noise is None:
            noise = 0.1 * self.variance.detach()
        self.noise = PyroParam(_hyperparameter("noise", noise, (E,), X), constraints.positive)
        self._cache: tuple[tuple[tuple, Tensor], _Posterior] | None = None  # ((key, Y), posterior)
        self._pinned: _Posterior | None = None

    @property
    def input_dim(self) -> int:
        """``D``."""
        return self.X.shape[1]

    @property
    def output_dim(self) -> int:
        """``E``."""
        return self.Y.shape[1]

    def _gram_cholesky(self, lengthscale: Tensor, variance: Tensor, noise: Tensor) -> Tensor:
        K = se_ard_kernel(self.X, self.X, lengthscale, variance)
        eye = torch.eye(self.X.shape[0], dtype=K.dtype, device=K.device)
        return torch.linalg.cholesky(K + (noise + self.jitter)[:, None, None] * eye)

    def log_marginal_likelihood(self) -> Tensor:
        r"""Exact :math:`\log p(y_a \mid X)` of each output, ``(E,)``; differentiable in the hyperparameters."""
        L = self._gram_cholesky(self.lengthscale, self.variance, self.noise)
        alpha = torch.linalg.solve_triangular(L, self.Y.T.unsqueeze(-1), upper=False).squeeze(-1)
        n = self.X.shape[0]
        log_det_half = torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (alpha * alpha).sum(-1) - log_det_half - 0.5 * n * math.log(2 * math.pi)

    def fit(self, num_steps: int = 200, lr: float | None = None, optimizer: str = "adam") -> list[float]:
        r"""Maximises the summed log marginal likelihood over the (log) hyperparameters.

        Args:
            num_steps: Adam steps, or the maximum number of L-BFGS iterations.
            lr: learning rate (default 0.05 for Adam, 1.0 for L-BFGS with a strong-Wolfe line search).
            optimizer: ``"adam"`` or ``"lbfgs"``.

        Returns:
            The loss :math:`-\sum_a \log p(y_a \mid X)` at every evaluation.
        """
        if optimizer not in ("adam", "lbfgs"):
            raise ValueError(f"optimizer must be 'adam' or 'lbfgs', got {optimizer!r}")
        if num_steps < 0:
            raise ValueError(f"num_steps must be non-negative, got {num_steps}")
        params = list(self.parameters())
        history: list[float] = []

        def closure() -> Tensor:
            opt.zero_grad()
            try:
                loss = -self.log_marginal_likelihood().sum()
            except torch.linalg.LinAlgError:
                # A trial step of the line search left the region where the Gram matrix is
                # numerically PD: report an infinite loss so the search backs off.
                return torch.tensor(math.inf, dtype=self.X.dtype, device=self.X.device)
            loss.backward()
            history.append(loss.item())
            return loss

        saved = [p.detach().clone() for p in params]

        with torch.enable_grad():
            if optimizer == "adam":
                opt = torch.optim.Adam(params, lr=0.05 if lr is None else lr)
                for _ in range(num_steps):
                    closure()
                    opt.step()
            elif num_steps > 0:
                opt = torch.optim.LBFGS(params, lr=1.0 if lr is None else lr, max_iter=num_steps, line_search_fn="strong_wolfe")
                opt.step(closure)
        if not all(bool(torch.isfinite(p).all()) for p in params):
            with torch.no_grad():
                for p, value in zip(params, saved):
                    p.copy_(value)
            self._cache = None
            raise RuntimeError(f"MultiOutputGP.fit: the {optimizer} iterations diverged; hyperparameters restored. Try a smaller lr.")
        self._cache = None
        return history

    def _posterior_needs_graph(self, hyper: tuple[Tensor, Tensor, Tensor]) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (*hyper, self.X, self.Y))

    def _compute_posterior(self, X: Tensor, Y: Tensor, hyper: tuple[Tensor, Tensor, Tensor]) -> _Posterior:
        if X.dtype == torch.float32 and not getattr(self, "_float32_warned", False):
            self._warn_float32(hyper[1].detach(), hyper[2].detach())
        L = self._gram_cholesky(*hyper)
        beta = torch.cholesky_solve(Y.T.unsqueeze(-1), L).squeeze(-1)
        return _Posterior(X, beta, torch.cholesky_inverse(L), *hyper)

    def _warn_float32(self, variance: Tensor, noise: Tensor) -> None:
        # The Gram matrix's condition number grows like n variance / noise; float32 resolves about
        # 1e-7 of it, and the predictive variance, a small difference of two O(variance) terms,
        # loses everything first (noise 1e-5 of the variance: 2.4e-3 for a true 4e-6).
        ratio = float(((noise + self.jitter) / variance).min())
        if ratio < _FLOAT32_MIN_NOISE_RATIO:
            self._float32_warned = True
            warnings.warn(
                f"MultiOutputGP in float32 with a noise of {ratio:.1e} of the signal variance: the Gram matrix is too "
                "ill-conditioned for float32, and the predictive variances and moments can be off by orders of magnitude; "
                "use float64 (MultiOutputGP(X.double(), Y.double(), ...))",
                stacklevel=4,
            )

    def _posterior(self) -> _Posterior:
        pinned = getattr(self, "_pinned", None)
        if pinned is not None:
            return pinned
        hyper = (self.lengthscale, self.variance, self.noise)
        if self._posterior_needs_graph(hyper):
            # Differentiable in the hyperparameters and data: built with its graph and never
            # cached (a cached graph would be backpropagated through twice, or keep stale values).
            return self._compute_posterior(self.X, self.Y, hyper)
        # Cached under the current hyperparameter values and data, compared by value: an address
        # and version counter missed a new Y allocated where a freed one had been (4 stale
        # predictions in 20 reassignments) and writes through ``.data``, which bump no version.
        # The cache holds copies, so that such writes cannot reach the cached posterior either.
        # Comparing costs O(n (D + E)), far below a prediction.
        with torch.no_grad():
            hyper = tuple(h.detach() for h in hyper)
            X, Y = self.X.detach(), self.Y.detach()
            key = (X.dtype, X.device, X.shape, Y.shape, self.jitter)
            if self._cache is not None:
                (old_key, old_y), post = self._cache
                if old_key == key and torch.equal(X, post.X) and torch.equal(Y, old_y) and all(torch.equal(h, c) for h, c in zip(hyper, post[3:])):
                    return post
            X, Y = X.clone(), Y.clone()
            post = self._compute_posterior(X, Y, tuple(h.clone() for h in hyper))
        self._cache = ((key, Y), post)
        return post

    @contextlib.contextmanager
    def pinned_posterior(self) -> Iterator[MultiOutputGP]:
        r"""Within the ``with`` block, every prediction shares one posterior, computed on entry.

        An engine makes two projections per time step and sweep (:math:`2T` per sweep). When the
        posterior carries an autograd graph (gradients enabled and a hyperparameter, ``X`` or
        ``Y`` requiring grad) it is not cached, so without the pin each projection would
        recompute the :math:`n \times n` Cholesky factor and keep its own copy of the graph: ``T`` times
        the time and memory of one. Pinned, the factor is computed once, and its graph is shared
        by all the predictions (so backpropagate through them together, once). The posterior is
        computed with a graph by the same rule as outside the pin, as it stands on entry:
        changing the hyperparameters or data inside the block has no effect until it is left,
        where the pin is dropped. Re-entrant: a nested ``with`` on the same GP reuses the outer
        pin.

        Yields:
            This GP.

        Example:
            >>> import torch
            >>> from pyro_smc.gp import MultiOutputGP
            >>> X = torch.linspace(-2, 2, 10, dtype=torch.float64).unsqueeze(-1)
            >>> gp = MultiOutputGP(X, X.sin(), noise=1e-3)
            >>> with gp.pinned_posterior():  # one Cholesky for both calls
            ...     m1, v1 = gp.predict(X[:2])
            ...     M, V, C = gp.predict_moments(
            ...         torch.zeros(1, dtype=torch.float64), 0.1 * torch.eye(1, dtype=torch.float64)
            ...     )
            >>> loss = -(m1.sum() + M.sum())
            >>> loss.backward()                                   # reaches the hyperparameters
            >>> bool(gp.lengthscale_unconstrained.grad.abs().sum() > 0)
            True
        """
        if getattr(self, "_pinned", None) is not None:
            yield self
            return
        self._pinned = self._posterior()
        try:
            yield self
        finally:
            self._pinned = None

    def _as_input(self, name: str, value: Tensor, event_dims: int) -> Tensor:
        value = torch.as_tensor(value, dtype=self.X.dtype, device=self.X.device)
        D = self.input_dim
        if value.dim() < event_dims or any(s != D for s in value.shape[value.dim() - event_dims :]):
            raise ValueError(f"{name} must have shape (..., {', '.join(['D'] * event_dims)}) with D = {D}, got {tuple(value.shape)}")
        return value

    def predict(self, x: Tensor, noisy: bool = False) -> tuple[Tensor, Tensor]:
        r"""Posterior mean and variance at ``x`` ``(..., D)``.

        Returns:
            ``(mean, var)``, each ``(..., E)``: of the latent function, or of a new noisy
            observation (:math:`\mathrm{var} + \sigma^2`) if ``noisy``.
        """
        x = self._as_input("x", x, 1)
        post = self._posterior()
        return se_ard_predict(x, *post[:5], noise=post.noise if noisy else None)

    def linearize(self, x: Tensor, noisy: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        r"""Posterior mean ``(..., E)``, its Jacobian :math:`\partial \mathrm{mean} / \partial x` ``(..., E, D)`` and the
        variance ``(..., E)`` at ``x`` ``(..., D)`` (the GP-EKS linearisation)."""
        x = self._as_input("x", x, 1)
        post = self._posterior()
        return se_ard_linearize(x, *post[:5], noise=post.noise if noisy else None)

    def predict_moments(self, mean: Tensor, cov: Tensor, noisy: bool = False, chunk_size: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        r"""Exact moments of ``f(x)`` (``+ noise`` if ``noisy``) for :math:`x \sim \mathcal N(\mathrm{mean}, \mathrm{cov})`.

        See ``docs/math/ep.md#exact-moments-of-a-gp-at-a-gaussian-input``.

        Args:
            mean: ``(..., D)``.
            cov: ``(..., D, D)``, positive semi-definite.
            noisy: add the likelihood variances to the covariance's diagonal.
            chunk_size: elements per temporary block, see :func:`pyro_smc.ops.gp_moments.se_ard_moments`.

        Returns:
            ``(M (..., E), V (..., E, E), C (..., D, E))``: mean, covariance and :math:`\operatorname{Cov}[x, f(x)]`.
        """
        mean = self._as_input("mean", mean, 1)
        cov = self._as_input("cov", cov, 2)
        post = self._posterior()
        return se_ard_moments(mean, cov, *post[:5], noise=post.noise if noisy else None, chunk_size=chunk_size)


def pinned_posteriors(*fns: object):  # -> contextlib.ExitStack (not in the docs' offline inventory)
    """A context manager that pins the posterior of every GP among ``fns`` (see
    :meth:`MultiOutputGP.pinned_posterior`).

    An ``nn.Module`` that is not itself a GP (a model, a guide) stands for the GPs among its
    submodules. Other arguments that are not GP posteriors (plain callables, ``None``), or
    GP-like objects without a ``pinned_posterior`` method, are ignored; a GP given twice is
    pinned once (re-entrant).
    The pins are taken when it is called, so call it in the ``with`` statement itself.

    Args:
        *fns: the components of a model, e.g. ``ssm.transition_fn, ssm.observation_fn``, or
            whole models and guides (``nn.Module`` objects).

    Returns:
        A ``contextlib.ExitStack`` holding the pins; they are dropped when it exits.

    Example:
        >>> import torch
        >>> from pyro_smc.gp import MultiOutputGP, pinned_posteriors
        >>> X = torch.linspace(-2, 2, 10, dtype=torch.float64).unsqueeze(-1)
        >>> gp = MultiOutputGP(X, X.sin(), noise=1e-3)
        >>> with pinned_posteriors(gp, torch.sin):  # torch.sin is not a GP: ignored
        ...     mean, var = gp.predict(X[:3])
        ...     mean_again, _ = gp.predict(X[:3])
        >>> torch.equal(mean, mean_again), gp._pinned is None
        (True, True)
    """
    stack = contextlib.ExitStack()
    with stack:  # pins entered so far are released if a later one fails
        for fn in fns:
            # A module that is not itself a GP (a model, a guide) stands for the GPs inside it.
            parts = fn.modules() if isinstance(fn, torch.nn.Module) and not is_gp(fn) else (fn,)
            for part in parts:
                pin = getattr(part, "pinned_posterior", None) if is_gp(part) else None
                if pin is not None:
                    stack.enter_context(pin())
        return stack.pop_all()
