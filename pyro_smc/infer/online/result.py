"""The result of the online variational filter: the stream so far, stacked over its steps.

Example:
    >>> import torch
    >>> from pyro_smc.infer.online.result import OnlineFilterResult
    >>> inc = torch.tensor([-1.0, -2.0])
    >>> out = OnlineFilterResult(
    ...     inc.sum(),
    ...     inc,
    ...     torch.zeros(2, 3),
    ...     torch.eye(3).expand(2, 3, 3),
    ...     torch.tensor(0.1),
    ... )
    >>> float(out.log_evidence), out.filtering_means.shape
    (-3.0, torch.Size([2, 3]))
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["OnlineFilterResult"]


class OnlineFilterResult(NamedTuple):
    r"""A snapshot of :class:`~pyro_smc.OnlineVariationalFilter` after ``T`` steps, state dimension ``d``
    (detached tensors).

    Attributes:
        log_evidence: scalar, the running ELBO: a Monte Carlo estimate of a lower bound on
            :math:`\log p(y_{1:T})`.
        log_evidence_increments: ``(T,)`` its per-step terms (they sum to ``log_evidence``).
        filtering_means: ``(T, d)`` means of the filtering marginals ``q_t(x_t)``.
        filtering_covariances: ``(T, d, d)`` their covariances.
        log_evidence_standard_error: scalar, the Monte Carlo standard error of ``log_evidence``.
        iterations: ``(T,)`` the optimisation iterations each step ran (``None`` when not recorded).

    Example:
        >>> import torch
        >>> from pyro_smc import OnlineVariationalFilter
        >>> from pyro_smc.guides import StreamingFilterGuide
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> _, ys = ssm.simulate(3)
        >>> out = (
        ...     OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=5)
        ...     .run(ys)
        ...     .result
        ... )
        >>> out.filtering_means.shape, out.filtering_covariances.shape
        (torch.Size([3, 2]), torch.Size([3, 2, 2]))
    """

    log_evidence: Tensor
    log_evidence_increments: Tensor
    filtering_means: Tensor
    filtering_covariances: Tensor
    log_evidence_standard_error: Tensor
    iterations: Tensor | None = None
