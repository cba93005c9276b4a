r"""Resamplers: weighted particles in, (re)weighted particles out, all with one signature.

See ``docs/math/smc.md#index-resampling`` and ``docs/math/smc.md#soft-resampling`` and
``docs/math/smc.md#optimal-transport-resampling`` and ``docs/math/smc.md#kernel-mixture-resampling``.

Every resampler is a :class:`Resampler` (``pyro_smc.resamplers.base``) and a callable::

    resampler(particles: dict[str, Tensor], log_weights: Tensor) -> (dict[str, Tensor], Tensor)
    resampler.resample(particles, log_weights) -> Resampled(particles, log_weights, ancestors, diagnostics)

``log_weights`` are normalised over their last dimension (the particle dimension, size ``N``);
its leading dimensions are independent filters. Each state tensor has shape
``log_weights.shape + event_shape``. The returned log-weights are normalised. What a call found
(the ancestors it drew, a solver's diagnostics) comes back in the :class:`Resampled`; a
resampler keeps no record of its last call.

* :class:`MultinomialResampler`, :class:`ResidualResampler`, :class:`StratifiedResampler`,
  :class:`SystematicResampler` (``pyro_smc.resamplers.index``, shared docs on :class:`IndexResampler`): unbiased index
  resampling; they return ancestors.
* :class:`SoftResampler` (``pyro_smc.resamplers.soft``): Karkus et al. (2018); keeps part
  of the weight gradient.
* :class:`OTResampler` (``pyro_smc.resamplers.ot``): the differentiable ensemble transform
  of Corenflos et al. (2021), an entropy-regularised optimal-transport map that is smooth in
  particles and weights. Integer state (e.g. a regime label) is not averaged: the transport
  runs within each label, and systematic resampling over the labels sets their offspring. Its
  ``Resampled.diagnostics`` is the Sinkhorn solve's
  :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` (whether each filter's transport converged).
* :class:`DiffusionResampler` (``pyro_smc.resamplers.diffusion``): diffusion resampling
  (Andersson and Zhao 2026): reference draws carried back by a reverse-time diffusion whose score
  is the weighted particles' own (ensemble) score; smooth in particles and weights for fixed
  noise (pathwise), no solver.
* :class:`KernelResampler` (``pyro_smc.resamplers.kernel``): the mixture resampling of
  Younis and Sudderth (2023): new particles drawn from a Gaussian kernel density around the
  weighted particles, with new log-weights :math:`-\log N` in value that carry the gradient of the
  mixture density (a regularised filter).

**Two meanings of** ``gradient=``. The keyword is kept on two families, with two meanings, and
each class says which it has:

* on the index resamplers it selects the **SMC gradient estimator**, read by the engine from
  the ``Resampler.estimator`` property (a :class:`GradientEstimator`): ``"detach"``
  (``PATHWISE``, the default), ``"stop_gradient"`` (``SCORE``: the Fisher-identity estimator
  of Scibior and Wood, 2021) or ``"marginal_stop_gradient"`` (``MARGINAL_SCORE``: the
  :math:`O(N^2)` estimator of Poyiadjis, Doucet and Singh, 2011); see :class:`IndexResampler` and
  ``docs/math/smc.md#stop-gradient-resampling``;
* on :class:`OTResampler` it says **how Sinkhorn is differentiated**: ``"implicit"`` (exact,
  the default), ``"unroll"`` or ``"last_step"`` (``pyro_smc.ops.sinkhorn.GRADIENT_MODES``,
  ``docs/math/smc.md#gradient-modes``); its estimator is always ``PATHWISE``.

The soft, kernel and diffusion resamplers take no ``gradient=``; their estimator is ``PATHWISE``.

Where to add a resampler: one module of this package with one :class:`Resampler` subclass
whose :meth:`~Resampler.resample` returns a :class:`Resampled` (ancestors when it copies
particles, diagnostics when it runs a solver) and whose class attributes (``estimator``,
``draws_ancestors``, ``reports_convergence``) tell the engine what to expect; export it here.
No edit to ``SMC``.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import OTResampler
    >>> particles = {"x": torch.randn(4, 100, 2)}               # 4 filters, 100 particles
    >>> log_w = torch.randn(4, 100).log_softmax(-1)
    >>> new, new_log_w = OTResampler(epsilon=0.5)(particles, log_w)
    >>> new["x"].shape, bool(torch.allclose(new_log_w.exp().sum(-1), torch.ones(4)))
    (torch.Size([4, 100, 2]), True)
    >>> out = OTResampler(epsilon=0.5).resample(particles, log_w)
    >>> out.diagnostics.converged.shape, out.diagnostics.num_iterations.dtype
    (torch.Size([4]), torch.int64)

    Stop-gradient resampling: uniform weights in value, the ancestors' weight gradient in autograd.

    >>> import math
    >>> from pyro_smc.resamplers import SystematicResampler
    >>> log_w = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_()
    >>> new, new_log_w = SystematicResampler(gradient="stop_gradient")(
    ...     {"x": torch.arange(4.0)}, log_w
    ... )
    >>> bool((new_log_w == -math.log(4)).all()), new_log_w.requires_grad
    (True, True)
"""

from pyro_smc.resamplers.base import GradientEstimator, Resampled, Resampler, estimator_of, resample
from pyro_smc.resamplers.index import INDEX_GRADIENT_MODES, IndexResampler, MultinomialResampler, ResidualResampler, StratifiedResampler, SystematicResampler
from pyro_smc.resamplers.diffusion import DiffusionResampler
from pyro_smc.resamplers.kernel import KernelResampler
from pyro_smc.resamplers.ot import OTResampler
from pyro_smc.resamplers.soft import SoftResampler

__all__ = [
    "INDEX_GRADIENT_MODES",
    "GradientEstimator",
    "Resampled",
    "Resampler",
    "resample",
    "estimator_of",
    "IndexResampler",
    "MultinomialResampler",
    "ResidualResampler",
    "StratifiedResampler",
    "SystematicResampler",
    "SoftResampler",
    "OTResampler",
    "KernelResampler",
    "DiffusionResampler",
]
