r"""Diffusion resampling (Andersson and Zhao, 2026): equally weighted particles from a reverse
diffusion whose score is the weighted particles' own (ensemble) score.

The mathematics is in :mod:`pyro_smc.ops.diffusion`.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers.diffusion import DiffusionResampler
    >>> out = DiffusionResampler().resample(
    ...     {"x": torch.randn(4, 100, 2)}, torch.randn(4, 100).log_softmax(-1)
    ... )
    >>> out.particles["x"].shape, out.ancestors is None, out.diagnostics is None
    (torch.Size([4, 100, 2]), True, True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from pyro_smc.ops import resample as schemes
from pyro_smc.ops.diffusion import DiffusionResult, DiffusionSettings, check_settings, diffusion_resample
from pyro_smc.ops.weights import check_log_weights
from pyro_smc.resamplers.base import Particles, Resampled, Resampler, check_particles, flatten_floats, gather, unflatten_floats

__all__ = ["DiffusionResampler"]


class DiffusionResampler(Resampler):
    r"""Differentiable resampling by a reverse diffusion with the ensemble score.

    The floating-point state tensors are flattened per particle and concatenated into one point
    cloud :math:`x_i \in \mathbb R^D` (as :class:`~pyro_smc.resamplers.OTResampler` does). The
    forward Langevin (Ornstein-Uhlenbeck) process towards a Gaussian reference, started at the
    weighted particles, has an exactly computable score (the *ensemble score* of the Gaussian
    mixture it makes of them), and new, equally weighted particles are reference draws carried
    back by the reverse-time SDE with that score (:func:`~pyro_smc.ops.diffusion.diffusion_resample`).
    Nothing is trained or solved to a tolerance; for fixed noise the map is smooth in the
    particles and the log-weights, so the estimator is ``PATHWISE`` and gradients flow through
    the new particles.

    **What it targets.** With exact integration the new particles would be a multinomial draw
    from the weighted particles; the integrator's finite step :math:`h = b^2 T / K` is the
    smoothing that makes the map differentiable. With the default Euler-Maruyama integrator the
    new cloud is roughly the weighted cloud blurred by a Gaussian of variance at most :math:`h`
    times the weighted covariance, with the mass of each mode kept (measured: the covariance
    10 to 12% too large at the default :math:`h = 1/2`, within 2.5% at :math:`h = 1/16`); with
    ``"sde"`` or ``"ode"`` the last step is Tweedie's posterior mean, so every new particle is a
    convex combination of old ones and the cloud is *shrunk* instead (by 42 to 53% at
    :math:`h = 1/2`, 4 to 15% at :math:`h = 1/16`). Both biases vanish as :math:`h \to 0`, and so
    does a shift of the weighted mean, which is first order in :math:`h` too (measured, ``N = 100``,
    weights ``softmax(2 x)`` of standard normal ``x``, 2000 clouds: -2.2% of the weighted standard
    deviation at the default, about -0.5% at :math:`h = 1/16`; +1.6% with ``"sde"``, +1.1% with
    ``"ode"``, -12% with ``reference="standard"``). Jittered particles can also leave a latent
    site's support (a probability vector off the simplex, a positive quantity below zero): use
    it for unconstrained states. Inside :class:`~pyro_smc.SMC` the filter is
    therefore consistent in ``N`` only as :math:`h \to 0` too (the paper's consistency result is
    for the exact reverse process).

    **Gradients.** The same :math:`h` sets the gradient's size: the map's Jacobian grows like
    :math:`1/h` where a new particle ends between old ones, and in a filter that resamples at
    every step these Jacobians multiply. In the setting of tutorial 01's comparison (a two-dimensional
    linear-Gaussian model, :math:`N = 100`, 200 filters) :math:`h = 1/16` (16 steps,
    :math:`b^2 T = 1`, this class's earlier default) gave a median error of the gradient of
    :math:`\log \hat Z` of 158 at 25 steps and :math:`1.4 \cdot 10^5` at 100 (score norms 9.4 and
    39.5), growing by about 9% per step. At the default :math:`h = 1/2` (8 steps,
    :math:`b^2 T = 4`; the authors' linear-Gaussian experiments ran :math:`h` from 1/16 to 3/2) the
    bias and standard deviation at 100 steps were 15.0 and 45.9, against 19.1 and 28.5 for
    :class:`~pyro_smc.resamplers.OTResampler` with :math:`\varepsilon = 0.5`. The contraction
    needs particles close together relative to their spread: with :math:`N = 50` and :math:`25`
    the default's gradient blew up too (standard deviation 1251; mean off by
    :math:`10^6`). A wider step helps somewhat there (:math:`h = 1` at :math:`N = 50`); a smaller
    :math:`h` (more steps, a shorter horizon) is usable where the filter resamples rarely or the
    sequence is short. See ``docs/math/smc.md#diffusion-resampling``.

    **Non-floating state** (integer or bool tensors, e.g. a regime label) is not moved: each new
    particle ``j`` draws one ancestor from its last-step weights :math:`\alpha_{j\cdot}` (the
    posterior over which old particle it came from; detached) and every non-floating tensor
    takes that ancestor's value. A state with no floating tensor is resampled by multinomial
    resampling.

    **Cost.** :math:`O(K N^2 D)` time per filter and call (``K`` denoiser evaluations, each
    every pair of new and old particles); the backward pass keeps :math:`O(K N^2)` numbers.

    Args:
        num_steps: reverse-time steps ``K >= 1``. At fixed ``time``, more steps: less bias, sharper
            (higher-variance) gradients, proportionally more time.
        dispersion: the dispersion ``b > 0`` of the forward process.
        time: the horizon ``T > 0``. On the uniform grid only :math:`b^2 T` matters; with the
            reference fitted to the particles' moments a short horizon suffices (the start
            matches the first two moments for every ``T``).
        integrator: ``"euler"`` (Euler-Maruyama, default), ``"sde"`` (exponential integrator of
            the reverse SDE) or ``"ode"`` (probability flow); see
            :data:`~pyro_smc.ops.diffusion.INTEGRATORS`.
        reference: ``"fitted"`` (Gaussian with the weighted mean and covariance, default) or
            ``"standard"`` (:math:`\mathcal N(0, I)`).

    Returns:
        ``(particles, log_weights)`` when called: each state tensor ``(..., N, *event)`` and the
        normalised new log-weights :math:`-\log N` ``(..., N)``. :meth:`resample` returns a
        :class:`~pyro_smc.resamplers.Resampled` with ``ancestors`` and ``diagnostics`` ``None``.

    Raises:
        ValueError: a setting out of range, naming it (``num_steps < 1``, a non-positive
            ``dispersion`` or ``time``, an unknown ``integrator`` or ``reference``); at call time,
            mismatched particle shapes or invalid log-weights.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers.diffusion import DiffusionResampler
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(1000, 2, requires_grad=True)               # (N, D)
        >>> log_w = torch.randn(1000).log_softmax(-1)
        >>> new, new_log_w = DiffusionResampler()({"x": x}, log_w)
        >>> mean = (log_w.exp()[:, None] * x).sum(0)                   # kept to O(h)
        >>> bool((new["x"].mean(0) - mean).abs().max() < 0.15)
        True
        >>> new["x"].sum().backward()                                  # pathwise gradient
        >>> bool(x.grad.abs().sum() > 0)
        True

    Reference:
        J. R. Andersson, Z. Zhao (2026). Diffusion differentiable resampling. ICML.
        arXiv:2512.10401.
    """

    def __init__(self, num_steps: int = 8, dispersion: float = 1.0, time: float = 4.0, integrator: str = "euler", reference: str = "fitted"):
        self.settings = check_settings(num_steps, dispersion, time, integrator, reference)

    num_steps = property(lambda self: self.settings.num_steps, doc="Reverse-time steps.")
    dispersion = property(lambda self: self.settings.dispersion, doc="Dispersion of the forward process.")
    time = property(lambda self: self.settings.time, doc="Horizon of the forward process.")
    integrator = property(lambda self: self.settings.integrator, doc="The reverse-time integrator.")
    reference = property(lambda self: self.settings.reference, doc="The Gaussian reference.")

    def __repr__(self) -> str:
        s = self.settings
        return f"DiffusionResampler(num_steps={s.num_steps!r}, dispersion={s.dispersion!r}, time={s.time!r}, integrator={s.integrator!r}, reference={s.reference!r})"

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        """Carries reference draws back by the reverse diffusion (see :meth:`Resampler.resample`)."""
        check_particles(particles, log_weights)
        check_log_weights(log_weights)
        n = log_weights.shape[-1]
        uniform = torch.full_like(log_weights, -math.log(n))
        x, floats = flatten_floats(particles, log_weights)
        if not floats:
            index = schemes.multinomial(log_weights)
            return Resampled(gather(particles, index), uniform, index)
        out = _resample_recomputed(x, log_weights, self.settings)
        new = unflatten_floats(out.particles, floats)
        others = {k: v for k, v in particles.items() if k not in floats}
        if others:
            new.update(gather(others, _row_draws(out.log_alpha.detach())))
        return Resampled({k: new[k] for k in particles}, uniform)


def _resample_recomputed(x: Tensor, log_weights: Tensor, settings: DiffusionSettings) -> DiffusionResult:
    """:func:`diffusion_resample`, its ``K`` steps recomputed in the backward pass instead of kept.

    Every step's ``(N, N)`` weights would otherwise stay alive for as long as the filter's graph
    does: ``K`` of them per resampling, gigabytes over a long run. With the noise drawn here and
    kept, the recomputation is the same map.
    """
    noise = torch.randn((settings.num_steps + 1,) + x.shape, dtype=x.dtype, device=x.device)
    if not (torch.is_grad_enabled() and (x.requires_grad or log_weights.requires_grad)):
        return diffusion_resample(x, log_weights, noise, **settings._asdict())
    return DiffusionResult(*_Recomputed.apply(x, log_weights, noise, settings))


class _Recomputed(torch.autograd.Function):
    """The map of :func:`diffusion_resample` with only its inputs and noise saved for backward."""

    @staticmethod
    def forward(ctx, x: Tensor, log_weights: Tensor, noise: Tensor, settings: DiffusionSettings) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x, log_weights, noise)
        ctx.settings = settings
        out = diffusion_resample(x, log_weights, noise, **settings._asdict())
        return out.particles, out.log_alpha

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_particles: Tensor, grad_log_alpha: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, log_weights, noise = ctx.saved_tensors
        with torch.enable_grad():
            inputs = (x.detach().requires_grad_(ctx.needs_input_grad[0]), log_weights.detach().requires_grad_(ctx.needs_input_grad[1]))
            out = diffusion_resample(*inputs, noise, **ctx.settings._asdict())
            wanted = [i for i in range(2) if ctx.needs_input_grad[i]]
            grads = torch.autograd.grad(out, [inputs[i] for i in wanted], (grad_particles, grad_log_alpha), allow_unused=True)
        result: list[Tensor | None] = [None, None, None, None]
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)


def _row_draws(log_alpha: Tensor) -> Tensor:
    """One index per row of ``log_alpha`` ``(..., N, N)``, drawn from the row's weights.

    Inverse CDF at ``u`` in ``(0, row_sum]``, the first index whose cumulative mass reaches it:
    a zero-mass column repeats the sum before it and is never chosen.
    """
    cdf = log_alpha.exp().cumsum(-1)
    u = (1 - torch.rand(cdf.shape[:-1] + (1,), dtype=cdf.dtype, device=cdf.device)) * cdf[..., -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
