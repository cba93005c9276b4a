r"""Kernel (mixture) resampling (Younis and Sudderth, 2023): new particles drawn from a Gaussian
kernel density around the weighted particles, with new log-weights :math:`-\log N` in value that carry
the gradient of the mixture density (a regularised filter).

See ``docs/math/smc.md#kernel-mixture-resampling``.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import KernelResampler
    >>> out = KernelResampler(bandwidth=0.1).resample(
    ...     {"x": torch.zeros(5, 2)}, torch.zeros(5).log_softmax(-1)
    ... )
    >>> out.particles["x"].shape, out.ancestors is None
    (torch.Size([5, 2]), True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_smc.ops import resample as schemes
from pyro_smc.ops.weights import check_log_weights
from pyro_smc.resamplers.base import Particles, Resampled, Resampler, check_particles, flatten_floats, gather, unflatten_floats

__all__ = ["KernelResampler"]

_KERNEL_SCHEMES = {"systematic": schemes.systematic, "multinomial": schemes.multinomial}


class KernelResampler(Resampler):
    r"""Kernel (mixture) resampling: draws from a Gaussian kernel density of the weighted particles.

    The Mixture Density Particle Filter resampler of Younis and Sudderth (2023). The floating-point
    state tensors are flattened per particle and concatenated into :math:`x_j` (length ``D``); the
    weighted particles define the mixture :math:`m(x) = \sum_j w_j \mathcal N(x; x_j, \operatorname{diag}(h^2))`. The new
    particles are :math:`\tilde x_i = x_{A_i} + h \odot \epsilon_i` with :math:`\epsilon_i \sim \mathcal N(0, I)` and ancestors :math:`A_i`
    drawn from the weights by ``scheme``, all of it detached (no pathwise gradient), and the new
    log-weights are

        :math:`\log m(\tilde x_i) - \operatorname{stop\_grad}(\log m(\tilde x_i)) - \log N`:

    exactly :math:`-\log N` in value, while in autograd they carry the gradient of the mixture density
    at the drawn points with respect to the old log-weights, the old particles and ``h``.

    **What is unbiased.** Every new particle has marginal (averaged over ``i``, for systematic
    ancestors) law ``m``, so :math:`\sum_i \exp(\widetilde{lw}_i) f(\tilde x_i)` is an unbiased estimate of :math:`\mathbb E_m[f]`, and
    its autograd gradient, :math:`(1/N) \sum_i f(\tilde x_i) \, d \log m(\tilde x_i)`, is an unbiased estimate of
    :math:`d \mathbb E_m[f] / d\theta` (the score identity :math:`\mathbb E_m[f \, d \log m] = d \mathbb E_m[f]`; the paper's
    importance-weighted sample gradient). What is *not* unbiased: ``m`` is not the weighted
    particle measure but that measure convolved with the kernel. Each resampling adds :math:`h^2`
    to the covariance of the particle cloud, so inside :class:`~pyro_smc.infer.smc.SMC` this is
    a regularised particle filter: its filtering means, covariances and ``log_evidence`` target
    a slightly different (jittered) model, with a bias that vanishes as :math:`h \to 0`; but the
    gradient's standard deviation grows like :math:`1/h` (the score of the kernel with respect to a
    particle is :math:`\epsilon / h`). The forward pass is a valid particle filter only for that jittered
    model: for a linear-Gaussian model resampled at every step, the one with transition
    covariance :math:`Q + A \operatorname{diag}(h^2) A^\top`. The Gaussian jitter ignores a latent
    site's support: a probability vector can leave the simplex and a positive quantity go below
    zero (the next step's transition is then evaluated outside its support), so use it for
    unconstrained states.

    **Non-floating state** (integer or bool tensors, e.g. a regime label) is copied from the
    ancestor: its kernel is a point mass. The mixture density at :math:`\tilde x_i` then only sums over
    the particles whose labels equal the new particle's (every such key), as the density of the
    joint mixture requires. With no floating-point state at all the new log-weights still carry
    the gradient of the mass of the drawn labels.

    **Cost.** :math:`O(N^2 D)` time and :math:`O(N^2)` memory per filter and call (every pair of new and
    old particles), vectorised over the leading (filter) dimensions. See
    ``docs/math/smc.md#kernel-mixture-resampling``.

    Args:
        bandwidth: the kernel standard deviation ``h`` in the units of the state: a float
            ``> 0`` (the same in every coordinate); a positive tensor of shape ``()`` or ``(D,)``
            (per coordinate of the concatenated state), which may require grad (e.g. an
            ``nn.Parameter``, then checked at every call); or ``"silverman"``: per coordinate
            :math:`h_k = \sigma_k (4 / ((D + 2) n_{\mathrm{eff}}))^{1/(D + 4)}` with :math:`\sigma_k` the weighted
            standard deviation and :math:`n_{\mathrm{eff}} = 1 / \sum_j w_j^2`, differentiated with the rest (a
            coordinate in which every particle of positive weight agrees gets :math:`h_k = 0`: it is
            copied, a point mass). Default ``"silverman"``.
        scheme: how the ancestors are drawn, ``"systematic"`` (default: the lowest-variance
            unbiased scheme, so the new cloud covers the mixture components in proportion to
            their weights; the particles are then not independent, but each sum over them is
            still unbiased for ``m``) or ``"multinomial"`` (:math:`\tilde x_i` i.i.d. from ``m``).

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import KernelResampler
        >>> x = torch.randn(4, 100, 2, requires_grad=True)            # 4 filters, 100 particles
        >>> log_w = torch.randn(4, 100).log_softmax(-1)
        >>> new, new_log_w = KernelResampler(bandwidth=0.1)(
        ...     {"x": x, "k": torch.zeros(4, 100).long()}, log_w
        ... )
        >>> new["x"].shape, new["x"].requires_grad, bool((new_log_w == -math.log(100)).all())
        (torch.Size([4, 100, 2]), False, True)
        >>> torch.autograd.grad(new_log_w.sum(), x)[0].abs().sum() > 0  # the mixture's gradient
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
        """Resamples and moves the particles by the kernel (see :meth:`Resampler.resample`)."""
        check_particles(particles, log_weights)
        check_log_weights(log_weights)
        # Direct calls may pass them unnormalised; a constant shift for autograd, as in index.py.
        log_weights = log_weights - log_weights.detach().logsumexp(-1, keepdim=True)
        batch, n = log_weights.shape, log_weights.shape[-1]
        x, floats = flatten_floats(particles, log_weights)
        others = {k: v for k, v in particles.items() if k not in floats}
        h = self._bandwidth(x, log_weights)
        index = _KERNEL_SCHEMES[self.scheme](log_weights)
        with torch.no_grad():
            ancestors = gather({"x": x}, index)["x"]
            x_new = ancestors + h.unsqueeze(-2) * torch.randn_like(ancestors)
        out = gather(others, index)
        allowed = None
        for key, value in others.items():
            # Pairs (new i, old j) whose labels agree in every coordinate of this key.
            same = out[key].reshape(batch + (1, -1)) == value.reshape(batch[:-1] + (1, n, -1))
            same = same.all(-1)
            allowed = same if allowed is None else allowed & same
        log_m = schemes.kernel_mixture_log_density(x_new, x, log_weights, h, allowed)
        delta = log_m - log_m.detach()
        # Only a drawn ancestor of zero weight (a rounding clamp) can leave log m = -inf.
        delta = torch.where(torch.isfinite(log_m), delta, torch.zeros_like(delta))
        out.update(unflatten_floats(x_new, floats))
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
