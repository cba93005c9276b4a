r"""Diffusion resampling: weighted particles to equally weighted ones by a reverse diffusion.

The resampler of Andersson and Zhao (2026) written from its mathematics. Let
:math:`\pi_N = \sum_i w_i \delta_{x_i}` be the weighted particles in :math:`\mathbb R^D`, and
:math:`\mathcal N(m, \Sigma)` a Gaussian reference, :math:`\Sigma = L L^\top`. In the whitened
coordinates :math:`z = L^{-1}(x - m)` the forward Langevin process towards the reference is the
Ornstein-Uhlenbeck process

.. math::

    dZ_t = -\tfrac{b^2}{2} Z_t \, dt + b \, dW_t, \qquad
    Z_t \mid Z_0 \sim \mathcal N(a_t Z_0, \sigma_t^2 I), \quad
    a_t = e^{-b^2 t / 2}, \quad \sigma_t^2 = 1 - e^{-b^2 t},

with dispersion :math:`b`. Started at :math:`\pi_N`, its marginal :math:`p_t` is the Gaussian
mixture :math:`\sum_i w_i \mathcal N(a_t z_i, \sigma_t^2 I)`, whose score is the *ensemble score*

.. math::

    s_N(z, t) = \sum_i \alpha_i(z, t) \frac{a_t z_i - z}{\sigma_t^2}
      = \frac{a_t \hat z_0(z, t) - z}{\sigma_t^2}, \qquad
    \alpha_i(z, t) = \frac{w_i \, \mathcal N(z; a_t z_i, \sigma_t^2 I)}
      {\sum_j w_j \, \mathcal N(z; a_t z_j, \sigma_t^2 I)},

where :math:`\hat z_0 = \sum_i \alpha_i z_i` is the posterior mean of :math:`Z_0` given
:math:`Z_t = z` (Tweedie's formula). The ensemble score is exact for :math:`\pi_N`, so nothing is
trained. The time reversal :math:`U_\tau = Z_{T - \tau}` solves

.. math::

    dU_\tau = \bigl[\tfrac{b^2}{2} U_\tau + b^2 s_N(U_\tau, T - \tau)\bigr] d\tau + b \, dW_\tau,

and resampling draws :math:`U_0` from the reference :math:`\mathcal N(0, I) \approx p_T` and
integrates to :math:`\tau = T` on the uniform grid :math:`t_k = kT/K`, :math:`k = K, \dots, 0`,
with one of three integrators, each with the denoiser frozen over a step (:math:`r = a_t / a_s`
for a step from :math:`t` down to :math:`s`, :math:`\Delta = t - s = T / K`):

* ``"euler"`` (default): Euler-Maruyama, :math:`u_s = u_t + \Delta [\tfrac{b^2}{2} u_t + b^2 s_N(u_t, t)]
  + b \sqrt \Delta \, \varepsilon`;
* ``"sde"``: the exact reverse transition of the Ornstein-Uhlenbeck bridge to :math:`\hat z_0`,
  :math:`u_s = \frac{a_s (1 - r^2)}{\sigma_t^2} \hat z_0 + \frac{r \sigma_s^2}{\sigma_t^2} u_t
  + \sqrt{\sigma_s^2 (1 - r^2) / \sigma_t^2} \, \varepsilon` (an exponential integrator; exact when
  the denoiser is, and it keeps the mean: if :math:`u_t \sim p_t` then
  :math:`\mathbb E u_s = a_s \sum_i w_i z_i`);
* ``"ode"``: the same for the probability-flow ODE,
  :math:`u_s = a_s \hat z_0 + \sigma_s (u_t - a_t \hat z_0) / \sigma_t` (deterministic given
  :math:`u_T`).

At the last step (:math:`s = 0`) the ``"sde"`` and ``"ode"`` updates are Tweedie's, :math:`u_0 = \hat z_0`,
so the new particle is the convex combination

.. math::

    \tilde x_j = \sum_i \alpha_i(u_j, t_1) \, x_i ;

Euler's last update is :math:`\hat z_0` (to first order) plus its increment :math:`r_j`, and the new
particle is :math:`\sum_i \alpha_i x_i + L r_j`. Either way the map is smooth in the particles and
the log-weights for fixed noise (pathwise differentiable).

**Reference.** ``"fitted"`` (default): :math:`m, \Sigma` are the weighted mean and covariance
of the particles (plus a jitter of :math:`\sqrt{\epsilon_{\mathrm{mach}}}` times their mean
variance), so that :math:`p_T` has exactly the reference's mean and covariance for every
:math:`T` and only its higher cumulants, of order :math:`a_T^3`, differ from the Gaussian the
reverse process starts from; a short horizon then suffices. :math:`m` and :math:`L` are
differentiated with the rest. ``"standard"``: :math:`m = 0, L = I` (the plain process towards
:math:`\mathcal N(0, I)`; it needs :math:`b^2 T` large enough that :math:`p_T \approx \mathcal N(0, I)`).

**Errors.** Three sources: the start (:math:`\mathcal N(0, I)` for :math:`p_T`), the frozen
denoiser within a step, and the last step. Tweedie's last step averages the particles within
about :math:`\sigma_{t_1}` whitened units of :math:`u`, and each exponential step before it drops
the variance of that average (:math:`c_1^2 \operatorname{Cov}_\alpha(z)` with :math:`c_1` the
coefficient of :math:`\hat z_0`), so ``"sde"`` and ``"ode"`` shrink the covariance, by about
:math:`(b^2 T / K)(1 + \log K)` of the reference's. Euler's last increment adds back a Gaussian
blur of variance at most :math:`b^2 T / K` of the reference's; measured on a weighted Gaussian
sample (:math:`N = 100`, :math:`b^2 T = 1`, :math:`K = 16`) its covariance error was within
:math:`\pm 2\%`, against :math:`-12` to :math:`-17\%` for ``"sde"``. With the exact score and
:math:`K \to \infty` the output is a draw from :math:`\pi_N` (multinomial resampling), which is
consistent as :math:`N \to \infty`; a finite :math:`K` is the smoothing that makes the map
differentiable, and more steps make its gradients sharper (more variable). Only :math:`b^2 T`
enters the uniform grid: ``dispersion`` and ``time`` act through their product. Cost
:math:`O(K N^2 D)` time per filter.

**Gradients.** The step in units of :math:`b^2`, :math:`h = b^2 \Delta = b^2 T / K`, sets how
smooth the map is. The last step's weights are a softmax of :math:`a_{t_1} u_j \cdot z_i / \sigma_{t_1}^2`, with
:math:`\sigma_{t_1}^2 = 1 - e^{-h} \approx h`, so :math:`\partial \tilde x_j / \partial u_j =
(a_{t_1} / \sigma_{t_1}^2) \operatorname{Cov}_{\alpha_j}(x, z)`: where :math:`u_j` lies between
old particles a whitened distance :math:`d` apart this is about :math:`d^2 / (4 h)`, and the
steps before it compound such factors. As :math:`h \to 0` the map tends to a multinomial draw,
piecewise constant with jumps, so its derivative is unbounded near the switches: the expansion
is a property of the method, traded against its bias by :math:`h`. In a filter that resamples at
every step the particles' tangent is multiplied at each step by the transition's Jacobian times
this map's (through the particles and, via the observation density, the log-weights); once that
product expands, gradients grow geometrically in the number of steps. Measured on a
two-dimensional linear-Gaussian model (transition :math:`0.75 I`, observation noise
:math:`0.1 I`, :math:`N = 100`, ESS about 9 before each resampling; six runs): at :math:`h = 1/16`
(:math:`K = 16`, :math:`b^2 T = 1`) the spectral radius of that one-step product was 0.92 to 1.32
(median over steps) and the median error of the gradient of :math:`\log \hat Z` over 200 filters
grew by about 9% per step (:math:`1.4 \cdot 10^5` at :math:`T = 100` against a score of norm 40);
at the default :math:`h = 1/2` it was 0.60 to 0.71 (OT resampling with :math:`\varepsilon = 0.5`:
0.48 to 0.56) and the gradient stayed of the score's size. With fewer particles the old ones lie
farther apart and the factors grow: at :math:`N = 50` and :math:`25` the default's gradient
grew too. The default's price is a wider blur (Euler) or stronger shrinkage (``"sde"``,
``"ode"``): on the weighted Gaussian sample above (100 filters, two seeds)
the trace of the resampled covariance was 10 to 12% above the weighted one for Euler at
:math:`h = 1/2` (within 2.5% at :math:`h = 1/16`), and 42 to 53% below it for the other two, which
therefore suit small :math:`h` (short horizons, rare resampling) only. Derivation and numbers:
``docs/math/smc.md#diffusion-resampling``.

Reference:
    J. R. Andersson, Z. Zhao (2026). Diffusion differentiable resampling. ICML.
    arXiv:2512.10401.

Example:
    >>> import torch
    >>> from pyro_smc.ops.diffusion import diffusion_resample
    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(4, 200, 2, dtype=torch.float64, requires_grad=True)  # 4 filters
    >>> log_w = torch.randn(4, 200, dtype=torch.float64).log_softmax(-1)
    >>> out = diffusion_resample(x, log_w)                       # K = 8, b^2 T = 4
    >>> out.particles.shape, out.log_alpha.shape                # (B, N, D), (B, N, N)
    (torch.Size([4, 200, 2]), torch.Size([4, 200, 200]))
    >>> target = (log_w.exp().unsqueeze(-1) * x).sum(-2)          # the weighted mean
    >>> bool((out.particles.mean(-2) - target).abs().max() < 0.3)
    True
    >>> out.particles.sum().backward()                              # pathwise gradient
    >>> x.grad.shape
    torch.Size([4, 200, 2])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "INTEGRATORS",
    "REFERENCES",
    "DiffusionSettings",
    "DiffusionResult",
    "check_settings",
    "fit_reference",
    "ensemble_denoiser",
    "ensemble_score",
    "diffusion_resample",
]

#: The names of the reverse-time integrators, exponential (``"sde"``), probability flow
#: (``"ode"``) and Euler-Maruyama (``"euler"``).
INTEGRATORS = ("sde", "ode", "euler")
#: The names of the Gaussian references, the particles' weighted moments (``"fitted"``) or
#: ``N(0, I)`` (``"standard"``).
REFERENCES = ("fitted", "standard")


class DiffusionSettings(NamedTuple):
    """The settings of :func:`diffusion_resample`, checked by :func:`check_settings`.

    Attributes:
        num_steps: reverse-time steps ``K >= 1`` (the last one is Tweedie's).
        dispersion: the dispersion ``b > 0`` of the forward process.
        time: the horizon ``T > 0``; only ``dispersion**2 * time`` matters. The defaults,
            :math:`b^2 T / K = 1/2`, keep the gradient of a filter that resamples at every step
            bounded (module docstring, *Gradients*).
        integrator: one of :data:`INTEGRATORS`.
        reference: one of :data:`REFERENCES`.

    Example:
        >>> from pyro_smc.ops.diffusion import DiffusionSettings
        >>> DiffusionSettings().num_steps, DiffusionSettings().time
        (8, 4.0)
    """

    num_steps: int = 8
    dispersion: float = 1.0
    time: float = 4.0
    integrator: str = "euler"
    reference: str = "fitted"


class DiffusionResult(NamedTuple):
    """What :func:`diffusion_resample` returns.

    Attributes:
        particles: the new particles ``(..., N, D)``, equally weighted.
        log_alpha: ``(..., N, N)``, row ``j`` the log-weights :math:`\\log \\alpha_i` of the old
            particles in new particle ``j`` (each row normalised): the last step's posterior
            over which old particle new particle ``j`` came from.

    Example:
        >>> import torch
        >>> from pyro_smc.ops.diffusion import diffusion_resample
        >>> out = diffusion_resample(torch.randn(3, 1), torch.zeros(3).log_softmax(-1))
        >>> bool(torch.allclose(out.log_alpha.exp().sum(-1), torch.ones(3)))
        True
    """

    particles: Tensor
    log_alpha: Tensor


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_settings(num_steps: int = 8, dispersion: float = 1.0, time: float = 4.0, integrator: str = "euler", reference: str = "fitted") -> DiffusionSettings:
    """Checks the settings of :func:`diffusion_resample` and returns them as one record.

    Raises:
        ValueError: naming the argument: ``num_steps`` not an integer ``>= 1``, ``dispersion``
            or ``time`` not finite and ``> 0``, an unknown ``integrator`` or ``reference``.

    Example:
        >>> from pyro_smc.ops.diffusion import check_settings
        >>> check_settings(num_steps=0)
        Traceback (most recent call last):
            ...
        ValueError: num_steps must be an integer >= 1, got 0
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    if integrator not in INTEGRATORS:
        raise ValueError(f"integrator must be one of {INTEGRATORS}, got {integrator!r}")
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    return DiffusionSettings(num_steps, _positive("dispersion", dispersion), _positive("time", time), integrator, reference)


def fit_reference(x: Tensor, log_weights: Tensor, reference: str = "fitted") -> tuple[Tensor, Tensor]:
    r"""The reference's mean and Cholesky factor, ``(m (..., D), L (..., D, D))``.

    ``"fitted"``: the weighted mean and covariance of ``x`` ``(..., N, D)`` under the normalised
    ``log_weights`` ``(..., N)``, the covariance plus :math:`\sqrt{\epsilon_{\mathrm{mach}}}` times
    its mean diagonal (so that fewer than ``D + 1`` distinct particles still give a factor), or
    plus ``I`` when every particle of positive weight is at the same point (its scale is then
    arbitrary). ``"standard"``: zeros and the identity.

    Example:
        >>> import torch
        >>> from pyro_smc.ops.diffusion import fit_reference
        >>> x = torch.tensor([[0.0], [2.0]], dtype=torch.float64)
        >>> m, L = fit_reference(x, torch.tensor([0.5, 0.5], dtype=torch.float64).log())
        >>> m.tolist(), round(float(L.squeeze()), 6)
        ([1.0], 1.0)
    """
    m, chol, _ = _fit(x, log_weights, reference)
    return m, chol


def _fit(x: Tensor, log_weights: Tensor, reference: str) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fit_reference` and a bool ``(...)``: whether the weighted particles are one point."""
    d = x.shape[-1]
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    if reference == "standard":
        point = torch.zeros(x.shape[:-2], dtype=torch.bool, device=x.device)
        return x.new_zeros(x.shape[:-2] + (d,)), eye.expand(x.shape[:-2] + (d, d)), point
    w = log_weights.exp().unsqueeze(-1)
    m = (w * x).sum(-2)
    c = x - m.unsqueeze(-2)
    cov = (w * c).transpose(-1, -2) @ c
    scale = cov.diagonal(dim1=-2, dim2=-1).mean(-1)
    point = scale == 0
    jitter = torch.where(point, torch.ones_like(scale), scale * math.sqrt(torch.finfo(x.dtype).eps))
    return m, torch.linalg.cholesky(cov + jitter[..., None, None] * eye), point


def ensemble_denoiser(z: Tensor, particles: Tensor, log_weights: Tensor, t: float, dispersion: float = 1.0) -> tuple[Tensor, Tensor]:
    r"""Tweedie's posterior mean :math:`\hat z_0(z, t)` of the Ornstein-Uhlenbeck process started
    at the weighted particles, and the posterior log-weights :math:`\log \alpha_i(z, t)`.

    Args:
        z: query points ``(..., M, D)``.
        particles: :math:`z_i`, ``(..., N, D)``.
        log_weights: their log-weights ``(..., N)`` (normalised or not; ``-inf`` allowed).
        t: the forward time, ``> 0``.
        dispersion: :math:`b`.

    Returns:
        ``(z0_hat (..., M, D), log_alpha (..., M, N))``, each row of ``log_alpha`` normalised.

    Example:
        >>> import torch
        >>> from pyro_smc.ops.diffusion import ensemble_denoiser
        >>> zi = torch.tensor([[-1.0], [1.0]])
        >>> z0, log_alpha = ensemble_denoiser(torch.zeros(1, 1), zi, torch.zeros(2), t=1.0)
        >>> z0.tolist(), log_alpha.exp().tolist()                 # halfway: both equally likely
        ([[0.0]], [[0.5, 0.5]])
    """
    logits = _logits(z, particles, log_weights, t, dispersion)
    log_alpha = logits.log_softmax(-1)
    return log_alpha.exp() @ particles, log_alpha


def _logits(z: Tensor, particles: Tensor, log_weights: Tensor, t: float, dispersion: float) -> Tensor:
    """``log w_i + log N(z; a_t z_i, sigma_t^2 I)`` up to terms constant in ``i``, ``(..., M, N)``."""
    a = math.exp(-(dispersion**2) * t / 2)
    var = -math.expm1(-(dispersion**2) * t)
    # |z|^2 drops out of the softmax, and the product form has no cancellation between nearby
    # points.
    sq = particles.square().sum(-1).mul(-a * a / (2 * var)).add(log_weights)
    return (z * (a / var)) @ particles.transpose(-1, -2) + sq.unsqueeze(-2)


def ensemble_score(z: Tensor, particles: Tensor, log_weights: Tensor, t: float, dispersion: float = 1.0) -> Tensor:
    r"""The ensemble score :math:`\nabla_z \log \sum_i w_i \mathcal N(z; a_t z_i, \sigma_t^2 I)`.

    Args and shapes as :func:`ensemble_denoiser`; returns ``(..., M, D)``.

    Example:
        >>> import torch
        >>> from pyro_smc.ops.diffusion import ensemble_score
        >>> s = ensemble_score(torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1), t=1.0)
        >>> round(float(s), 4) == round(-1 / (1 - math.exp(-1.0)), 4)     # -z / sigma_t^2
        True
    """
    a = math.exp(-(dispersion**2) * t / 2)
    var = -math.expm1(-(dispersion**2) * t)
    z0, _ = ensemble_denoiser(z, particles, log_weights, t, dispersion)
    return (a * z0 - z) / var


def diffusion_resample(
    x: Tensor,
    log_weights: Tensor,
    noise: Tensor | None = None,
    *,
    num_steps: int = 8,
    dispersion: float = 1.0,
    time: float = 4.0,
    integrator: str = "euler",
    reference: str = "fitted",
) -> DiffusionResult:
    r"""Resamples weighted particles by the reverse diffusion of the module docstring.

    Args:
        x: particles ``(..., N, D)``.
        log_weights: their log-weights ``(..., N)``; normalised here (``-inf`` allowed).
        noise: the standard normal draws ``(num_steps, ..., N, D)``: ``noise[0]`` the reference
            draw :math:`u_T`, ``noise[k]`` the increment of step ``k`` (unused by ``"ode"``; the
            last step has none). Drawn from the global generator when ``None``; given, the map is
            deterministic and smooth in ``x`` and ``log_weights``.
        num_steps, dispersion, time, integrator, reference: see :class:`DiffusionSettings`.

    Returns:
        A :class:`DiffusionResult`: the new particles ``(..., N, D)`` in the dtype of ``x`` and
        the last step's log-weights ``(..., N, N)``.

    Raises:
        ValueError: a setting out of range (see :func:`check_settings`), or ``noise`` of the
            wrong shape.

    Example:
        >>> import torch
        >>> from pyro_smc.ops.diffusion import diffusion_resample
        >>> x = torch.tensor([[0.0], [1.0], [5.0]])
        >>> log_w = torch.tensor([0.0, 1.0, 0.0]).log()        # all weight on x = 1
        >>> diffusion_resample(x, log_w).particles.squeeze(-1).tolist()
        [1.0, 1.0, 1.0]
    """
    s = check_settings(num_steps, dispersion, time, integrator, reference)
    shape = (s.num_steps + 1,) + x.shape
    if noise is None:
        noise = torch.randn(shape, dtype=x.dtype, device=x.device)
    elif tuple(noise.shape) != shape:
        raise ValueError(f"noise must have shape {shape} (num_steps + 1, *x.shape), got {tuple(noise.shape)}")
    log_w = log_weights.log_softmax(-1)
    m, chol, point = _fit(x, log_w, s.reference)
    z = torch.linalg.solve_triangular(chol, (x - m.unsqueeze(-2)).transpose(-1, -2), upper=False).transpose(-1, -2)
    b2 = s.dispersion**2
    grid = [s.time * k / s.num_steps for k in range(s.num_steps + 1)]
    u = noise[0]
    for k in range(s.num_steps, 1, -1):
        u, _ = _step(u, z, log_w, grid[k], grid[k - 1], b2, s.integrator, noise[s.num_steps - k + 1])
    u, log_alpha = _step(u, z, log_w, grid[1], 0.0, b2, s.integrator, noise[-1])
    # The last step leaves u = sum_i alpha_i z_i + r, with r = 0 for the exponential and flow
    # integrators (Tweedie's step) and Euler's last increment otherwise. Map the weights, not u,
    # back: the new particles are then exactly convex combinations of the old (plus L r), and a
    # reference of arbitrary scale (the particles all at one point) does not leak into them.
    tweedie = log_alpha.exp()
    x_new = tweedie @ x
    if s.integrator == "euler":
        residual = u - tweedie @ z
        x_new = x_new + torch.where(point[..., None, None], 0.0, residual @ chol.transpose(-1, -2))
    return DiffusionResult(x_new, log_alpha)


def _step(u: Tensor, z: Tensor, log_w: Tensor, t: float, s: float, b2: float, integrator: str, eps: Tensor) -> tuple[Tensor, Tensor | None]:
    """One reverse step from forward time ``t`` down to ``s >= 0``, the denoiser frozen at ``t``;
    returns the new state and, on the last step (``s = 0``), the denoiser's log-weights."""
    if s > 0:
        # Between steps only the denoiser is needed: one softmax, no log-weights kept.
        z0, log_alpha = _logits(u, z, log_w, t, math.sqrt(b2)).softmax(-1) @ z, None
    else:
        z0, log_alpha = ensemble_denoiser(u, z, log_w, t, math.sqrt(b2))
    a_t, a_s = math.exp(-b2 * t / 2), math.exp(-b2 * s / 2)
    var_t, var_s = -math.expm1(-b2 * t), -math.expm1(-b2 * s)
    if integrator == "ode":
        return a_s * z0 + math.sqrt(var_s / var_t) * (u - a_t * z0), log_alpha
    if integrator == "euler":
        h = t - s
        score = (a_t * z0 - u) / var_t
        return u + h * (b2 / 2 * u + b2 * score) + math.sqrt(b2 * h) * eps, log_alpha
    beta = -math.expm1(-b2 * (t - s))  # 1 - r^2, r = a_t / a_s
    r = a_t / a_s
    return (a_s * beta / var_t) * z0 + (r * var_s / var_t) * u + math.sqrt(var_s * beta / var_t) * eps, log_alpha
