"""Resamplers: weighted particles in, (re)weighted particles out, all with one signature.

See ``docs/math/smc.md#index-resampling`` and ``docs/math/smc.md#soft-resampling`` and
``docs/math/smc.md#optimal-transport-resampling``.

Every resampler is a callable::

    resampler(particles: dict[str, Tensor], log_weights: Tensor) -> (dict[str, Tensor], Tensor)

``log_weights`` are normalised over their last dimension (the particle dimension, size ``N``);
its leading dimensions are independent filters. Each state tensor has shape
``log_weights.shape + event_shape``. The returned log-weights are normalised.

* :class:`MultinomialResampler`, :class:`StratifiedResampler`, :class:`SystematicResampler`:
  unbiased index resampling. With ``gradient="detach"`` (the default) gradients flow through the
  selected particles (pathwise) but not through the choice of ancestors, so the resampling terms
  of the score are dropped. With ``gradient="stop_gradient"`` (Scibior and Wood, 2021) the
  forward pass is the same but the new log-weights ``log w[A_i] - stop_grad(log w[A_i]) - log N``
  carry the gradient of the ancestors' weights, and :class:`~pyro_smc.infer.smc.SMC` switches to
  the Fisher-identity score estimator (see ``docs/math/smc.md#stop-gradient-resampling``).
  ``gradient="marginal_stop_gradient"`` returns the same new log-weights, and ``SMC`` then uses
  the ``O(N^2)`` marginal estimator (Poyiadjis, Doucet and Singh, 2011), whose variance does not
  grow with the number of steps (see ``docs/math/smc.md#marginal-stop-gradient``).
* :class:`SoftResampler`: Karkus et al. (2018); keeps part of the weight gradient.
* :class:`OTResampler`: the differentiable ensemble transform of Corenflos et al. (2021), an
  entropy-regularised optimal-transport map that is smooth in particles and weights. Integer
  state (e.g. a regime label) is not averaged: it comes from one ancestor per new particle,
  drawn from that particle's row of the transport plan. After each call its ``last_result``
  holds the Sinkhorn solve's diagnostics (whether each filter's transport converged).

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import OTResampler
    >>> particles = {"x": torch.randn(4, 100, 2)}               # 4 filters, 100 particles
    >>> log_w = torch.randn(4, 100).log_softmax(-1)
    >>> new, new_log_w = OTResampler(epsilon=0.5)(particles, log_w)
    >>> new["x"].shape, bool(torch.allclose(new_log_w.exp().sum(-1), torch.ones(4)))
    (torch.Size([4, 100, 2]), True)
    >>> resampler = OTResampler(epsilon=0.5)
    >>> _ = resampler(particles, log_w)
    >>> resampler.last_result.converged.shape, resampler.last_result.num_iterations.dtype
    (torch.Size([4]), torch.int64)

    Stop-gradient resampling: uniform weights in value, the ancestors' weight gradient in autograd.

    >>> from pyro_smc.resamplers import SystematicResampler
    >>> log_w = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_()
    >>> new, new_log_w = SystematicResampler(gradient="stop_gradient")({"x": torch.arange(4.0)}, log_w)
    >>> bool((new_log_w == -math.log(4)).all()), new_log_w.requires_grad
    (True, True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_smc.ops import resample as _resample
from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.sinkhorn import GRADIENT_MODES, SinkhornResult, record_results

__all__ = [
    "INDEX_GRADIENT_MODES",
    "Resampler",
    "MultinomialResampler",
    "StratifiedResampler",
    "SystematicResampler",
    "SoftResampler",
    "OTResampler",
]

Particles = dict[str, Tensor]

#: The ``gradient=`` modes of the index resamplers.
INDEX_GRADIENT_MODES = ("detach", "stop_gradient", "marginal_stop_gradient")


def _check_particles(particles: Particles, log_weights: Tensor) -> None:
    """Every state tensor must lead with the particle dims of ``log_weights``."""
    for key, value in particles.items():
        if not isinstance(value, Tensor) or tuple(value.shape[: log_weights.dim()]) != tuple(log_weights.shape):
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"particles['{key}'] has shape {shape}; its leading dims must equal log_weights' shape {tuple(log_weights.shape)}")


def _gather(particles: Particles, index: Tensor) -> Particles:
    """Selects ancestors ``index`` (shape ``(..., N)``) along the particle dimension."""
    out = {}
    for key, value in particles.items():
        if value.dim() == index.dim():
            out[key] = value.gather(index.dim() - 1, index)
            continue
        idx = index.reshape(index.shape + (1,) * (value.dim() - index.dim())).expand(index.shape + value.shape[index.dim() :])
        out[key] = value.gather(index.dim() - 1, idx)
    return out


class Resampler:
    """Base class. Subclasses implement ``__call__(particles, log_weights)``."""

    def __call__(self, particles: Particles, log_weights: Tensor) -> tuple[Particles, Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class _IndexResampler(Resampler):
    """Index resampling by ``_scheme`` (ancestor indices from normalised log-weights).

    Args:
        gradient: ``"detach"`` (default; ``None`` means the same) or ``"stop_gradient"``.

            * ``"detach"``: the new log-weights are the constants ``-log N``; gradients reach the
              new particles only through the selected particles' values (pathwise).
            * ``"stop_gradient"``: the same ancestors and the same values, but the new log-weights
              are ``log w[A_i] - stop_grad(log w[A_i]) - log N``: ``-log N`` in value (bit for
              bit), with the gradient of the ancestor's log-weight. Given such a resampler,
              :class:`~pyro_smc.infer.smc.SMC` detaches the proposal draws and adds their
              score-function terms, so that the gradient of ``log_evidence`` is the
              Fisher-identity estimator of the score (Scibior and Wood, 2021). See
              ``docs/math/smc.md#stop-gradient-resampling``.
            * ``"marginal_stop_gradient"``: the resampler itself acts as for
              ``"stop_gradient"`` (same ancestors, values and new log-weights); ``SMC`` then
              replaces each step's single-ancestor transition score by the score of the marginal
              (mixture) transition density ``log sum_j w_{t-1}^j f(x_t^i | x_{t-1}^j)``, over all
              particle pairs: the ``O(N^2)`` estimator of Poyiadjis, Doucet and Singh (2011), of
              lower variance on long series. Bootstrap filters only, ``O(B N^2)`` memory per
              step. See ``docs/math/smc.md#marginal-stop-gradient``.
    """

    _scheme = staticmethod(_resample.systematic)

    def __init__(self, gradient: str | None = "detach"):
        gradient = "detach" if gradient is None else gradient
        if gradient not in INDEX_GRADIENT_MODES:
            raise ValueError(f"gradient must be one of {INDEX_GRADIENT_MODES} (or None), got {gradient!r}")
        self.gradient = gradient

    def __call__(self, particles: Particles, log_weights: Tensor) -> tuple[Particles, Tensor]:
        _check_particles(particles, log_weights)
        index = self._scheme(log_weights)
        n = log_weights.shape[-1]
        if self.gradient in ("stop_gradient", "marginal_stop_gradient"):
            return _gather(particles, index), _resample.stop_gradient_log_weights(log_weights, index)
        return _gather(particles, index), torch.full_like(log_weights, -math.log(n))


class MultinomialResampler(_IndexResampler):
    """Multinomial resampling: ancestors drawn i.i.d. from the weights.

    Args:
        gradient: ``"detach"`` (default; the new log-weights are constants),
            ``"stop_gradient"`` (they carry the ancestors' weight gradient, and ``SMC`` computes
            the Fisher-identity score) or ``"marginal_stop_gradient"`` (the same, with the
            ``O(N^2)`` marginal estimator); see the module docstring,
            ``docs/math/smc.md#stop-gradient-resampling`` and
            ``docs/math/smc.md#marginal-stop-gradient``.
    """

    _scheme = staticmethod(_resample.multinomial)


class StratifiedResampler(_IndexResampler):
    """Stratified resampling: one uniform per stratum ``[(i-1)/N, i/N)``.

    Args:
        gradient: ``"detach"`` (default), ``"stop_gradient"`` or ``"marginal_stop_gradient"``,
            as for :class:`MultinomialResampler`.
    """

    _scheme = staticmethod(_resample.stratified)


class SystematicResampler(_IndexResampler):
    """Systematic resampling: one shared uniform; lowest variance of the three (the default).

    Args:
        gradient: ``"detach"`` (default) or ``"stop_gradient"``, as for :class:`MultinomialResampler`.
            ``SMC(..., resampler=SystematicResampler(gradient="stop_gradient"))`` makes the gradient
            of ``log_evidence`` the Fisher-identity score estimator, which also reaches the
            parameters of discrete (non-reparameterised) latent sites.
            ``gradient="marginal_stop_gradient"`` gives the ``O(N^2)`` marginal version of it
            (bootstrap filters; see ``docs/math/smc.md#marginal-stop-gradient``).
    """

    _scheme = staticmethod(_resample.systematic)


def _check_unit_interval(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


class SoftResampler(Resampler):
    """Soft resampling (Karkus et al., 2018).

    Ancestors are drawn from ``alpha * w + (1 - alpha) / N``; the new weights
    ``w_A / (alpha w_A + (1 - alpha) / N)``, renormalised, keep a gradient with respect to the old
    ones. ``alpha = 1`` is multinomial resampling.

    Args:
        alpha: mixing weight in ``(0, 1]``.
    """

    def __init__(self, alpha: float = 0.5):
        self.alpha = _check_unit_interval("alpha", alpha)

    def __call__(self, particles: Particles, log_weights: Tensor) -> tuple[Particles, Tensor]:
        _check_particles(particles, log_weights)
        n = log_weights.shape[-1]
        log_mix = torch.logaddexp(log_weights + math.log(self.alpha), torch.full_like(log_weights, math.log1p(-self.alpha) - math.log(n)))
        index = _resample.multinomial(log_mix)
        new_log_w = (log_weights - log_mix).gather(-1, index)
        return _gather(particles, index), new_log_w - new_log_w.logsumexp(-1, keepdim=True)


class OTResampler(Resampler):
    """Differentiable ensemble transform by entropy-regularised optimal transport.

    All floating-point state tensors are flattened per particle and concatenated into one point
    cloud, transported jointly with the scale normalisation of Corenflos et al. (2021) by the
    barycentric map ``x~_i = sum_j P_ij x_j / sum_j P_ij`` of the entropic plan ``P``, and
    split back (differentiably). Weighted means are preserved (up to the plan's marginal
    error); the output is equally weighted.

    Integer (and other non-floating) state tensors, e.g. a discrete regime label, cannot be
    averaged. Each new particle ``i`` instead draws one ancestor ``A_i ~ Categorical(N P_i.)``
    from its row of the (detached) plan, independently across particles, and every
    non-floating tensor takes its value from that ancestor, so labels of one particle stay
    consistent with each other. The rows of ``P`` sum to ``1/N`` and its columns to the
    weights, so ``P(A_i = j)`` averaged over ``i`` is ``w_j``: the weighted distribution of
    the labels is kept in expectation (up to the marginal error, below ``threshold``). The
    draws are independent, so the variance of a label count is ``sum_i p_i (1 - p_i)`` with
    ``p_i = N sum_{j: z_j = 1} P_ij`` the row's share of the label: at most that of
    multinomial resampling (Jensen), less where the plan is sharp, but typically more than
    systematic resampling's. Particles of zero weight are never drawn. This part is random
    and not differentiable, and a new particle pairs ``x~_i`` with the label of one of the
    particles averaged into it, not of a particle at ``x~_i``.

    Args:
        epsilon: regularisation on the normalised cost scale, ``> 0``; smaller is closer to
            exact OT (less bias, stiffer gradients, more iterations).
        scaling: epsilon annealing factor in ``[0, 1)``; 0 switches annealing off. Annealing
            only runs when ``epsilon`` is below a quarter of the mean normalised cost.
        threshold: stop once the L1 marginal error of the plan is below this.
        max_iter: maximum Sinkhorn iterations at the final epsilon.
        gradient: ``"implicit"`` (exact, default), ``"unroll"`` (exact for the iterate; memory
            grows with the iterations) or ``"last_step"`` (potentials held fixed in the backward
            pass: no adjoint solve, slightly cheaper, but relative gradient errors of 0.3-0.5 at
            epsilon 0.5; only where a biased gradient is acceptable). See
            ``docs/math/smc.md#gradient-modes``.

    Attributes:
        last_result: the :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` of the last call's
            Sinkhorn solve (``None`` before the first call), all of it detached. With
            ``batch = log_weights.shape[:-1]`` (the filters of that call): ``converged``
            ``batch`` bool, whether the plan met ``threshold`` within ``max_iter`` (the solver
            also warns, :class:`~pyro_smc.ops.sinkhorn.SinkhornConvergenceWarning`);
            ``num_iterations`` ``batch`` int64; ``marginal_error`` ``batch`` in the dtype of
            ``log_weights``; ``f`` and ``g`` the potentials, ``batch + (N,)``. Diagnostics
            only: the call's outputs do not depend on whether anyone reads them.
    """

    def __init__(self, epsilon: float = 0.5, scaling: float = 0.75, threshold: float = 1e-3, max_iter: int = 100, gradient: str = "implicit"):
        if not (isinstance(epsilon, (int, float)) and epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
        if not 0 <= scaling < 1:
            raise ValueError(f"scaling must lie in [0, 1), got {scaling!r}")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        if int(max_iter) < 1:
            raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")
        if gradient not in GRADIENT_MODES:
            raise ValueError(f"gradient must be one of {GRADIENT_MODES}, got {gradient!r}")
        self.epsilon = float(epsilon)
        self.scaling = float(scaling)
        self.threshold = float(threshold)
        self.max_iter = int(max_iter)
        self.gradient = gradient
        self._last_result: SinkhornResult | None = None

    @property
    def last_result(self) -> SinkhornResult | None:
        """Diagnostics of the last call's Sinkhorn solve (see the class docstring)."""
        return self._last_result

    def __call__(self, particles: Particles, log_weights: Tensor) -> tuple[Particles, Tensor]:
        _check_particles(particles, log_weights)
        batch = log_weights.shape
        floats = {k: v for k, v in particles.items() if v.is_floating_point()}
        if not floats:
            raise ValueError("OTResampler needs at least one floating-point state tensor")
        flat = [v.reshape(batch + (-1,)) for v in floats.values()]
        x = torch.cat(flat, -1) if len(flat) > 1 else flat[0]
        x = x.to(log_weights.dtype) if x.dtype != log_weights.dtype else x
        self._last_result = None
        with record_results() as results:
            x_new, plan = ensemble_transform(x, log_weights, self.epsilon, self.scaling, self.threshold, self.max_iter, self.gradient)
        self._last_result = results[-1]
        out, start = {}, 0
        for (key, value), piece in zip(floats.items(), flat):
            width = piece.shape[-1]
            out[key] = x_new[..., start : start + width].reshape(value.shape).to(value.dtype)
            start += width
        others = {k: v for k, v in particles.items() if k not in floats}
        if others:
            out.update(_gather(others, _ancestors_from_plan(plan.detach())))
        return out, torch.full_like(log_weights, -math.log(batch[-1]))


def _ancestors_from_plan(plan: Tensor) -> Tensor:
    """One ancestor per row of ``plan`` ``(..., N, M)``: ``A_i ~ Categorical(plan[..., i, :])``.

    Rows need not be normalised. Inverse CDF with ``u = (1 - U) * row_sum`` in ``(0, row_sum]``
    and the first index whose cumulative mass reaches ``u``: a column of zero mass repeats the
    cumulative sum before it and so is never chosen, even when ``u`` rounds up to the row sum.
    No host synchronisation; the device and dtype are the plan's.
    """
    cdf = plan.cumsum(-1)
    u = (1 - torch.rand(cdf.shape[:-1] + (1,), dtype=cdf.dtype, device=cdf.device)) * cdf[..., -1:]
    index = torch.searchsorted(cdf, u, right=False).squeeze(-1)
    # Only a non-finite plan can put u beyond the last cumulative mass.
    return index.clamp_(max=plan.shape[-1] - 1)
