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
from pyro_smc.ops.labels import class_weights, label_classes
from pyro_smc.ops.sinkhorn import SinkhornSettings
from pyro_smc.resamplers.base import Particles, Resampled, Resampler, check_particles, flatten_floats, gather, unflatten_floats

__all__ = ["OTResampler"]


class OTResampler(Resampler):
    r"""Differentiable ensemble transform by entropy-regularised optimal transport.

    All floating-point state tensors are flattened per particle and concatenated into one point
    cloud, transported jointly by the barycentric map :math:`\tilde x_i = \sum_j P_{ij} x_j / \sum_j P_{ij}` of the entropic plan ``P``, and
    split back (differentiably). The cost measures each coordinate on its own spread over the
    particles, :math:`C_{ij} = \frac1D \sum_d (x_{id} - x_{jd})^2 / \operatorname{var}_d`, so the transport does not
    depend on the units of any coordinate. Weighted means are preserved (up to the plan's
    marginal error); the output is equally weighted.

    Integer (and other non-floating) state tensors, e.g. a discrete regime label, cannot be
    averaged, and a continuous state may only be averaged over particles that share its label:
    when the label shapes the continuous state, a particle moved to an average over two labels
    fits neither, and the labels' filtering probabilities are biased far beyond
    :math:`O(\epsilon)`. With such tensors the resampling is label-wise:

    1. the particles are grouped by the joint value of all their non-floating tensors (the
       classes :math:`k`, with masses :math:`W_k` and sizes :math:`n_k`);
    2. each class is transported within itself, each coordinate on the class's own spread,
       from the uniform measure on its particles to its weights renormalised within it: one block-diagonal entropic plan for all classes
       (a class of zero weight is transported with uniform weights), so every new particle is
       an average over particles of its own label and keeps that label;
    3. the new particles, equally weighted within a class, carry weight :math:`W_k / n_k` each,
       and systematic resampling of them by these weights, each class's particles side by side,
       gives class ``k`` :math:`\lfloor N W_k \rfloor` or :math:`\lceil N W_k \rceil` new particles (on average
       :math:`N W_k`).

    The labels' weighted distribution is kept in expectation, with systematic resampling's
    variance. Step 3 is a discrete choice: the new log-weights are :math:`-\log N` in value
    but carry the gradient of the chosen class's log-mass (the stop-gradient form of
    :class:`~pyro_smc.resamplers.SystematicResampler`), so a parameter that moves mass between
    labels still has a gradient path; within a class the gradient is the transport's
    (pathwise). A label with many values leaves small classes, and a class of one particle is
    not moved at all: the resampling tends to index resampling as the classes shrink.
    :class:`~pyro_smc.SMC` passes a float-coded label (the value of a site with discrete
    support, such as ``dist.Bernoulli``'s 0./1.) as an integer tensor, so it is grouped by too.
    A state with no floating tensor has nothing to transport: the plan of zero cost is the
    independent coupling, and the call is multinomial resampling. See
    ``docs/math/smc.md#discrete-labels-and-optimal-transport``.

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
        :class:`~pyro_smc.ops.sinkhorn.SinkhornResult` of the call's Sinkhorn solve (label-wise:
        the one block-diagonal solve of every class), all of it detached. With ``batch = log_weights.shape[:-1]`` (the filters of that call):
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
        uniform = torch.full_like(log_weights, -math.log(n))
        others = {k: v for k, v in particles.items() if k not in floats}
        labels = [v.reshape(log_weights.shape + (-1,)).long() for v in others.values()]
        classes = label_classes(torch.cat(labels, -1)) if labels else None
        if classes is None or bool((classes == 0).all()):  # one label everywhere: one transport
            x_new, _, solve = ensemble_solve(x, log_weights, self.settings, plan=False)
            return Resampled({**unflatten_floats(x_new, floats), **others}, uniform, diagnostics=solve)
        within, log_share = class_weights(log_weights, classes)
        x_new, _, solve = ensemble_solve(x, within, self.settings, plan=False, classes=classes)
        # Systematic resampling with each class's particles side by side: a class is one stretch
        # of the cumulative weights, so it gets floor or ceil of N W_k offspring.
        order = classes.argsort(dim=-1, stable=True)
        index = order.gather(-1, schemes.systematic(log_share.detach().gather(-1, order)))
        new = gather({**unflatten_floats(x_new, floats), **others}, index)
        return Resampled(new, schemes.stop_gradient_log_weights(log_share, index), diagnostics=solve)
