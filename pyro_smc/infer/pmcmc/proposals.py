r"""Adaptive Gaussian random-walk proposals for Metropolis-Hastings in an unconstrained space.

A random walk proposes :math:`z' = z + s L \varepsilon` with :math:`\varepsilon \sim \mathcal
N(0, I_D)`, where :math:`L L^\top = \Sigma` is a proposal covariance and :math:`s` a global scale.
The proposal is symmetric, so the Metropolis-Hastings ratio is the ratio of the target densities
alone. For a Gaussian target with covariance :math:`\Sigma`, the step that mixes fastest in high
dimension has :math:`s = 2.38 / \sqrt D` (Roberts, Gelman and Gilks 1997); Haario, Saksman and
Tamminen (2001) estimate :math:`\Sigma` from the chain's own history.

:class:`AdaptiveRandomWalk` adapts both during warm-up only, as Pyro's HMC adapts its step size and
mass matrix (so the chain after warm-up is an ordinary, non-adaptive Metropolis-Hastings chain):

* **Covariance** (Haario et al.'s adaptive Metropolis, on windows). The states passed to
  :meth:`~AdaptiveRandomWalk.update` are accumulated with Welford's scheme over windows whose
  lengths double (``window``, ``2 window``, ``4 window``, ...). At the end of each window the
  proposal covariance becomes a sample covariance of the chain: of the first window's states at
  its end (those states, the chain's transient, are then forgotten), of all states since at the
  later ends; shrunk towards a small multiple of the identity as Stan does (so that few states
  still give a positive-definite matrix). The scale then restarts from :math:`2.38 / \sqrt D`, the
  optimum for a Gaussian target of that covariance.
* **Scale** (Robbins-Monro by Nesterov's dual averaging, as Pyro and Stan tune HMC's step size).
  :math:`\log s` is driven so that the mean acceptance probability approaches ``target_accept``;
  after warm-up the scale is the running average of the iterates.

The interface is three calls: :meth:`~AdaptiveRandomWalk.propose` (a proposal from the current
state), :meth:`~AdaptiveRandomWalk.update` (the state after the accept/reject step and the
acceptance probability of the step, during warm-up) and :meth:`~AdaptiveRandomWalk.end_warmup`
(freeze). The proposal is stateless between calls but for its adaptation, so a Gibbs sampler can
hold one per block of parameters.

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> walk = AdaptiveRandomWalk(2)
    >>> z = torch.zeros(2)
    >>> for _ in range(200):  # a random walk on N(0, diag(1, 0.01))
    ...     z_new = walk.propose(z)
    ...     log_ratio = -0.5 * ((z_new**2 - z**2) / torch.tensor([1.0, 0.01])).sum()
    ...     accept_prob = float(log_ratio.exp().clamp(max=1.0))
    ...     if torch.rand(()) < accept_prob:
    ...         z = z_new
    ...     walk.update(z, accept_prob)
    >>> walk.end_warmup()
    >>> bool(walk.covariance[1, 1] < walk.covariance[0, 0])  # it learnt the shape
    True
"""

from __future__ import annotations

import math

import torch
from pyro.ops.dual_averaging import DualAveraging
from pyro.ops.welford import WelfordCovariance
from torch import Tensor

from pyro_smc.checks import boolean, int_at_least, positive_float, positive_int

__all__ = ["AdaptiveRandomWalk"]


class AdaptiveRandomWalk:
    r"""A Gaussian random walk whose covariance and scale adapt during warm-up.

    Proposes :math:`z' = z + s L \varepsilon`, :math:`\varepsilon \sim \mathcal N(0, I_D)`,
    :math:`L L^\top = \Sigma`. The proposal is symmetric: no correction term enters the
    acceptance ratio. See the module docstring for the adaptation.

    Args:
        dim: :math:`D`, the length of the vectors it moves.
        scale: the initial scale :math:`s` (default :math:`2.38 / \sqrt D`).
        covariance: the initial proposal covariance :math:`\Sigma`: a ``(D, D)`` positive-definite
            matrix, a ``(D,)`` diagonal or ``None`` (the identity).
        adapt: whether :meth:`update` adapts anything (``False``: a fixed random walk).
        adapt_covariance: whether :math:`\Sigma` is learnt from the chain (windowed adaptive
            Metropolis).
        adapt_scale: whether :math:`s` is tuned towards ``target_accept`` (dual averaging).
        target_accept: the mean acceptance probability the scale is tuned for, in ``(0, 1)``.
            0.234 is optimal for a random walk in many dimensions with an exact target; with a
            noisy (pseudo-marginal) likelihood the attainable rate is lower, and a lower target
            keeps the scale from collapsing.
        window: the length of the first covariance window (then doubled each time); at least 3.

    Raises:
        ValueError: on a bad argument, naming it.

    Example:
        >>> walk = AdaptiveRandomWalk(3, adapt=False)
        >>> walk.propose(torch.zeros(3)).shape
        torch.Size([3])
        >>> round(walk.scale, 4)  # 2.38 / sqrt(3)
        1.3741
    """

    def __init__(
        self,
        dim: int,
        scale: float | None = None,
        covariance: Tensor | None = None,
        *,
        adapt: bool = True,
        adapt_covariance: bool = True,
        adapt_scale: bool = True,
        target_accept: float = 0.234,
        window: int = 50,
    ) -> None:
        self.dim = positive_int("dim", dim)
        self._default_scale = 2.38 / math.sqrt(self.dim)
        self._scale = self._default_scale if scale is None else positive_float("scale", scale)
        if not (isinstance(target_accept, (int, float)) and 0 < target_accept < 1):
            raise ValueError(f"target_accept must lie in (0, 1), got {target_accept!r}")
        self.target_accept = float(target_accept)
        self.adapt_covariance = boolean("adapt_covariance", adapt_covariance)
        self.adapt_scale = boolean("adapt_scale", adapt_scale)
        self.window = int_at_least("window", window, 3)
        self._covariance = None if covariance is None else self._check_covariance(covariance)
        self._cholesky = None if self._covariance is None else torch.linalg.cholesky(self._covariance)
        self.adapting = boolean("adapt", adapt) and (self.adapt_covariance or self.adapt_scale)
        self._welford = WelfordCovariance(diagonal=False)
        self._window_length = self.window
        self._window_end = self.window
        self._num_updates = 0
        self._restart_scale(self._scale)

    def _check_covariance(self, covariance: Tensor) -> Tensor:
        covariance = torch.as_tensor(covariance)
        if covariance.shape == (self.dim,):
            covariance = torch.diag(covariance)
        if covariance.shape != (self.dim, self.dim):
            raise ValueError(f"covariance must have shape ({self.dim},) or ({self.dim}, {self.dim}), got {tuple(covariance.shape)}")
        if not bool(torch.isfinite(covariance).all()) or not bool(torch.linalg.cholesky_ex(covariance).info == 0):
            raise ValueError("covariance must be a finite, symmetric positive-definite matrix")
        return covariance

    def _restart_scale(self, scale: float) -> None:
        self._scale = scale
        self._averager = DualAveraging(prox_center=math.log(scale), gamma=0.5)

    # --- what it is now ----------------------------------------------------------------------------

    @property
    def scale(self) -> float:
        """The global scale :math:`s` proposals use now."""
        return self._scale

    @property
    def covariance(self) -> Tensor:
        r"""``(D, D)``: the proposal covariance :math:`\Sigma` now (the identity until one is set)."""
        if self._covariance is None:
            return torch.eye(self.dim)
        return self._covariance

    # --- the three calls ---------------------------------------------------------------------------

    def propose(self, z: Tensor) -> Tensor:
        """A proposal from the current state.

        Args:
            z: ``(..., D)``, the current state (unconstrained).

        Returns:
            ``(..., D)``: :math:`z + s L \\varepsilon`, in ``z``'s dtype and on its device.

        Example:
            >>> walk = AdaptiveRandomWalk(2, scale=0.1, covariance=torch.tensor([1.0, 4.0]))
            >>> walk.propose(torch.zeros(1000, 2)).std(0).div(0.1).round()
            tensor([1., 2.])
        """
        if z.shape[-1] != self.dim:
            raise ValueError(f"z: last dimension {z.shape[-1]}, expected dim = {self.dim}")
        noise = torch.randn(z.shape, dtype=z.dtype, device=z.device)
        if self._cholesky is None:
            return z + self._scale * noise
        cholesky = self._cholesky.to(dtype=z.dtype, device=z.device)
        return z + self._scale * (noise @ cholesky.T)

    def update(self, z: Tensor, accept_prob: float | Tensor) -> None:
        """Adapts to one Metropolis-Hastings step (no-op once warm-up has ended).

        Args:
            z: ``(D,)``, the state after the step (the proposal if it was accepted, else the old
                state).
            accept_prob: the step's acceptance probability :math:`\\min(1, r)` (not the 0/1
                outcome: the probability has less variance); NaN counts as 0.

        Example:
            >>> walk = AdaptiveRandomWalk(1, adapt_covariance=False)
            >>> for _ in range(100):
            ...     walk.update(torch.zeros(1), 0.0)  # every proposal rejected: smaller steps
            >>> walk.scale < 2.38
            True
        """
        if not self.adapting:
            return
        accept_prob = float(accept_prob)
        if math.isnan(accept_prob):
            accept_prob = 0.0
        self._num_updates += 1
        if self.adapt_scale:
            self._averager.step(self.target_accept - accept_prob)
            log_scale, _ = self._averager.get_state()
            # a bounded log-scale: one run of rejections cannot make it under- or overflow
            self._scale = math.exp(min(max(log_scale, -30.0), 30.0))
        if self.adapt_covariance:
            self._welford.update(z.detach().reshape(self.dim).to(torch.float64))
            if self._num_updates >= self._window_end:
                self._end_window(z)

    def _end_window(self, z: Tensor) -> None:
        previous = self.covariance.to(torch.float64)
        n = self._welford.n_samples
        empirical = self._welford.get_covariance(regularize=False)
        # Stan's shrinkage, towards a small multiple of the previous covariance's mean variance
        floor = 1e-3 * float(previous.diagonal().mean())
        covariance = (n / (n + 5.0)) * empirical + (5.0 / (n + 5.0)) * floor * torch.eye(self.dim, dtype=torch.float64)
        cholesky, info = torch.linalg.cholesky_ex(covariance)
        if bool(info == 0) and bool(torch.isfinite(cholesky).all()):
            self._covariance = covariance.to(z.dtype)
            self._cholesky = cholesky.to(z.dtype)
            self._restart_scale(self._default_scale)
        if self._num_updates <= self.window:
            self._welford.reset()  # the first window is the chain's transient: forgotten
        self._window_length *= 2
        self._window_end = self._num_updates + self._window_length

    def _current_average_scale(self) -> float:
        if not self.adapt_scale or self._averager._t == 0:
            return self._scale
        _, log_scale_avg = self._averager.get_state()
        return math.exp(min(max(log_scale_avg, -30.0), 30.0))

    def end_warmup(self) -> None:
        """Freezes the proposal: the scale becomes the dual-averaging average, the covariance stays.

        Example:
            >>> walk = AdaptiveRandomWalk(1)
            >>> walk.end_warmup()
            >>> walk.adapting
            False
        """
        if self.adapting:
            self._scale = self._current_average_scale()
        self.adapting = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, scale={self._scale:.4g}, adapting={self.adapting})"
