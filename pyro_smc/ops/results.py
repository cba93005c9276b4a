r"""The typed results of pyro_smc's engines: plain containers of tensors.

Conventions every result type here keeps:

* ``T`` time steps, state dimension ``d``; marginals are ``means (T, d)`` and
  ``covariances (T, d, d)``, on the device and dtype of the model.
* ``log_evidence`` is the one name for the (estimated) total :math:`\log p(y_{1:T})`: a tensor, or
  ``None`` where the engine does not compute it. What it means depends on the engine:

  - Kalman filter (:class:`FilterResult`): exact.
  - Gaussian filters and smoothers (EKF/EKS, UKF/URTSS, GP-ADF/GP-RTSS,
    ``GaussianSmootherResult``): the Gaussian approximation given by the prediction-error
    decomposition, :math:`\sum_t \log \mathcal N(y_t \mid \mu_t, S_t)` with the projected predictive moments.
  - EP: the exact evidence of the linear-Gaussian model fitted by the last sweep's projections
    (``docs/math/ep.md#the-ep-evidence``).
  - SMC: an estimate whose exponential is unbiased for the evidence ``Z``.
  - The online variational filter: an ELBO, a lower bound.

* ``log_evidence_increments`` ``(T,)`` (batch dims after ``T`` where the model carries them) are the
  per-step terms :math:`\log p(y_t \mid y_{1:t-1})` whose sum is ``log_evidence``, where they exist; a step
  without an observation contributes 0.

The Kalman results (:class:`FilterResult`, :class:`SmootherResult`) come from
:mod:`pyro_smc.ops.kalman`; those of the Gaussian filters, smoothers and EP live beside their
engines (``pyro_smc.infer.gaussian.result``), as do those of the engines that step through a
stream (``pyro_smc.infer.smc.result``, ``pyro_smc.infer.online.result``).

Example:
    >>> import torch
    >>> from pyro_smc.ops.results import FilterResult
    >>> z = torch.zeros(3, 1, dtype=torch.float64)
    >>> out = FilterResult(
    ...     z, z[..., None], z, z[..., None], torch.full((3,), -1.0, dtype=torch.float64)
    ... )
    >>> out.log_evidence.item()
    -3.0
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["FilterResult", "SmootherResult"]


class FilterResult(NamedTuple):
    r"""Kalman filtering output.

    Attributes:
        means: ``(T, d)`` :math:`\mathbb E[x_t \mid y_{1:t}]`.
        covariances: ``(T, d, d)``.
        predicted_means: ``(T, d)`` :math:`\mathbb E[x_t \mid y_{1:t-1}]` (the prior at :math:`t = 0`).
        predicted_covariances: ``(T, d, d)``.
        log_evidence_increments: ``(T,)`` :math:`\log p(y_t \mid y_{1:t-1})`; 0 at steps without data.

    Example:
        >>> import torch
        >>> z = torch.zeros(3, 1)
        >>> out = FilterResult(
        ...     z, z[..., None], z, z[..., None], torch.tensor([-1.0, -0.5, 0.0])
        ... )
        >>> out.means.shape, float(out.log_evidence)
        (torch.Size([3, 1]), -1.5)
    """

    means: Tensor
    covariances: Tensor
    predicted_means: Tensor
    predicted_covariances: Tensor
    log_evidence_increments: Tensor

    @property
    def log_evidence(self) -> Tensor:
        r"""Exact :math:`\log p(y_{1:T})`, the sum of the increments over time."""
        return self.log_evidence_increments.sum(0)


class SmootherResult(NamedTuple):
    r"""RTS smoothing output: the marginals :math:`p(x_t \mid y_{1:T})` and the filter's evidence.

    Attributes:
        means: ``(T, d)`` :math:`\mathbb E[x_t \mid y_{1:T}]`.
        covariances: ``(T, d, d)``.
        log_evidence: scalar, the filter's exact :math:`\log p(y_{1:T})`; ``None`` when built without one.

    Example:
        >>> import torch
        >>> out = SmootherResult(torch.zeros(4, 2), torch.eye(2).expand(4, 2, 2))
        >>> out.covariances.shape, out.log_evidence is None
        (torch.Size([4, 2, 2]), True)
    """

    means: Tensor
    covariances: Tensor
    log_evidence: Tensor | None = None
