"""The resampler contract: :class:`Resampler`, what a call returns (:class:`Resampled`), and the
gradient estimator a resampler asks the engine for (:class:`GradientEstimator`).

A resampler maps a dict of state tensors, each ``(..., N, *event)``, and normalised log-weights
``(..., N)`` (leading dims: independent filters; ``N`` particles) to new ones of the same shapes.
Everything the engine needs comes back from :meth:`Resampler.resample` (ancestors, solver
diagnostics) or is a class attribute (``estimator``, ``draws_ancestors``,
``reports_convergence``); nothing is left on the instance between calls. The helpers at the end
(:func:`check_particles`, :func:`gather`, :func:`flatten_floats`, :func:`unflatten_floats`) are
shared by the resampler modules of this package.

Example:
    >>> import torch
    >>> from pyro_smc.resamplers import SystematicResampler
    >>> out = SystematicResampler().resample(
    ...     {"x": torch.arange(4.0)}, torch.zeros(4).log_softmax(-1)
    ... )
    >>> out.ancestors.tolist(), out.log_weights.exp().tolist()
    ([0, 1, 2, 3], [0.25, 0.25, 0.25, 0.25])
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Particles",
    "GradientEstimator",
    "Resampled",
    "Resampler",
    "resample",
    "estimator_of",
    "check_particles",
    "gather",
    "flatten_floats",
    "unflatten_floats",
]

#: A particle state: name -> tensor ``(..., N, *event)``.
Particles = dict[str, Tensor]


class GradientEstimator(enum.Enum):
    r"""Which estimator of the gradient of :math:`\log Z` a resampler asks :class:`~pyro_smc.SMC` for.

    Read from ``Resampler.estimator``. On the index resamplers it is chosen by their
    ``gradient=`` keyword (see :mod:`pyro_smc.resamplers`, "Two meanings of ``gradient=``").

    * ``PATHWISE``: autodiff of whatever the resampler returns (index resampling with constant
      new weights, soft, kernel and OT resampling).
    * ``SCORE``: the Fisher-identity estimator: ``SMC`` detaches the proposal draws and adds their
      score terms (``gradient="stop_gradient"`` of the index resamplers).
    * ``MARGINAL_SCORE``: the same with the :math:`O(N^2)` score of the marginal transition density
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
            :class:`~pyro_smc.resamplers.OTResampler`); ``None`` otherwise.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers import SystematicResampler
        >>> out = SystematicResampler().resample(
        ...     {"x": torch.arange(4.0)}, torch.zeros(4).log_softmax(-1)
        ... )
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

    ``resampler(particles, log_weights)`` returns ``(particles, log_weights)``;
    :meth:`resample` returns a :class:`Resampled` that also carries the ancestors and the
    diagnostics, which is what :class:`~pyro_smc.SMC` reads. Three class attributes tell the
    engine what to expect, so that it never probes an instance. A new resampler is one module of
    this package with one such subclass, and no edit to ``SMC``.

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


def check_particles(particles: Particles, log_weights: Tensor) -> None:
    """Checks that every state tensor leads with the particle dims ``log_weights.shape``.

    Raises:
        ValueError: naming the first state tensor whose leading dims differ.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers.base import check_particles
        >>> check_particles({"x": torch.zeros(4, 2)}, torch.zeros(4))
        >>> check_particles({"x": torch.zeros(3)}, torch.zeros(4))
        Traceback (most recent call last):
            ...
        ValueError: particles['x'] has shape (3,); its leading dims must equal log_weights' shape (4,)
    """
    for key, value in particles.items():
        if not isinstance(value, Tensor) or tuple(value.shape[: log_weights.dim()]) != tuple(log_weights.shape):
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"particles['{key}'] has shape {shape}; its leading dims must equal log_weights' shape {tuple(log_weights.shape)}")


def gather(particles: Particles, index: Tensor) -> Particles:
    """Selects ancestors ``index`` (shape ``(..., N)``) along the particle dimension.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers.base import gather
        >>> gather({"x": torch.tensor([[0.0, 1.0], [2.0, 3.0]])}, torch.tensor([1, 1]))[
        ...     "x"
        ... ].tolist()
        [[2.0, 3.0], [2.0, 3.0]]
    """
    out = {}
    for key, value in particles.items():
        if value.dim() == index.dim():
            out[key] = value.gather(index.dim() - 1, index)
            continue
        idx = index.reshape(index.shape + (1,) * (value.dim() - index.dim())).expand(index.shape + value.shape[index.dim() :])
        out[key] = value.gather(index.dim() - 1, idx)
    return out


def flatten_floats(particles: Particles, log_weights: Tensor) -> tuple[Tensor, Particles]:
    """The floating-point state as one point cloud, for resamplers that move particles.

    Returns:
        ``(x, floats)``: ``x`` of shape ``log_weights.shape + (D,)`` in the dtype of
        ``log_weights``, every floating tensor flattened per particle and concatenated in dict
        order (``D = 0`` when there is none); ``floats`` the floating tensors, for
        :func:`unflatten_floats`.

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers.base import flatten_floats
        >>> x, floats = flatten_floats(
        ...     {"a": torch.zeros(5, 2, 3), "k": torch.zeros(5).long()}, torch.zeros(5)
        ... )
        >>> x.shape, list(floats)
        (torch.Size([5, 6]), ['a'])
    """
    batch = log_weights.shape
    floats = {k: v for k, v in particles.items() if v.is_floating_point()}
    for key, value in floats.items():
        # Computing in the narrower dtype would round the state to it (float64 positions near 1e6
        # with a spread of 1e-3, resampled with float32 weights, all came out the same value).
        if torch.finfo(value.dtype).eps < torch.finfo(log_weights.dtype).eps:
            raise ValueError(
                f"particles['{key}'] is {value.dtype} but log_weights is {log_weights.dtype}: pass log_weights in the "
                f"state's precision (log_weights.to({value.dtype})), or the state would be rounded to {log_weights.dtype}"
            )
    flat = [v.reshape(batch + (-1,)) for v in floats.values()]
    if not flat:
        return log_weights.new_zeros(batch + (0,)), floats
    x = torch.cat(flat, -1) if len(flat) > 1 else flat[0]
    return (x.to(log_weights.dtype) if x.dtype != log_weights.dtype else x), floats


def unflatten_floats(x: Tensor, floats: Particles) -> Particles:
    """Splits a cloud ``x`` ``(..., N, D)`` from :func:`flatten_floats` back into tensors of the
    shapes and dtypes of ``floats`` (differentiably).

    Example:
        >>> import torch
        >>> from pyro_smc.resamplers.base import flatten_floats, unflatten_floats
        >>> state = {"a": torch.randn(5, 2, 3), "b": torch.randn(5)}
        >>> x, floats = flatten_floats(state, torch.zeros(5))
        >>> all(torch.equal(unflatten_floats(x, floats)[k], state[k]) for k in state)
        True
    """
    out, start = {}, 0
    for key, value in floats.items():
        width = math.prod(value.shape[x.dim() - 1 :])
        out[key] = x[..., start : start + width].reshape(value.shape).to(value.dtype)
        start += width
    return out
