r"""The backward-factorised variational family of online variational filtering.

    q_t(x_{1:t}) = q_t(x_t) prod_{k < t} q_{k+1}(x_k | x_{k+1})

(Campbell, Shi, Rainforth and Doucet, 2021). ``q_t(x_t)`` is a Gaussian
filtering marginal with diagonal or full covariance; each backward kernel ``q(x_{k} | x_{k+1})``
is Gaussian with mean ``W x_{k+1} + b`` (``backward="linear"``) or ``W x_{k+1} + b +
MLP(x_{k+1})`` (``backward="mlp"``, the MLP's last layer starts at zero so it starts linear).

:class:`StreamingFilterGuide` serves two uses.

* **Online**, as the guide :class:`~pyro_smc.OnlineVariationalFilter` trains one step at a time.
  Its parameters are those of the *current* step only (one marginal, one kernel) under fixed
  names; the filter freezes a detached copy (:meth:`freeze`) before moving on, so the number of
  live parameters never grows.
* **Offline**, as an ordinary Pyro guide for a whole-trajectory model (a function that runs
  ``init`` and then ``step`` over a whole sequence): it samples the last state from the marginal
  and every earlier state backward through its own kernel, so ``SVI`` fits a Gaussian smoother.
  It discovers the model's latent sites by tracing it once, as ``AutoGuide`` does; with
  ``num_steps=T`` it holds ``T - 1`` kernels (the MLP, when used, is shared across steps).

Example:
    >>> import torch, pyro
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> ssm = LinearGaussianSSM(0.9 * torch.eye(2), 0.1 * torch.eye(2), torch.eye(2), 0.1 * torch.eye(2),
    ...                         torch.zeros(2), torch.eye(2))
    >>> def model(ys):
    ...     state = {}
    ...     ssm.init(state)
    ...     for y in ys:
    ...         ssm.step(state, y)
    >>> ys = torch.randn(5, 2)
    >>> guide = StreamingFilterGuide(2, model, num_steps=5, covariance="full")
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(ys)
    >>> guide.marginals()[0].shape
    torch.Size([5, 2])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn

from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector

__all__ = ["COVARIANCES", "BACKWARDS", "GaussianKernel", "StreamingFilterGuide"]

COVARIANCES = ("diag", "full")
BACKWARDS = ("linear", "mlp")


def _gaussian(loc: Tensor, scale: Tensor) -> dist.TorchDistribution:
    """``scale`` is a vector of standard deviations (diagonal) or a Cholesky factor (full)."""
    if scale.dim() == loc.dim():
        return dist.Normal(loc, scale).to_event(1)
    return dist.MultivariateNormal(loc, scale_tril=scale)


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
    """A frozen (detached) Gaussian backward kernel ``q(x_prev | x_next)``.

    ``mean = x_next @ weight^T + bias (+ MLP(x_next))``; ``scale`` is ``(d,)`` standard deviations
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
        return _gaussian(mean, self.scale.expand(mean.shape[:-1] + self.scale.shape))

    def covariance(self) -> Tensor:
        return torch.diag_embed(self.scale.square()) if self.scale.dim() == 1 else self.scale @ self.scale.T


class StreamingFilterGuide(pyro.nn.PyroModule):
    """Gaussian filtering marginal plus Gaussian backward kernels (a smoothing family).

    Args:
        state_dim: ``d``, the size of each latent state ``x_t``.
        model: the whole-trajectory model, needed only for offline use as a Pyro guide.
        num_steps: ``T`` for offline use (``T - 1`` kernels); ``None`` (online) keeps one kernel.
        covariance: ``"diag"`` or ``"full"``: the covariance of the marginal and of each kernel.
        backward: ``"linear"`` (mean linear in ``x_{t}``) or ``"mlp"`` (plus an MLP of ``x_t``).
        hidden_dims: hidden layer sizes of the backward MLP.
        init_scale: initial standard deviation of the marginal and the kernels.

    Parameters (fixed names, no growth over time): ``loc`` ``(d,)``; ``scale_raw`` (log standard
    deviations ``(d,)``, or the packed Cholesky factor ``(d (d+1) / 2,)``); ``bwd_weight``
    ``(K, d, d)``, ``bwd_bias`` ``(K, d)``, ``bwd_scale_raw`` ``(K, ...)`` with ``K = T - 1``
    offline and ``1`` online; ``bwd_mlp_*`` when ``backward="mlp"``.
    """

    def __init__(
        self,
        state_dim: int,
        model: Callable | None = None,
        *,
        num_steps: int | None = None,
        covariance: str = "diag",
        backward: str = "linear",
        hidden_dims: tuple[int, ...] = (32,),
        init_scale: float = 0.1,
    ):
        # Prefix the parameter names as AutoGuides do, so they cannot collide with the model's.
        super().__init__(name=type(self).__name__)
        if not isinstance(state_dim, int) or state_dim < 1:
            raise ValueError(f"state_dim must be a positive int, got {state_dim!r}")
        if covariance not in COVARIANCES:
            raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}")
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive int or None, got {num_steps!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if backward == "mlp" and (not hidden_dims or any(int(h) < 1 for h in hidden_dims)):
            raise ValueError(f"hidden_dims must be a non-empty tuple of positive ints, got {hidden_dims!r}")
        self.state_dim = state_dim
        self.covariance = covariance
        self.backward = backward
        self.hidden_dims = tuple(int(h) for h in hidden_dims)
        self.init_scale = float(init_scale)
        self.num_steps = num_steps
        # A tuple keeps the model out of nn.Module's submodule registry (as AutoGuide does).
        self._model = (model,)
        self._sites: list[str] | None = None
        d = state_dim
        self.loc = nn.Parameter(torch.zeros(d))
        self.scale_raw = nn.Parameter(self._raw_scale(torch.full((d,), self.init_scale)))
        self._make_kernels(1 if num_steps is None else num_steps - 1)

    # --- parameters --------------------------------------------------------------------------
    def _raw_scale(self, std: Tensor) -> Tensor:
        if self.covariance == "diag":
            return std.log()
        return tril_to_vector(torch.diag_embed(std))

    def _scale(self, raw: Tensor) -> Tensor:
        if self.covariance == "diag":
            return raw.exp()
        return tril_from_vector(raw, self.state_dim)

    def _make_kernels(self, K: int) -> None:
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
        return _gaussian(self.loc, self._scale(self.scale_raw))

    def kernel(self, index: int = -1) -> GaussianKernel:
        """Backward kernel ``index`` (``-1``: the current one online, ``q(x_{T-2} | x_{T-1})`` offline),
        differentiable in the parameters."""
        return GaussianKernel(self.bwd_weight[index], self.bwd_bias[index], self._scale(self.bwd_scale_raw[index]), self._mlp_params())

    def backward_distribution(self, x_next: Tensor, index: int = -1) -> dist.TorchDistribution:
        """``q(x_prev | x_next)`` for kernel ``index``; batch shape ``x_next.shape[:-1]``."""
        return self.kernel(index).distribution(x_next)

    def freeze(self) -> tuple[dist.TorchDistribution, GaussianKernel]:
        """Detached copies of the current marginal and kernel (what the online filter carries on)."""
        with torch.no_grad():
            marginal = _gaussian(self.loc.detach().clone(), self._scale(self.scale_raw.detach()).clone())
            k = self.kernel(-1)
            mlp = None if k.mlp is None else tuple(p.detach().clone() for p in k.mlp)
            return marginal, GaussianKernel(k.weight.detach().clone(), k.bias.detach().clone(), k.scale.detach().clone(), mlp)

    @torch.no_grad()
    def set_marginal(self, loc: Tensor, covariance: Tensor) -> None:
        """Sets ``q(x_t) = N(loc, covariance)`` (a diagonal guide keeps the diagonal)."""
        self.loc.copy_(loc)
        self.scale_raw.copy_(self._raw_from_cov(covariance))

    @torch.no_grad()
    def set_kernel(self, weight: Tensor, bias: Tensor, covariance: Tensor, index: int = -1) -> None:
        """Sets kernel ``index`` to ``N(x_prev | weight x_next + bias, covariance)`` (MLP part zeroed)."""
        self.bwd_weight[index] = weight
        self.bwd_bias[index] = bias
        self.bwd_scale_raw[index] = self._raw_from_cov(covariance)
        if self.backward == "mlp":
            getattr(self, f"bwd_mlp_w{len(self.hidden_dims)}").zero_()
            getattr(self, f"bwd_mlp_b{len(self.hidden_dims)}").zero_()

    def _raw_from_cov(self, covariance: Tensor) -> Tensor:
        if self.covariance == "diag":
            var = covariance if covariance.dim() == 1 else covariance.diagonal()
            return 0.5 * var.log()
        cov = covariance if covariance.dim() == 2 else torch.diag_embed(covariance)
        return tril_to_vector(torch.linalg.cholesky(cov))

    def joint_distribution(self, index: int = -1) -> dist.MultivariateNormal:
        """``q(x_{t-1}, x_t)`` as one ``2d``-dimensional Gaussian (linear kernels only), ordered
        ``(x_{t-1}, x_t)``. Online this is the current step's pair; offline pass the kernel index."""
        if self.backward != "linear":
            raise NotImplementedError("joint_distribution needs linear backward kernels (backward='linear')")
        marginal = self.filtering_distribution() if index in (-1, self.num_kernels - 1) else None
        if marginal is None:
            means, covs = self.marginals()
            m, P = means[index + 1], covs[index + 1]
        else:
            m, P = marginal.mean, _marginal_cov(marginal)
        k = self.kernel(index)
        W = k.weight
        mean = torch.cat([W @ m + k.bias, m])
        cross = W @ P
        cov = torch.cat([torch.cat([W @ P @ W.T + k.covariance(), cross], -1), torch.cat([cross.T, P], -1)], -2)
        return dist.MultivariateNormal(mean, covariance_matrix=0.5 * (cov + cov.T))

    def marginals(self) -> tuple[Tensor, Tensor]:
        """Offline: the means ``(T, d)`` and covariances ``(T, d, d)`` of every ``x_k`` under the guide,
        by pushing the last marginal back through the linear kernels (the smoother's output)."""
        if self.backward != "linear":
            raise NotImplementedError("marginals needs linear backward kernels (backward='linear')")
        marginal = self.filtering_distribution()
        means, covs = [marginal.mean], [_marginal_cov(marginal)]
        for k in range(self.num_kernels - 1, -1, -1):
            kern = self.kernel(k)
            means.append(kern.weight @ means[-1] + kern.bias)
            covs.append(kern.weight @ covs[-1] @ kern.weight.T + kern.covariance())
        return torch.stack(means[::-1]), torch.stack(covs[::-1])

    # --- offline use as a Pyro guide ---------------------------------------------------------
    def _latent_sites(self, args, kwargs) -> list[str]:
        model = self._model[0]
        if model is None:
            raise ValueError("StreamingFilterGuide needs the whole-trajectory model to be used as a guide: StreamingFilterGuide(d, model)")
        with poutine.block():
            trace = poutine.trace(model).get_trace(*args, **kwargs)
        names = []
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
                continue
            if tuple(site["value"].shape) != (self.state_dim,):
                raise ValueError(f"site '{name}' has shape {tuple(site['value'].shape)}; StreamingFilterGuide expects ({self.state_dim},)")
            names.append(name)
        if not names:
            raise ValueError("the model has no latent sample sites")
        if len(names) - 1 != self.num_kernels:
            if self.num_steps is not None:
                raise ValueError(f"num_steps={self.num_steps} but the model has {len(names)} latent sites")
            self.num_steps = len(names)
            self._make_kernels(len(names) - 1)
        return names

    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        """Samples the last latent site from the marginal, then each earlier one backward."""
        if self._sites is None:
            self._sites = self._latent_sites(args, kwargs)
        names = self._sites
        x = pyro.sample(names[-1], self.filtering_distribution())
        out = {names[-1]: x}
        for k in range(len(names) - 2, -1, -1):
            x = pyro.sample(names[k], self.backward_distribution(x, k))
            out[names[k]] = x
        return out


def _marginal_cov(marginal: dist.TorchDistribution) -> Tensor:
    if isinstance(marginal, dist.MultivariateNormal):
        return marginal.covariance_matrix
    return torch.diag_embed(marginal.variance)
