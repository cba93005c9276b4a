r"""The backward-factorised Gaussian family of online variational filtering (the per-step role).

See ``docs/math/streaming.md#backward-factorised-variational-family``.

.. math::

    q_t(x_{1:t}) = q_t(x_t) \prod_{k < t} q_{k+1}(x_k \mid x_{k+1})

(Campbell, Shi, Rainforth and Doucet, 2021). :math:`q_t(x_t)` is a Gaussian filtering marginal with
diagonal or full covariance; each backward kernel :math:`q(x_k \mid x_{k+1})` is Gaussian with mean
:math:`W x_{k+1} + b` (``backward="linear"``) or :math:`W x_{k+1} + b + \mathrm{MLP}(x_{k+1})` (``backward="mlp"``;
the MLP's last layer starts at zero, so it starts linear).

:class:`StreamingFamily` is the family alone: its parameters, its distributions, and the
operations the online filter needs (set the marginal or a kernel in closed form, freeze a
detached copy, push the marginal back through linear kernels). It has no ``forward``: the
whole-trajectory Pyro guide is :class:`~pyro_smc.guides.StreamingFilterGuide`, which adds that
behaviour on top of this class.

Example:
    >>> import torch
    >>> from pyro_smc.guides.streaming.family import StreamingFamily
    >>> q = StreamingFamily(2, covariance="full")  # one marginal, one kernel
    >>> q.set_marginal(torch.ones(2), 2 * torch.eye(2))
    >>> marginal, kernel = q.freeze()                                # detached copies
    >>> marginal.mean, kernel.distribution(torch.zeros(5, 2)).batch_shape
    (tensor([1., 1.]), torch.Size([5]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor, nn

from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector
from pyro_smc.ops.weights import all_finite

__all__ = ["BACKWARDS", "COVARIANCES", "GaussianKernel", "StreamingFamily", "gaussian", "marginal_covariance"]

COVARIANCES = ("diag", "full")
BACKWARDS = ("linear", "mlp")


def gaussian(loc: Tensor, scale: Tensor) -> dist.TorchDistribution:
    """A Gaussian with event shape ``(d,)`` from its mean ``(..., d)`` and ``scale``: standard
    deviations ``(..., d)`` (diagonal) or a Cholesky factor ``(..., d, d)`` (full)."""
    if scale.dim() == loc.dim():
        return dist.Normal(loc, scale).to_event(1)
    return dist.MultivariateNormal(loc, scale_tril=scale)


def marginal_covariance(marginal: dist.TorchDistribution) -> Tensor:
    """The ``(d, d)`` covariance of a :func:`gaussian`."""
    if isinstance(marginal, dist.MultivariateNormal):
        return marginal.covariance_matrix
    return torch.diag_embed(marginal.variance)


def _mlp(x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
    """tanh MLP from a flat ``(w0, b0, w1, b1, ...)`` tuple; no activation after the last layer."""
    n = len(params) // 2
    for i in range(n):
        x = x @ params[2 * i].transpose(-1, -2) + params[2 * i + 1]
        if i < n - 1:
            x = torch.tanh(x)
    return x


@dataclass
class GaussianKernel:
    r"""A Gaussian backward kernel :math:`q(x_{\mathrm{prev}} \mid x_{\mathrm{next}})` (frozen when its tensors are detached).

    Its mean is :math:`W x_{\mathrm{next}} + b` (``weight``, ``bias``), plus :math:`\mathrm{MLP}(x_{\mathrm{next}})` when ``mlp`` is set; ``scale`` is ``(d,)`` standard deviations
    or a ``(d, d)`` Cholesky factor.
    """

    weight: Tensor
    bias: Tensor
    scale: Tensor
    mlp: tuple[Tensor, ...] | None = None

    def distribution(self, x_next: Tensor) -> dist.TorchDistribution:
        """``q(x_prev | x_next)`` with batch shape ``x_next.shape[:-1]``."""
        mean = x_next @ self.weight.transpose(-1, -2) + self.bias
        if self.mlp is not None:
            mean = mean + _mlp(x_next, self.mlp)
        return gaussian(mean, self.scale.expand(mean.shape[:-1] + self.scale.shape))

    def covariance(self) -> Tensor:
        """The kernel's ``(d, d)`` covariance."""
        return torch.diag_embed(self.scale.square()) if self.scale.dim() == 1 else self.scale @ self.scale.T


class StreamingFamily(pyro.nn.PyroModule):
    r"""Gaussian filtering marginal plus ``num_kernels`` Gaussian backward kernels.

    Construct it with ``num_kernels=1`` (the default) for the online role: the parameters are
    those of the current step only, under fixed names, and the online filter freezes a detached
    copy (:meth:`freeze`) before moving on, so the number of live parameters never grows.

    Args:
        state_dim: ``d``, the size of each latent state ``x_t``.
        num_kernels: ``K``, the number of backward kernels held (``T - 1`` for a trajectory of ``T``).
        covariance: ``"diag"`` or ``"full"``: the covariance of the marginal and of each kernel.
        backward: ``"linear"`` (mean linear in ``x_{t}``) or ``"mlp"`` (plus an MLP of ``x_t``,
            shared across kernels).
        hidden_dims: hidden layer sizes of the backward MLP.
        init_scale: initial standard deviation of the marginal and the kernels.

    Parameters (fixed names, no growth over time): ``loc`` ``(d,)``; ``scale_raw`` (log standard
    deviations ``(d,)``, or the packed Cholesky factor ``(d (d+1) / 2,)``); ``bwd_weight``
    ``(K, d, d)``, ``bwd_bias`` ``(K, d)``, ``bwd_scale_raw`` ``(K, ...)``; ``bwd_mlp_*`` when
    ``backward="mlp"``. Parameter names are prefixed by the class name, as AutoGuides do, so they
    cannot collide with the model's.

    Raises:
        ValueError: ``state_dim`` or ``num_kernels`` out of range, an unknown ``covariance`` or
            ``backward``, an ``init_scale`` that is not a finite number > 0, or ``hidden_dims`` that
            are not a non-empty tuple of positive ints with ``backward="mlp"``.

    Example:
        :meth:`marginals` pushes :math:`q(x_1) = \mathcal N(1, 2)` back through the kernel
        :math:`x_0 \mid x_1 \sim \mathcal N(0.5 x_1, 1)`, giving :math:`\mathcal N(0.5, 0.25 \cdot 2 + 1)` for :math:`x_0`:

        >>> import torch
        >>> from pyro_smc.guides import StreamingFamily
        >>> q = StreamingFamily(1, num_kernels=1, covariance="full")
        >>> q.set_marginal(torch.ones(1), 2 * torch.eye(1))
        >>> q.set_kernel(0.5 * torch.eye(1), torch.zeros(1), torch.eye(1))
        >>> means, covs = q.marginals()  # (K + 1, d), (K + 1, d, d)
        >>> torch.allclose(means.flatten(), torch.tensor([0.5, 1.0]))
        True
        >>> torch.allclose(covs.flatten(), torch.tensor([1.5, 2.0]))
        True
    """

    def __init__(
        self,
        state_dim: int,
        *,
        num_kernels: int = 1,
        covariance: str = "diag",
        backward: str = "linear",
        hidden_dims: tuple[int, ...] = (32,),
        init_scale: float = 0.1,
    ):
        super().__init__(name=type(self).__name__)
        if not isinstance(state_dim, int) or isinstance(state_dim, bool) or state_dim < 1:
            raise ValueError(f"state_dim must be a positive int, got {state_dim!r}")
        if covariance not in COVARIANCES:
            raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}")
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if not isinstance(num_kernels, int) or isinstance(num_kernels, bool) or num_kernels < 0:
            raise ValueError(f"num_kernels must be an int >= 0, got {num_kernels!r}")
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if backward == "mlp" and (not hidden_dims or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden_dims)):
            raise ValueError(f"hidden_dims must be a non-empty tuple of positive ints, got {hidden_dims!r}")
        self.state_dim = state_dim
        self.covariance = covariance
        self.backward = backward
        self.hidden_dims = tuple(int(h) for h in hidden_dims)
        self.init_scale = float(init_scale)
        d = state_dim
        self.loc = nn.Parameter(torch.zeros(d))
        self.scale_raw = nn.Parameter(self._raw_scale(torch.full((d,), self.init_scale)))
        self._make_kernels(num_kernels)

    # --- parameters --------------------------------------------------------------------------
    def _raw_scale(self, std: Tensor) -> Tensor:
        if self.covariance == "diag":
            return std.log()
        return tril_to_vector(torch.diag_embed(std))

    def _scale(self, raw: Tensor) -> Tensor:
        if self.covariance == "diag":
            return raw.exp()
        return tril_from_vector(raw, self.state_dim)

    def _raw_from_cov(self, covariance: Tensor) -> Tensor:
        if self.covariance == "diag":
            var = covariance if covariance.dim() == 1 else covariance.diagonal()
            return 0.5 * var.log()
        cov = covariance if covariance.dim() == 2 else torch.diag_embed(covariance)
        return tril_to_vector(torch.linalg.cholesky(cov))

    def _raw_from_tril(self, scale_tril: Tensor) -> Tensor:
        if self.covariance == "diag":
            return 0.5 * scale_tril.square().sum(-1).log()
        return tril_to_vector(scale_tril)

    def _make_kernels(self, K: int) -> None:
        """(Re)creates ``K`` kernels at their initial values (new parameters on ``loc``'s device)."""
        d, like = self.state_dim, self.loc.detach()
        self.num_kernels = K
        self.bwd_weight = nn.Parameter(like.new_zeros(K, d, d))
        self.bwd_bias = nn.Parameter(like.new_zeros(K, d))
        self.bwd_scale_raw = nn.Parameter(self._raw_scale(like.new_full((K, d), self.init_scale)))
        if self.backward == "mlp":
            sizes = (d,) + self.hidden_dims + (d,)
            for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
                last = i == len(sizes) - 2
                w = like.new_zeros(n_out, n_in) if last else torch.randn(n_out, n_in).to(like) / math.sqrt(n_in)
                setattr(self, f"bwd_mlp_w{i}", nn.Parameter(w))
                setattr(self, f"bwd_mlp_b{i}", nn.Parameter(like.new_zeros(n_out)))

    def _mlp_params(self) -> tuple[Tensor, ...] | None:
        if self.backward != "mlp":
            return None
        params = []
        for i in range(len(self.hidden_dims) + 1):
            params += [getattr(self, f"bwd_mlp_w{i}"), getattr(self, f"bwd_mlp_b{i}")]
        return tuple(params)

    # --- distributions -----------------------------------------------------------------------
    def filtering_distribution(self) -> dist.TorchDistribution:
        """The marginal ``q(x_t)`` (event shape ``(d,)``), differentiable in the parameters."""
        return gaussian(self.loc, self._scale(self.scale_raw))

    def kernel(self, index: int = -1) -> GaussianKernel:
        """Backward kernel ``index`` (``-1``: the current one online, the last one of a trajectory),
        differentiable in the parameters."""
        return GaussianKernel(self.bwd_weight[index], self.bwd_bias[index], self._scale(self.bwd_scale_raw[index]), self._mlp_params())

    def backward_distribution(self, x_next: Tensor, index: int = -1) -> dist.TorchDistribution:
        """``q(x_prev | x_next)`` for kernel ``index``; batch shape ``x_next.shape[:-1]``."""
        return self.kernel(index).distribution(x_next)

    def joint_distribution(self, index: int = -1) -> dist.MultivariateNormal:
        r""":math:`q(x_{t-1}, x_t)` as one ``2d``-dimensional Gaussian (linear kernels only), ordered
        ``(x_{t-1}, x_t)``: the current step's pair (``index=-1``), or the pair of kernel ``index``."""
        if self.backward != "linear":
            raise NotImplementedError("joint_distribution needs linear backward kernels (backward='linear')")
        if index in (-1, self.num_kernels - 1):
            marginal = self.filtering_distribution()
            m, P = marginal.mean, marginal_covariance(marginal)
        else:
            means, covs = self.marginals()
            m, P = means[index + 1], covs[index + 1]
        k = self.kernel(index)
        W = k.weight
        mean = torch.cat([W @ m + k.bias, m])
        cross = W @ P
        cov = torch.cat([torch.cat([W @ P @ W.T + k.covariance(), cross], -1), torch.cat([cross.T, P], -1)], -2)
        return dist.MultivariateNormal(mean, covariance_matrix=0.5 * (cov + cov.T))

    def marginals(self) -> tuple[Tensor, Tensor]:
        """The means ``(K + 1, d)`` and covariances ``(K + 1, d, d)`` of every ``x_k`` under the
        family, by pushing the last marginal back through the linear kernels (the smoother's output)."""
        if self.backward != "linear":
            raise NotImplementedError("marginals needs linear backward kernels (backward='linear')")
        marginal = self.filtering_distribution()
        means, covs = [marginal.mean], [marginal_covariance(marginal)]
        for k in range(self.num_kernels - 1, -1, -1):
            kern = self.kernel(k)
            means.append(kern.weight @ means[-1] + kern.bias)
            covs.append(kern.weight @ covs[-1] @ kern.weight.T + kern.covariance())
        return torch.stack(means[::-1]), torch.stack(covs[::-1])

    @torch.no_grad()
    def invalid_parameter(self) -> str | None:
        """The name of the first parameter that is not finite, or whose standard deviations are
        0 or ``inf`` (``exp`` of a finite log can be either), else ``None``.

        Example:
            >>> import torch
            >>> q = StreamingFamily(2)
            >>> q.invalid_parameter() is None
            True
            >>> _ = q.scale_raw.detach().fill_(1000.0)                    # sd exp(1000) = inf
            >>> q.invalid_parameter()
            'scale_raw'
        """
        named = list(self.named_parameters())
        if not all_finite(torch.cat([p.detach().reshape(-1) for _, p in named])):  # one check when all are
            return next(name for name, p in named if not bool(torch.isfinite(p).all()))
        for name in ("scale_raw", "bwd_scale_raw"):
            scale = self._scale(getattr(self, name))
            sd = scale if self.covariance == "diag" else scale.square().sum(-1).sqrt()
            if not (bool(torch.isfinite(sd).all()) and bool((sd > 0).all()) and bool(torch.isfinite(sd.square()).all())):
                return name
        return None

    # --- what the online filter does between steps -------------------------------------------
    def freeze(self) -> tuple[dist.TorchDistribution, GaussianKernel]:
        """Detached copies of the current marginal and kernel (what the online filter carries on)."""
        with torch.no_grad():
            marginal = gaussian(self.loc.detach().clone(), self._scale(self.scale_raw.detach()).clone())
            k = self.kernel(-1)
            mlp = None if k.mlp is None else tuple(p.detach().clone() for p in k.mlp)
            return marginal, GaussianKernel(k.weight.detach().clone(), k.bias.detach().clone(), k.scale.detach().clone(), mlp)

    @torch.no_grad()
    def set_marginal(self, loc: Tensor, covariance: Tensor | None = None, *, scale_tril: Tensor | None = None) -> None:
        r"""Sets :math:`q(x_t) = \mathcal N(\mathtt{loc}, \mathtt{covariance})` (a diagonal family keeps the diagonal).

        Args:
            loc: ``(d,)``.
            covariance: ``(d, d)`` (or its diagonal ``(d,)``), positive definite.
            scale_tril: instead of ``covariance``, its lower Cholesky factor ``(d, d)``, for a
                covariance too ill-conditioned to pass densely (in float32 a posterior ``1e8``
                times narrower in one direction than another is not numerically positive
                definite as a matrix, but is as a factor).
        """
        if (covariance is None) == (scale_tril is None):
            raise ValueError("set_marginal needs exactly one of covariance and scale_tril")
        self.loc.copy_(loc)
        self.scale_raw.copy_(self._raw_from_cov(covariance) if scale_tril is None else self._raw_from_tril(scale_tril))

    @torch.no_grad()
    def set_kernel(self, weight: Tensor, bias: Tensor, covariance: Tensor | None = None, index: int = -1, *, scale_tril: Tensor | None = None) -> None:
        r"""Sets kernel ``index`` to :math:`\mathcal N(x_{\mathrm{prev}} \mid W x_{\mathrm{next}} + b, \Sigma)` (``weight``, ``bias``, ``covariance``; MLP part zeroed);
        ``scale_tril`` (the covariance's lower Cholesky factor) may be passed instead of
        ``covariance``, as for :meth:`set_marginal`."""
        if (covariance is None) == (scale_tril is None):
            raise ValueError("set_kernel needs exactly one of covariance and scale_tril")
        self.bwd_weight[index] = weight
        self.bwd_bias[index] = bias
        self.bwd_scale_raw[index] = self._raw_from_cov(covariance) if scale_tril is None else self._raw_from_tril(scale_tril)
        if self.backward == "mlp":
            getattr(self, f"bwd_mlp_w{len(self.hidden_dims)}").zero_()
            getattr(self, f"bwd_mlp_b{len(self.hidden_dims)}").zero_()
