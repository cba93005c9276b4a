r"""The rejuvenation of :class:`~pyro_smc.infer.smc2.SMC2`'s parameter particles: a Gaussian fitted
to them, and particle marginal Metropolis-Hastings moves that leave the current posterior
invariant.

After the parameter particles are resampled, many are copies of a few. Each particle then takes
Metropolis-Hastings steps in the unconstrained space :math:`z = T^{-1}(\theta)` of the parameters,
targeting :math:`\pi_t(z) \propto \hat p(y_{1:t} \mid z)\, p(z)`, where :math:`p(z)` is the prior
with its Jacobian and :math:`\hat p(y_{1:t} \mid z)` the unbiased estimate of a particle filter run
at :math:`z` (the particle marginal Metropolis-Hastings kernel of Andrieu, Doucet and Holenstein
2010: the filter's state is part of the extended target, so a proposal comes with a fresh filter
and an accepted one replaces the old filter too). The proposal is a Gaussian whose mean
:math:`m` and covariance :math:`\Sigma` are the weighted moments of the particles before
resampling:

* ``"random_walk"``: :math:`z' = z + s L \varepsilon`, :math:`L L^\top = \Sigma`,
  :math:`\varepsilon \sim \mathcal N(0, I)`, with :math:`s = 2.38 / \sqrt{d}` by default; it is
  symmetric, so the acceptance ratio is the ratio of the targets;
* ``"independent"``: :math:`z' \sim \mathcal N(m, s^2 \Sigma)`, :math:`s = 1` by default, with the
  ratio of the proposal densities :math:`q(z) / q(z')` in the acceptance ratio.

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> z = torch.randn(1000, 2) * torch.tensor([1.0, 3.0])
    >>> proposal = fit_proposal(z, torch.zeros(1000), "independent")
    >>> proposal.scale_tril.diagonal().round(decimals=0).tolist()   # about the sd
    [1.0, 3.0]
    >>> z_new, log_q_ratio = propose(proposal, z)
    >>> z_new.shape, log_q_ratio.shape
    (torch.Size([1000, 2]), torch.Size([1000]))
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.distributions import MultivariateNormal

__all__ = ["PROPOSALS", "GaussianProposal", "fit_proposal", "metropolis_hastings", "propose", "weighted_moments"]

PROPOSALS = ("random_walk", "independent")


class GaussianProposal(NamedTuple):
    """A Gaussian proposal fitted to the weighted parameter particles.

    Attributes:
        kind: ``"random_walk"`` or ``"independent"``.
        mean: ``(d,)``, the particles' weighted mean (the independent proposal's mean).
        scale_tril: ``(d, d)``, the lower Cholesky factor of the proposal's covariance.
    """

    kind: str
    mean: Tensor
    scale_tril: Tensor


def weighted_moments(z: Tensor, log_weights: Tensor) -> tuple[Tensor, Tensor]:
    r"""The weighted mean ``(d,)`` and covariance ``(d, d)`` of particles ``z`` ``(M, d)`` with
    log-weights ``(M,)`` (normalised or not).

    Example:
        >>> z = torch.tensor([[0.0], [2.0]])
        >>> weighted_moments(z, torch.tensor([0.25, 0.75]).log())
        (tensor([1.5000]), tensor([[0.7500]]))
    """
    w = torch.softmax(log_weights, dim=0)
    mean = w @ z
    centred = z - mean
    return mean, (w.unsqueeze(-1) * centred).transpose(0, 1) @ centred


def fit_proposal(z: Tensor, log_weights: Tensor, kind: str, scale: float | None = None) -> GaussianProposal:
    r"""The Gaussian proposal of ``kind`` fitted to particles ``z`` ``(M, d)`` with log-weights ``(M,)``.

    Args:
        z: the unconstrained parameter particles.
        log_weights: their log-weights.
        kind: ``"random_walk"`` or ``"independent"``.
        scale: the factor :math:`s` of the covariance's square root (default :math:`2.38/\sqrt d`
            for the random walk, 1 for the independent proposal).

    Returns:
        The :class:`GaussianProposal`; a covariance that is singular (all particles equal in
        some direction) gets a small ridge so that the proposal still moves.
    """
    mean, cov = weighted_moments(z, log_weights)
    d = z.shape[-1]
    eye = torch.eye(d, dtype=z.dtype, device=z.device)
    tiny = torch.finfo(z.dtype).eps
    ridge = (cov.diagonal().mean() * 1e-6 + tiny) * eye
    chol = torch.linalg.cholesky(cov + ridge)
    if scale is None:
        scale = 2.38 / math.sqrt(d) if kind == "random_walk" else 1.0
    return GaussianProposal(kind, mean, scale * chol)


def propose(proposal: GaussianProposal, z: Tensor) -> tuple[Tensor, Tensor]:
    r"""Draws a move for each particle of ``z`` ``(M, d)``.

    Returns:
        ``z'`` ``(M, d)`` and :math:`\log q(z \mid z') - \log q(z' \mid z)` ``(M,)`` (zero for the
        symmetric random walk).
    """
    noise = torch.randn_like(z) @ proposal.scale_tril.transpose(0, 1)
    if proposal.kind == "random_walk":
        return z + noise, z.new_zeros(z.shape[:-1])
    fitted = MultivariateNormal(proposal.mean, scale_tril=proposal.scale_tril, validate_args=False)
    z_new = proposal.mean + noise
    return z_new, fitted.log_prob(z) - fitted.log_prob(z_new)


def metropolis_hastings(
    z: Tensor,
    log_target: Tensor,
    proposal: GaussianProposal,
    target_of: Callable[[Tensor], tuple[Tensor, Any]],
    accept_into: Callable[[Any, Tensor], None],
) -> tuple[Tensor, Tensor, float]:
    r"""One Metropolis-Hastings move of every particle.

    Args:
        z: ``(M, d)``, the current unconstrained particles.
        log_target: ``(M,)``, :math:`\log \hat p(y_{1:t} \mid z) + \log p(z)` at ``z``.
        proposal: the fitted proposal.
        target_of: maps proposed particles ``(M, d)`` to their log-targets ``(M,)`` and a handle
            on what was computed for them (the filters run at them).
        accept_into: given that handle and the accepted mask ``(M,)``, takes the accepted
            proposals' filters in place of the current ones.

    Returns:
        The new ``z`` and ``log_target`` and the fraction of accepted moves. A proposal whose
        target is NaN or :math:`-\infty` is rejected.
    """
    z_new, log_q_ratio = propose(proposal, z)
    log_target_new, handle = target_of(z_new)
    log_ratio = log_target_new - log_target + log_q_ratio
    accept = torch.rand_like(log_ratio).log() < log_ratio  # NaN compares False: rejected
    accept_into(handle, accept)
    mask = accept.unsqueeze(-1)
    z = torch.where(mask, z_new, z)
    log_target = torch.where(accept, log_target_new, log_target)
    return z, log_target, float(accept.to(z.dtype).mean())
