"""Index resampling: each new particle is a copy of one ancestor drawn from the weights.

See ``docs/math/smc.md#index-resampling``, ``docs/math/smc.md#stop-gradient-resampling`` and
``docs/math/smc.md#marginal-stop-gradient``. The four schemes (:class:`MultinomialResampler`,
:class:`ResidualResampler`, :class:`StratifiedResampler`, :class:`SystematicResampler`) share
everything but how the
ancestors are drawn (:mod:`pyro_smc.ops.resample`); their shared contract, arguments and
gradient estimators are documented once, on :class:`IndexResampler`.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import IndexResampler, StratifiedResampler
    >>> resampler = StratifiedResampler(gradient="stop_gradient")
    >>> isinstance(resampler, IndexResampler), resampler.estimator.name
    (True, 'SCORE')
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from pyro_smc.ops import resample as schemes
from pyro_smc.resamplers.base import GradientEstimator, Particles, Resampled, Resampler, check_particles, gather

__all__ = ["INDEX_GRADIENT_MODES", "IndexResampler", "index_scheme", "MultinomialResampler", "ResidualResampler", "StratifiedResampler", "SystematicResampler"]

#: The ``gradient=`` modes of the index resamplers, each naming the SMC gradient estimator.
INDEX_GRADIENT_MODES = ("detach", "stop_gradient", "marginal_stop_gradient")

_ESTIMATORS = {
    "detach": GradientEstimator.PATHWISE,
    "stop_gradient": GradientEstimator.SCORE,
    "marginal_stop_gradient": GradientEstimator.MARGINAL_SCORE,
}


class IndexResampler(Resampler):
    r"""Unbiased index resampling by a scheme of :mod:`pyro_smc.ops.resample` (the shared base).

    Ancestors :math:`A_i` are drawn from the normalised log-weights by the subclass's ``scheme`` so
    that :math:`\mathbb E[\#\{i : A_i = j\}] = N w_j`; every state tensor takes the value of the ancestor, and the
    new weights are equal. :meth:`resample` returns the ancestors (``Resampled.ancestors``,
    int64 ``(..., N)``: new particle ``i`` is old particle ``ancestors[..., i]``), which
    :meth:`SMC.smooth <pyro_smc.infer.smc.SMC.smooth>` uses for the genealogy.

    ``gradient=`` names the gradient estimator :class:`~pyro_smc.infer.smc.SMC` uses with this
    resampler (exposed as :attr:`estimator`); it is *not* the ``gradient=`` of
    :class:`~pyro_smc.resamplers.OTResampler`, which says how Sinkhorn is differentiated (see
    :mod:`pyro_smc.resamplers`, "Two meanings of ``gradient=``").

    Args:
        gradient: ``"detach"`` (default; ``None`` means the same), ``"stop_gradient"`` or
            ``"marginal_stop_gradient"``.

            * ``"detach"`` (``GradientEstimator.PATHWISE``): the new log-weights are the
              constants :math:`-\log N`; gradients reach the new particles only through the selected
              particles' values (pathwise), and the resampling terms of the score are dropped.
            * ``"stop_gradient"`` (``GradientEstimator.SCORE``): the same ancestors and the
              same values, but the new log-weights are :math:`\log w_{A_i} - \operatorname{stop\_grad}(\log w_{A_i}) -
              \log N`: :math:`-\log N` in value (bit for bit), with the gradient of the ancestor's
              log-weight. Given such a resampler ``SMC`` detaches the proposal draws and adds
              their score-function terms, so that the gradient of ``log_evidence`` is the
              Fisher-identity estimator of the score (Scibior and Wood, 2021), which also reaches
              the parameters of discrete (non-reparameterised) latent sites. See
              ``docs/math/smc.md#stop-gradient-resampling``.
            * ``"marginal_stop_gradient"`` (``GradientEstimator.MARGINAL_SCORE``): the
              resampler acts as for ``"stop_gradient"`` (same ancestors, values and new
              log-weights); ``SMC`` then replaces each step's single-ancestor transition score by
              the score of the marginal (mixture) transition density
              :math:`\log \sum_j w_{t-1}^j f(x_t^i \mid x_{t-1}^j)`, over all particle pairs: the
              :math:`O(N^2)` estimator of Poyiadjis, Doucet and Singh (2011), whose variance does not
              grow with the number of steps. Bootstrap filters only, :math:`O(B N^2)` memory per
              step. See ``docs/math/smc.md#marginal-stop-gradient``.

    Attributes:
        gradient: the mode given.
        estimator: the :class:`GradientEstimator` it names.

    Returns:
        ``(particles, log_weights)`` when called (the log-weights need not be normalised): each
        state tensor ``(..., N, *event)`` and the normalised new log-weights ``(..., N)``, shaped
        as the inputs; :meth:`resample` returns
        the :class:`~pyro_smc.resamplers.Resampled` with the ancestors as well.

    Raises:
        ValueError: an unknown ``gradient`` mode; at call time, particles whose leading shape is
            not ``log_weights.shape``.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SystematicResampler
        >>> log_w = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_()
        >>> out = SystematicResampler(gradient="stop_gradient").resample(
        ...     {"x": torch.arange(4.0)}, log_w
        ... )
        >>> bool((out.log_weights == -math.log(4)).all()), out.log_weights.requires_grad
        (True, True)
        >>> torch.equal(out.particles["x"], out.ancestors.float())
        True
    """

    #: Draws ancestor indices ``(..., N)`` from normalised log-weights ``(..., N)``.
    scheme: Callable[[Tensor], Tensor] = staticmethod(schemes.systematic)
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
        return _ESTIMATORS[self.gradient]

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        """Draws the ancestors and gathers every state tensor by them (see :meth:`Resampler.resample`)."""
        check_particles(particles, log_weights)
        # The schemes read normalised weights; called directly with unnormalised ones, they copied
        # the first particle every time. The shift is constant for autograd: normalised weights
        # (every call from SMC) keep their values and gradients exactly.
        log_weights = log_weights - log_weights.detach().logsumexp(-1, keepdim=True)
        index = self.scheme(log_weights)
        if self.gradient in ("stop_gradient", "marginal_stop_gradient"):
            return Resampled(gather(particles, index), schemes.stop_gradient_log_weights(log_weights, index), index)
        return Resampled(gather(particles, index), torch.full_like(log_weights, -math.log(log_weights.shape[-1])), index)


def index_scheme(resampler: object) -> tuple[int, bool, int] | None:
    """How a replayed step of :class:`~pyro_smc.SMC` may resample without calling ``resampler``,
    by :func:`~pyro_smc.ops.resample.resample_where`: ``(scheme code, stop_gradient, search
    threshold)`` for the four index resamplers of this module as they are (``gradient=`` of
    ``"detach"`` or ``"stop_gradient"``; no subclass's own ``resample``); ``None`` for any other
    resampler, which the engine calls.

    Example:
        >>> from pyro_smc.resamplers import OTResampler, SystematicResampler
        >>> index_scheme(SystematicResampler()), index_scheme(OTResampler())
        ((0, False, 400), None)
    """
    if not isinstance(resampler, IndexResampler) or type(resampler).resample is not IndexResampler.resample:
        return None
    code = _SCHEME_CODES.get(resampler.scheme)
    if code is None or resampler.gradient not in ("detach", "stop_gradient"):
        return None
    return code, resampler.gradient == "stop_gradient", schemes._SEARCH_BELOW


class MultinomialResampler(IndexResampler):
    r"""Multinomial resampling: ancestors drawn i.i.d. from the weights.

    The highest-variance scheme of the three: each particle's number of copies is
    :math:`\operatorname{Binomial}(N, w_i)`. Arguments, returns and ``gradient=`` as for :class:`IndexResampler`.

    Example:
        Each particle's number of copies is on average :math:`N w_i`:

        >>> import torch
        >>> from pyro_smc.resamplers import MultinomialResampler
        >>> _ = torch.manual_seed(0)
        >>> w = torch.tensor([0.5, 0.3, 0.2, 0.0])
        >>> out = MultinomialResampler().resample(
        ...     {"x": torch.arange(4.0).expand(2000, 4)}, w.log().expand(2000, 4)
        ... )
        >>> # (2000, 4)
        >>> copies = torch.stack(
        ...     [(out.particles["x"] == i).sum(-1) for i in range(4)], -1
        ... ).float()
        >>> # N w = (2, 1.2, 0.8, 0), s.e. <= 0.03
        >>> bool(((copies.mean(0) - 4 * w).abs() < 0.1).all())
        True
        >>> out.ancestors.shape, out.log_weights.shape  # (R, N) ancestors, equal weights
        (torch.Size([2000, 4]), torch.Size([2000, 4]))
    """

    scheme = staticmethod(schemes.multinomial)


class ResidualResampler(IndexResampler):
    r"""Residual resampling: :math:`\lfloor N w_i \rfloor` copies of each particle for certain, the
    remaining :math:`R` drawn multinomially from the residual weights (Liu and Chen, 1998; the
    ``"residual"`` scheme of ``particles``).

    Each particle's number of copies has mean :math:`N w_i` and the variance of a multinomial
    draw of :math:`R` from the residuals, never more than multinomial resampling's. Arguments,
    returns and ``gradient=`` as for :class:`IndexResampler`.

    Example:
        A particle of weight :math:`w_i \ge k / N` always keeps at least :math:`k` copies:

        >>> import torch
        >>> from pyro_smc.resamplers import ResidualResampler
        >>> _ = torch.manual_seed(0)
        >>> w = torch.tensor([0.6, 0.3, 0.1, 0.0]).expand(1000, 4)
        >>> x = torch.arange(4.0).expand(1000, 4)
        >>> out = ResidualResampler().resample({"x": x}, w.log())
        >>> # (1000, 4)
        >>> copies = torch.stack([(out.ancestors == i).sum(-1) for i in range(4)], -1)
        >>> copies.min(0).values.tolist()  # floor(N w) = 2, 1, 0, 0
        [2, 1, 0, 0]
        >>> # mean N w, s.e. <= 0.02
        >>> bool(((copies.float().mean(0) - 4 * w[0]).abs() < 0.1).all())
        True
    """

    scheme = staticmethod(schemes.residual)


class StratifiedResampler(IndexResampler):
    """Stratified resampling: one uniform per stratum :math:`[(i-1)/N, i/N)`.

    Arguments, returns and ``gradient=`` as for :class:`IndexResampler`.

    Example:
        With equal weights every stratum holds exactly one particle's share, so each particle is
        kept once (multinomial resampling would duplicate some and drop others):

        >>> import torch
        >>> from pyro_smc.resamplers import StratifiedResampler
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(8, 2)                                                # (N, d)
        >>> out = StratifiedResampler().resample({"x": x}, torch.full((8,), 1 / 8).log())
        >>> torch.equal(out.ancestors.sort().values, torch.arange(8))
        True
        >>> (
        ...     torch.equal(out.particles["x"], x[out.ancestors]),
        ...     torch.allclose(out.log_weights.exp(), torch.full((8,), 1 / 8)),
        ... )
        (True, True)
    """

    scheme = staticmethod(schemes.stratified)


class SystematicResampler(IndexResampler):
    r"""Systematic resampling: one shared uniform; the lowest variance of the three and the default
    of :class:`~pyro_smc.SMC`.

    Arguments, returns and ``gradient=`` as for :class:`IndexResampler`;
    ``SMC(..., resampler=SystematicResampler(gradient="stop_gradient"))`` makes the gradient of
    ``log_evidence`` the Fisher-identity score estimator.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SystematicResampler
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(1000, 2), torch.randn(1000).log_softmax(-1)   # (N, d), (N,)
        >>> new, new_log_w = SystematicResampler()({"x": x}, log_w)
        >>> new["x"].shape, new_log_w.shape
        (torch.Size([1000, 2]), torch.Size([1000]))
        >>> mean = (log_w.exp()[:, None] * x).sum(0)  # weighted mean kept
        >>> torch.allclose((new_log_w.exp()[:, None] * new["x"]).sum(0), mean, atol=0.1)
        True

        Each particle is copied :math:`\lfloor N w \rfloor` or :math:`\lceil N w \rceil` times:

        >>> w = torch.tensor([0.1, 0.2, 0.3, 0.4])
        >>> out = SystematicResampler().resample({"x": torch.arange(4.0)}, w.log())
        >>> counts = torch.bincount(out.ancestors, minlength=4)
        >>> bool(((counts - 4 * w).abs() < 1).all())
        True
    """

    scheme = staticmethod(schemes.systematic)


_SCHEME_CODES = {getattr(schemes, name): code for name, code in schemes.SCHEMES.items()}
