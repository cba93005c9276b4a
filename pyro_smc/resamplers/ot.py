"""Optimal-transport resampling: the differentiable ensemble transform of Corenflos et al. (2021).

See ``docs/math/smc.md#optimal-transport-resampling`` and ``docs/math/smc.md#gradient-modes``.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import OTResampler
    >>> out = OTResampler(epsilon=0.5).resample(
    ...     {"x": torch.randn(4, 100, 2)}, torch.randn(4, 100).log_softmax(-1)
    ... )
    >>> (
    ...     out.diagnostics.converged.shape,
    ...     out.diagnostics.num_iterations.dtype,
    ...     out.ancestors is None,
    ... )
    (torch.Size([4]), torch.int64, True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_smc.ops import resample as schemes
from pyro_smc.ops.ensemble import ensemble_solve
from pyro_smc.ops.sinkhorn import SinkhornSettings
from pyro_smc.resamplers.base import Particles, Resampled, Resampler, check_particles, flatten_floats, gather, unflatten_floats

__all__ = ["OTResampler"]


class OTResampler(Resampler):
    r"""Differentiable ensemble transform by entropy-regularised optimal transport.

    All floating-point state tensors are flattened per particle and concatenated into one point
    cloud, transported jointly with the scale normalisation of Corenflos et al. (2021) by the
    barycentric map :math:`\tilde x_i = \sum_j P_{ij} x_j / \sum_j P_{ij}` of the entropic plan ``P``, and
    split back (differentiably). Weighted means are preserved (up to the plan's marginal
    error); the output is equally weighted.

    Integer (and other non-floating) state tensors, e.g. a discrete regime label, cannot be
    averaged. Each new particle ``i`` instead draws one ancestor :math:`A_i \sim \operatorname{Categorical}(N P_{i\cdot})`
    from its row of the (detached) plan, independently across particles, and every
    non-floating tensor takes its value from that ancestor, so labels of one particle stay
    consistent with each other. The rows of ``P`` sum to :math:`1/N` and its columns to the
    weights, so :math:`\Pr(A_i = j)` averaged over ``i`` is :math:`w_j`: the weighted distribution of
    the labels is kept in expectation (up to the marginal error, below ``threshold``). The
    draws are independent, so the variance of a label count is :math:`\sum_i p_i (1 - p_i)` with
    :math:`p_i = N \sum_{j : z_j = 1} P_{ij}` the row's share of the label: at most that of
    multinomial resampling (Jensen), less where the plan is sharp, but typically more than
    systematic resampling's. Particles of zero weight are never drawn. This part is random
    and not differentiable, and a new particle pairs :math:`\tilde x_i` with the label of one of the
    particles averaged into it, not of a particle at :math:`\tilde x_i`. So when the continuous
    state's distribution depends on the label, the averaged particles fit neither label and the
    labels' filtering probabilities are biased, not only by :math:`O(\epsilon)`: use an index resampler
    or :class:`~pyro_smc.resamplers.KernelResampler` for such models (``docs/engines/smc.md#discrete-latent-state``
    gives a measured case). :class:`~pyro_smc.SMC` passes a
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
        gradient: how Sinkhorn is differentiated (one of
            ``pyro_smc.ops.sinkhorn.GRADIENT_MODES``; not the SMC gradient estimator, which
            for OT is always pathwise: see :mod:`pyro_smc.resamplers`, "Two meanings of
            ``gradient=``"). ``"implicit"`` (exact, default), ``"unroll"`` (exact for the iterate; memory
            grows with the iterations) or ``"last_step"`` (potentials held fixed in the backward
            pass: no adjoint solve, slightly cheaper, but relative gradient errors of 0.3-0.5 at
            epsilon 0.5; only where a biased gradient is acceptable). See
            ``docs/math/smc.md#gradient-modes``.

    Attributes:
        settings: the :class:`~pyro_smc.ops.sinkhorn.SinkhornSettings` built from the arguments
            (also readable as ``epsilon``, ``scaling``, ``threshold``, ``max_iter``,
            ``gradient``).

    Returns:
        ``(particles, log_weights)`` when called: each state tensor ``(..., N, *event)`` and the
        normalised new log-weights ``(..., N)``, shaped as the inputs. :meth:`resample` returns
        the :class:`~pyro_smc.resamplers.Resampled` whose ``diagnostics`` is the
        :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` of the call's Sinkhorn solve, all of it
        detached. With ``batch = log_weights.shape[:-1]`` (the filters of that call):
        ``converged`` ``batch`` bool, whether the plan met ``threshold`` within ``max_iter``
        (the solver also warns, :class:`~pyro_smc.ops.sinkhorn.SinkhornConvergenceWarning`);
        ``num_iterations`` ``batch`` int64; ``marginal_error`` ``batch`` in the dtype of
        ``log_weights``; ``f`` and ``g`` the potentials, ``batch + (N,)``. ``ancestors`` is
        ``None`` (particles are moved, not copied) and ``diagnostics`` too when the state has
        no floating-point tensor (nothing is solved).

    Raises:
        ValueError: an argument out of range or an unknown ``gradient`` mode; at call time,
            mismatched particle shapes.

    Example:
        The transported particles are equally weighted and keep the weighted mean:

        >>> import torch
        >>> from pyro_smc.resamplers import OTResampler
        >>> _ = torch.manual_seed(0)
        >>> x, log_w = torch.randn(100, 2), torch.randn(100).log_softmax(-1)     # (N, d), (N,)
        >>> out = OTResampler(epsilon=0.5).resample({"x": x}, log_w)
        >>> torch.allclose(out.log_weights, torch.full((100,), -torch.log(torch.tensor(100.0))))
        True
        >>> torch.allclose(
        ...     out.particles["x"].mean(0), (log_w.exp()[:, None] * x).sum(0), atol=1e-2
        ... )
        True
        >>> bool(out.diagnostics.converged)
        True
    """

    reports_convergence = True

    def __init__(self, epsilon: float = 0.5, scaling: float = 0.75, threshold: float = 1e-3, max_iter: int = 100, gradient: str = "implicit"):
        if not (isinstance(epsilon, (int, float)) and epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
        if int(max_iter) < 1:
            raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")
        self.settings = SinkhornSettings(float(epsilon), scaling, threshold, int(max_iter), gradient)

    # The settings, by the names of the constructor's arguments.
    epsilon = property(lambda self: self.settings.epsilon, doc="Regularisation on the normalised cost scale.")
    scaling = property(lambda self: self.settings.scaling, doc="Epsilon annealing factor in ``[0, 1)``.")
    threshold = property(lambda self: self.settings.threshold, doc="L1 marginal error at which a solve stops.")
    max_iter = property(lambda self: self.settings.max_iter, doc="Maximum Sinkhorn iterations at the final epsilon.")
    gradient = property(lambda self: self.settings.gradient, doc="How Sinkhorn is differentiated (see ``settings``).")

    def __repr__(self) -> str:
        s = self.settings
        return f"OTResampler(epsilon={s.epsilon!r}, scaling={s.scaling!r}, threshold={s.threshold!r}, max_iter={s.max_iter!r}, gradient={s.gradient!r})"

    def resample(self, particles: Particles, log_weights: Tensor) -> Resampled:
        """Transports the particles by the entropic OT plan (see :meth:`Resampler.resample`)."""
        check_particles(particles, log_weights)
        n = log_weights.shape[-1]
        x, floats = flatten_floats(particles, log_weights)
        if not floats:
            # Nothing to transport: with zero cost the entropic plan is the independent coupling
            # P = (1/N) w^T, whose rows draw ancestors by the weights (multinomial resampling).
            index = schemes.multinomial(log_weights)
            return Resampled(gather(particles, index), torch.full_like(log_weights, -math.log(n)), index)
        others = {k: v for k, v in particles.items() if k not in floats}
        x_new, plan, solve = ensemble_solve(x, log_weights, self.settings, plan=bool(others))
        out = unflatten_floats(x_new, floats)
        if others:
            out.update(gather(others, _ancestors_from_plan(plan.detach())))
        return Resampled(out, torch.full_like(log_weights, -math.log(n)), diagnostics=solve)


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
