"""Resamplers: weighted particles in, (re)weighted particles out, all with one signature.

See ``docs/math/smc.md#index-resampling`` and ``docs/math/smc.md#soft-resampling`` and
``docs/math/smc.md#optimal-transport-resampling`` and ``docs/math/smc.md#kernel-mixture-resampling``.

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
* :class:`KernelResampler`: the mixture resampling of Younis and Sudderth (2023): new particles
  drawn from a Gaussian kernel density around the weighted particles, with new log-weights
  ``-log N`` in value that carry the gradient of the mixture density (a regularised filter).

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

import enum
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_smc.ops import resample as _resample
from pyro_smc.ops.ensemble import ensemble_transform
from pyro_smc.ops.sinkhorn import GRADIENT_MODES, SinkhornResult, record_results
from pyro_smc.ops.weights import check_log_weights

__all__ = [
    "INDEX_GRADIENT_MODES",
    "GradientEstimator",
    "Resampled",
    "Resampler",
    "resample",
    "estimator_of",
    "MultinomialResampler",
    "StratifiedResampler",
    "SystematicResampler",
    "SoftResampler",
    "OTResampler",
    "KernelResampler",
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


class GradientEstimator(enum.Enum):
    """Which estimator of the gradient of ``log Z`` a resampler asks :class:`~pyro_smc.SMC` for.

    * ``PATHWISE``: autodiff of whatever the resampler returns (index resampling with constant
      new weights, soft, kernel and OT resampling).
    * ``SCORE``: the Fisher-identity estimator: ``SMC`` detaches the proposal draws and adds their
      score terms (``gradient="stop_gradient"`` of the index resamplers).
    * ``MARGINAL_SCORE``: the same with the ``O(N^2)`` score of the marginal transition density
      (``gradient="marginal_stop_gradient"``).

    Example:
        >>> from pyro_smc.resamplers import GradientEstimator, SystematicResampler
        >>> SystematicResampler(gradient="stop_gradient").estimator
        <GradientEstimator.SCORE: 'score'>
    """

    PATHWISE = "pathwise"
    SCORE = "score"
    MARGINAL_SCORE = "marginal_score"


class Resampled(NamedTuple):
    """What one resampling call found.

    Attributes:
        particles: the new state tensors, each ``(..., N, *event)`` as given.
        log_weights: the normalised new log-weights ``(..., N)``.
        ancestors: int64 ``(..., N)``, new particle ``i`` is old particle ``ancestors[..., i]``;
            ``None`` for a resampler that moves particles instead of copying them (OT, kernel).
        diagnostics: an iterative resampler's solve, with a bool ``converged`` of shape
            ``log_weights.shape[:-1]`` (a :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` for
            :class:`OTResampler`); ``None`` otherwise.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SystematicResampler
        >>> out = SystematicResampler().resample({"x": torch.arange(4.0)}, torch.zeros(4).log_softmax(-1))
        >>> out.ancestors.tolist(), out.diagnostics is None
        ([0, 1, 2, 3], True)
    """

    particles: Particles
    log_weights: Tensor
    ancestors: Tensor | None = None
    diagnostics: Any = None


class Resampler:
    """Base class of the resamplers. Subclasses implement :meth:`resample` (a plain resampler may
    implement ``__call__`` instead).

    A resampler maps a dict of state tensors, each ``(..., N, *event)``, and normalised
    log-weights ``(..., N)`` (leading dims: independent filters) to new ones of the same shapes.
    ``resampler(particles, log_weights)`` returns ``(particles, log_weights)``;
    :meth:`resample` returns a :class:`Resampled` that also carries the ancestors and the
    diagnostics, which is what :class:`~pyro_smc.SMC` reads. Three class attributes tell the
    engine what to expect, so that it never probes an instance.

    Attributes:
        estimator: the :class:`GradientEstimator` the engine uses with this resampler.
        draws_ancestors: :meth:`resample` returns ancestors (genealogy smoothing needs them).
        reports_convergence: the resampler runs a solver that may emit
            :class:`~pyro_smc.ops.sinkhorn.SinkhornConvergenceWarning`, which ``SMC`` prefixes
            with the time step.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import Resampled, Resampler, SystematicResampler
        >>> class KeepAll(Resampler):                      # never moves a particle
        ...     draws_ancestors = True
        ...     def resample(self, particles, log_weights):
        ...         ancestors = torch.arange(log_weights.shape[-1]).expand(log_weights.shape)
        ...         return Resampled(particles, log_weights, ancestors)
        >>> new, new_log_w = KeepAll()({"x": torch.zeros(3)}, torch.zeros(3))
        >>> KeepAll(), isinstance(SystematicResampler(), Resampler)
        (KeepAll(), True)
    """

    estimator: GradientEstimator = GradientEstimator.PATHWISE
    draws_ancestors: bool = False
    reports_convergence: bool = False

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        """Resamples; see the class docstring. The default wraps a subclass's ``__call__``."""
        if type(self).__call__ is Resampler.__call__:
            raise NotImplementedError(f"{type(self).__name__} must implement resample(particles, log_weights) or __call__")
        new, new_log_w = self(particles, log_weights)
        return Resampled(new, new_log_w)

    def __call__(self, particles: Particles, log_weights: Tensor) -> tuple[Particles, Tensor]:
        out = self.resample(particles, log_weights)
        return out.particles, out.log_weights

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def resample(resampler: Any, particles: Particles, log_weights: Tensor) -> Resampled:
    """Runs any resampler: a :class:`Resampler` through :meth:`Resampler.resample`, a plain
    callable ``resampler(particles, log_weights) -> (particles, log_weights)`` as a pathwise one
    with no ancestors.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import resample
        >>> keep = lambda particles, log_weights: (particles, log_weights)
        >>> resample(keep, {"x": torch.zeros(2)}, torch.zeros(2)).ancestors is None
        True
    """
    if isinstance(resampler, Resampler):
        return resampler.resample(particles, log_weights)
    new, new_log_w = resampler(particles, log_weights)
    return Resampled(new, new_log_w)


def estimator_of(resampler: Any) -> GradientEstimator:
    """The :class:`GradientEstimator` a resampler asks for (``PATHWISE`` for a plain callable).

    Example:
        >>> from pyro_smc.resamplers import OTResampler, estimator_of
        >>> estimator_of(OTResampler()), estimator_of(lambda p, w: (p, w))
        (<GradientEstimator.PATHWISE: 'pathwise'>, <GradientEstimator.PATHWISE: 'pathwise'>)
    """
    return resampler.estimator if isinstance(resampler, Resampler) else GradientEstimator.PATHWISE


_INDEX_ESTIMATORS = {
    "detach": GradientEstimator.PATHWISE,
    "stop_gradient": GradientEstimator.SCORE,
    "marginal_stop_gradient": GradientEstimator.MARGINAL_SCORE,
}


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

    Attributes:
        last_ancestors: the ancestor indices the last call drew, shape ``log_weights.shape``
            (``(..., N)``; new particle ``i`` is old particle ``last_ancestors[..., i]``), int64;
            ``None`` before the first call. Set at each call, the return value is unchanged;
            :meth:`SMC.smooth <pyro_smc.infer.smc.SMC.smooth>` reads it for the genealogy.
    """

    _scheme = staticmethod(_resample.systematic)
    _last_ancestors: Tensor | None = None

    @property
    def last_ancestors(self) -> Tensor | None:
        """The ancestors of the last call (see the class docstring)."""
        return self._last_ancestors

    draws_ancestors = True

    def __init__(self, gradient: str | None = "detach"):
        gradient = "detach" if gradient is None else gradient
        if gradient not in INDEX_GRADIENT_MODES:
            raise ValueError(f"gradient must be one of {INDEX_GRADIENT_MODES} (or None), got {gradient!r}")
        self.gradient = gradient

    @property
    def estimator(self) -> GradientEstimator:  # type: ignore[override]
        """``SCORE`` for ``gradient="stop_gradient"``, ``MARGINAL_SCORE`` for
        ``"marginal_stop_gradient"``, else ``PATHWISE``."""
        return _INDEX_ESTIMATORS[self.gradient]

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        _check_particles(particles, log_weights)
        index = self._scheme(log_weights)
        self._last_ancestors = index
        n = log_weights.shape[-1]
        if self.gradient in ("stop_gradient", "marginal_stop_gradient"):
            return Resampled(_gather(particles, index), _resample.stop_gradient_log_weights(log_weights, index), index)
        return Resampled(_gather(particles, index), torch.full_like(log_weights, -math.log(n)), index)


class MultinomialResampler(_IndexResampler):
    """Multinomial resampling: ancestors drawn i.i.d. from the weights.

    Args:
        gradient: ``"detach"`` (default; the new log-weights are constants),
            ``"stop_gradient"`` (they carry the ancestors' weight gradient, and ``SMC`` computes
            the Fisher-identity score) or ``"marginal_stop_gradient"`` (the same, with the
            ``O(N^2)`` marginal estimator); see the module docstring,
            ``docs/math/smc.md#stop-gradient-resampling`` and
            ``docs/math/smc.md#marginal-stop-gradient``.

    Returns:
        ``(particles, log_weights)``: each state tensor ``(..., N, *event)`` and the normalised
        new log-weights ``(..., N)``, shaped as the inputs.

    Raises:
        ValueError: an unknown ``gradient`` mode; at call time, particles whose leading shape is
            not ``log_weights.shape``.

    Example:
        Ancestors are drawn independently by the weights, so each particle's number of copies is
        Binomial(N, w_i): on average ``N w_i``.

        >>> import torch
        >>> from pyro_smc.resamplers import MultinomialResampler
        >>> _ = torch.manual_seed(0)
        >>> w = torch.tensor([0.5, 0.3, 0.2, 0.0])
        >>> resampler = MultinomialResampler()
        >>> new, new_log_w = resampler({"x": torch.arange(4.0).expand(2000, 4)}, w.log().expand(2000, 4))
        >>> copies = torch.stack([(new["x"] == i).sum(-1) for i in range(4)], -1).float()   # (2000, 4)
        >>> bool(((copies.mean(0) - 4 * w).abs() < 0.1).all())              # N w = (2, 1.2, 0.8, 0), s.e. <= 0.03
        True
        >>> resampler.last_ancestors.shape, new_log_w.shape                    # (R, N) ancestors, equal weights
        (torch.Size([2000, 4]), torch.Size([2000, 4]))
    """

    _scheme = staticmethod(_resample.multinomial)


class StratifiedResampler(_IndexResampler):
    """Stratified resampling: one uniform per stratum ``[(i-1)/N, i/N)``.

    Args:
        gradient: ``"detach"`` (default), ``"stop_gradient"`` or ``"marginal_stop_gradient"``,
            as for :class:`MultinomialResampler`.

    Returns:
        ``(particles, log_weights)``: each state tensor ``(..., N, *event)`` and the normalised
        new log-weights ``(..., N)``, shaped as the inputs.

    Raises:
        ValueError: an unknown ``gradient`` mode; at call time, particles whose leading shape is
            not ``log_weights.shape``.

    Example:
        With equal weights every stratum holds exactly one particle's share, so each particle is
        kept once (multinomial resampling would duplicate some and drop others):

        >>> import torch
        >>> from pyro_smc.resamplers import StratifiedResampler
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(8, 2)                                                # (N, d)
        >>> resampler = StratifiedResampler()
        >>> new, new_log_w = resampler({"x": x}, torch.full((8,), 1 / 8).log())
        >>> torch.equal(resampler.last_ancestors.sort().values, torch.arange(8))
        True
        >>> torch.equal(new["x"], x[resampler.last_ancestors]), torch.allclose(new_log_w.exp(), torch.full((8,), 1 / 8))
        (True, True)
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

    Returns:
        ``(particles, log_weights)``: each state tensor ``(..., N, *event)`` and the normalised
        new log-weights ``(..., N)``, shaped as the inputs.

    Raises:
        ValueError: an unknown ``gradient`` mode; at call time, particles whose leading shape is
            not ``log_weights.shape``.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SystematicResampler
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(1000, 2), torch.randn(1000).log_softmax(-1)   # (N, d), (N,)
        >>> new, new_log_w = SystematicResampler()({"x": x}, log_w)
        >>> new["x"].shape, new_log_w.shape
        (torch.Size([1000, 2]), torch.Size([1000]))
        >>> mean = (log_w.exp()[:, None] * x).sum(0)                            # weighted mean kept
        >>> torch.allclose((new_log_w.exp()[:, None] * new["x"]).sum(0), mean, atol=0.1)
        True

        Each particle is copied ``floor(N w)`` or ``ceil(N w)`` times:

        >>> w = torch.tensor([0.1, 0.2, 0.3, 0.4])
        >>> resampler = SystematicResampler()
        >>> _ = resampler({"x": torch.arange(4.0)}, w.log())
        >>> counts = torch.bincount(resampler.last_ancestors, minlength=4)
        >>> bool(((counts - 4 * w).abs() < 1).all())
        True
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

    Attributes:
        last_ancestors: the ancestor indices ``A`` of the last call, shape ``(..., N)`` (``None``
            before the first call), as for the index resamplers.

    Returns:
        ``(particles, log_weights)``: each state tensor ``(..., N, *event)`` and the normalised
        new log-weights ``(..., N)``, shaped as the inputs.

    Raises:
        ValueError: ``alpha`` outside ``(0, 1]``; at call time, mismatched particle shapes.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SoftResampler
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(1000, 2), torch.randn(1000).log_softmax(-1)   # (N, d), (N,)
        >>> _ = log_w.requires_grad_()
        >>> new, new_log_w = SoftResampler(alpha=0.5)({"x": x}, log_w)
        >>> new["x"].shape, new_log_w.shape
        (torch.Size([1000, 2]), torch.Size([1000]))
        >>> mean = (log_w.exp()[:, None] * x).sum(0)                            # weighted mean kept
        >>> torch.allclose((new_log_w.exp()[:, None] * new["x"]).sum(0), mean, atol=0.1)
        True
        >>> new_log_w.requires_grad                          # the weights keep a gradient
        True
    """

    _last_ancestors: Tensor | None = None
    draws_ancestors = True

    def __init__(self, alpha: float = 0.5):
        self.alpha = _check_unit_interval("alpha", alpha)

    @property
    def last_ancestors(self) -> Tensor | None:
        """The ancestors of the last call (see the class docstring)."""
        return self._last_ancestors

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        _check_particles(particles, log_weights)
        n = log_weights.shape[-1]
        # alpha = 1 (plain multinomial) leaves no uniform part: its log-weight is -inf, not an error.
        log_uniform = math.log1p(-self.alpha) - math.log(n) if self.alpha < 1 else -math.inf
        log_mix = torch.logaddexp(log_weights + math.log(self.alpha), torch.full_like(log_weights, log_uniform))
        index = _resample.multinomial(log_mix)
        self._last_ancestors = index
        new_log_w = (log_weights - log_mix).gather(-1, index)
        return Resampled(_gather(particles, index), new_log_w - new_log_w.logsumexp(-1, keepdim=True), index)


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
    particles averaged into it, not of a particle at ``x~_i``. :class:`~pyro_smc.SMC` passes a
    float-coded label (the value of a site with discrete support, such as ``dist.Bernoulli``'s
    0./1.) as an integer tensor, so it is never averaged either. A state with no floating tensor
    has nothing to transport: the plan of zero cost is the independent coupling, and the call is
    multinomial resampling.

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

    Returns:
        ``(particles, log_weights)``: each state tensor ``(..., N, *event)`` and the normalised
        new log-weights ``(..., N)``, shaped as the inputs.

    Raises:
        ValueError: an argument out of range or an unknown ``gradient`` mode; at call time,
            mismatched particle shapes.

    Example:
        The transported particles are equally weighted and keep the weighted mean:

        >>> import torch
        >>> from pyro_smc.resamplers import OTResampler
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(100, 2), torch.randn(100).log_softmax(-1)     # (N, d), (N,)
        >>> resampler = OTResampler(epsilon=0.5)
        >>> new, new_log_w = resampler({"x": x}, log_w)
        >>> torch.allclose(new_log_w, torch.full((100,), -torch.log(torch.tensor(100.0))))
        True
        >>> torch.allclose(new["x"].mean(0), (log_w.exp()[:, None] * x).sum(0), atol=1e-2)
        True
        >>> bool(resampler.last_result.converged)
        True
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

    reports_convergence = True

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        _check_particles(particles, log_weights)
        batch = log_weights.shape
        floats = {k: v for k, v in particles.items() if v.is_floating_point()}
        self._last_result = None
        if not floats:
            # Nothing to transport: with zero cost the entropic plan is the independent coupling
            # P = (1/N) w^T, whose rows draw ancestors by the weights (multinomial resampling).
            index = _resample.multinomial(log_weights)
            return Resampled(_gather(particles, index), torch.full_like(log_weights, -math.log(batch[-1])), index)
        flat = [v.reshape(batch + (-1,)) for v in floats.values()]
        x = torch.cat(flat, -1) if len(flat) > 1 else flat[0]
        x = x.to(log_weights.dtype) if x.dtype != log_weights.dtype else x
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
        return Resampled(out, torch.full_like(log_weights, -math.log(batch[-1])), diagnostics=self._last_result)


_KERNEL_SCHEMES = {"systematic": _resample.systematic, "multinomial": _resample.multinomial}


class KernelResampler(Resampler):
    """Kernel (mixture) resampling: draws from a Gaussian kernel density of the weighted particles.

    The Mixture Density Particle Filter resampler of Younis and Sudderth (2023). The floating-point
    state tensors are flattened per particle and concatenated into ``x_j`` (length ``D``); the
    weighted particles define the mixture ``m(x) = sum_j w_j N(x; x_j, diag(h^2))``. The new
    particles are ``x~_i = x_{A_i} + h * eps_i`` with ``eps_i ~ N(0, I)`` and ancestors ``A_i``
    drawn from the weights by ``scheme``, all of it detached (no pathwise gradient), and the new
    log-weights are

        ``log m(x~_i) - stop_grad(log m(x~_i)) - log N``:

    exactly ``-log N`` in value, while in autograd they carry the gradient of the mixture density
    at the drawn points with respect to the old log-weights, the old particles and ``h``.

    **What is unbiased.** Every new particle has marginal (averaged over ``i``, for systematic
    ancestors) law ``m``, so ``sum_i exp(lw~_i) f(x~_i)`` is an unbiased estimate of ``E_m[f]``, and
    its autograd gradient, ``(1/N) sum_i f(x~_i) d log m(x~_i)``, is an unbiased estimate of
    ``d E_m[f] / d theta`` (the score identity ``E_m[f d log m] = d E_m[f]``; the paper's
    importance-weighted sample gradient). What is *not* unbiased: ``m`` is not the weighted
    particle measure but that measure convolved with the kernel. Each resampling adds ``h^2``
    to the covariance of the particle cloud, so inside :class:`~pyro_smc.infer.smc.SMC` this is
    a regularised particle filter: its filtering means, covariances and ``log_evidence`` target
    a slightly different (jittered) model, with a bias that vanishes as ``h -> 0``; but the
    gradient's standard deviation grows like ``1/h`` (the score of the kernel with respect to a
    particle is ``eps / h``). The forward pass is a valid particle filter only for that jittered
    model: for a linear-Gaussian model resampled at every step, the one with transition
    covariance ``Q + A diag(h^2) A^T``.

    **Non-floating state** (integer or bool tensors, e.g. a regime label) is copied from the
    ancestor: its kernel is a point mass. The mixture density at ``x~_i`` then only sums over
    the particles whose labels equal the new particle's (every such key), as the density of the
    joint mixture requires. With no floating-point state at all the new log-weights still carry
    the gradient of the mass of the drawn labels.

    **Cost.** ``O(N^2 D)`` time and ``O(N^2)`` memory per filter and call (every pair of new and
    old particles), vectorised over the leading (filter) dimensions. See
    ``docs/math/smc.md#kernel-mixture-resampling``.

    Args:
        bandwidth: the kernel standard deviation ``h`` in the units of the state: a float
            ``> 0`` (the same in every coordinate); a positive tensor of shape ``()`` or ``(D,)``
            (per coordinate of the concatenated state), which may require grad (e.g. an
            ``nn.Parameter``, then checked at every call); or ``"silverman"``: per coordinate
            ``h_k = sigma_k (4 / ((D + 2) n_eff))^(1/(D + 4))`` with ``sigma_k`` the weighted
            standard deviation and ``n_eff = 1 / sum_j w_j^2``, differentiated with the rest (a
            coordinate in which every particle of positive weight agrees gets ``h_k = 0``: it is
            copied, a point mass). Default ``"silverman"``.
        scheme: how the ancestors are drawn, ``"systematic"`` (default: the lowest-variance
            unbiased scheme, so the new cloud covers the mixture components in proportion to
            their weights; the particles are then not independent, but each sum over them is
            still unbiased for ``m``) or ``"multinomial"`` (``x~_i`` i.i.d. from ``m``).

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import KernelResampler
        >>> x = torch.randn(4, 100, 2, requires_grad=True)            # 4 filters, 100 particles
        >>> log_w = torch.randn(4, 100).log_softmax(-1)
        >>> new, new_log_w = KernelResampler(bandwidth=0.1)({"x": x, "k": torch.zeros(4, 100).long()}, log_w)
        >>> new["x"].shape, new["x"].requires_grad, bool((new_log_w == -math.log(100)).all())
        (torch.Size([4, 100, 2]), False, True)
        >>> torch.autograd.grad(new_log_w.sum(), x)[0].abs().sum() > 0     # the mixture's gradient
        tensor(True)

    Reference:
        A. Younis, E. Sudderth (2023). Differentiable and Stable Long-Range Tracking of Multiple
        Posterior Modes. NeurIPS. arXiv:2404.08789.
    """

    def __init__(self, bandwidth: float | str | Tensor = "silverman", scheme: str = "systematic"):
        if isinstance(bandwidth, str):
            if bandwidth != "silverman":
                raise ValueError(f"bandwidth must be a float > 0, a positive tensor or 'silverman', got {bandwidth!r}")
        elif isinstance(bandwidth, Tensor):
            if bandwidth.dim() > 1 or not bandwidth.is_floating_point():
                raise ValueError(f"bandwidth must be a floating tensor of shape () or (D,), got {bandwidth.dtype} of shape {tuple(bandwidth.shape)}")
            _check_bandwidth_tensor(bandwidth)
        elif isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool) and math.isfinite(bandwidth) and bandwidth > 0:
            bandwidth = float(bandwidth)
        else:
            raise ValueError(f"bandwidth must be a finite float > 0, a positive tensor or 'silverman', got {bandwidth!r}")
        if scheme not in _KERNEL_SCHEMES:
            raise ValueError(f"scheme must be one of {tuple(_KERNEL_SCHEMES)}, got {scheme!r}")
        self.bandwidth = bandwidth
        self.scheme = scheme

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        _check_particles(particles, log_weights)
        check_log_weights(log_weights)
        batch, n = log_weights.shape, log_weights.shape[-1]
        floats = {k: v for k, v in particles.items() if v.is_floating_point()}
        others = {k: v for k, v in particles.items() if k not in floats}
        flat = [v.reshape(batch + (-1,)).to(log_weights.dtype) for v in floats.values()]
        x = torch.cat(flat, -1) if flat else log_weights.new_zeros(batch + (0,))
        h = self._bandwidth(x, log_weights)
        index = _KERNEL_SCHEMES[self.scheme](log_weights)
        with torch.no_grad():
            ancestors = _gather({"x": x}, index)["x"]
            x_new = ancestors + h.unsqueeze(-2) * torch.randn_like(ancestors)
        out = _gather(others, index)
        allowed = None
        for key, value in others.items():
            # Pairs (new i, old j) whose labels agree in every coordinate of this key.
            same = out[key].reshape(batch + (1, -1)) == value.reshape(batch[:-1] + (1, n, -1))
            same = same.all(-1)
            allowed = same if allowed is None else allowed & same
        log_m = _resample.kernel_mixture_log_density(x_new, x, log_weights, h, allowed)
        delta = log_m - log_m.detach()
        # Only a drawn ancestor of zero weight (a rounding clamp) can leave log m = -inf.
        delta = torch.where(torch.isfinite(log_m), delta, torch.zeros_like(delta))
        start = 0
        for (key, value), piece in zip(floats.items(), flat):
            width = piece.shape[-1]
            out[key] = x_new[..., start : start + width].reshape(value.shape).to(value.dtype)
            start += width
        return Resampled({k: out[k] for k in particles}, delta - math.log(n))

    def _bandwidth(self, x: Tensor, log_weights: Tensor) -> Tensor:
        """The bandwidth, shape ``batch + (D,)`` (``batch = log_weights.shape[:-1]``)."""
        shape = log_weights.shape[:-1] + x.shape[-1:]
        if isinstance(self.bandwidth, float):
            return x.new_full(shape, self.bandwidth)
        if isinstance(self.bandwidth, Tensor):
            _check_bandwidth_tensor(self.bandwidth)
            if self.bandwidth.dim() == 1 and self.bandwidth.shape[0] != x.shape[-1]:
                raise ValueError(f"bandwidth has shape {tuple(self.bandwidth.shape)}, but the floating-point state has {x.shape[-1]} coordinates")
            return self.bandwidth.to(device=x.device, dtype=x.dtype).broadcast_to(shape)
        w = log_weights.exp().unsqueeze(-1)
        mean = (w * x).sum(-2, keepdim=True)
        var = (w * (x - mean) ** 2).sum(-2)
        # A coordinate in which every particle of positive weight agrees is a point mass (h = 0),
        # decided exactly (a rounded mean would leave a variance of a few ulps), and kept off the
        # square root, whose derivative at 0 is infinite.
        live = w > 0
        spread = torch.where(live, x, -math.inf).amax(-2) > torch.where(live, x, math.inf).amin(-2)
        sd = torch.where(spread, torch.where(spread, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var))
        d = x.shape[-1]
        n_eff = 1 / (w.squeeze(-1) ** 2).sum(-1, keepdim=True)
        return sd * (4 / ((d + 2) * n_eff)) ** (1 / (d + 4))


def _check_bandwidth_tensor(bandwidth: Tensor) -> None:
    h = bandwidth.detach()
    if not bool(((h > 0) & torch.isfinite(h)).all()):
        raise ValueError(f"bandwidth must be finite and > 0 everywhere, got {h.tolist()}")


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
