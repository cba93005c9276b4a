r"""``StreamingFilterGuide``: the backward-factorised family in its two roles.

See ``docs/math/streaming.md#backward-factorised-variational-family``.

    :math:`q_t(x_{1:t}) = q_t(x_t) \prod_{k < t} q_{k+1}(x_k \mid x_{k+1})`

The family itself (a Gaussian filtering marginal and Gaussian backward kernels, with ``set_*``,
:meth:`~StreamingFamily.freeze` and :meth:`~StreamingFamily.marginals`) is
:class:`~pyro_smc.guides.streaming.family.StreamingFamily`. :class:`StreamingFilterGuide` is that
family plus the behaviour of a whole-trajectory Pyro guide, and so serves two roles:

* **Online** (per step): ``StreamingFilterGuide(state_dim)``, with no model and no ``num_steps``,
  is the family that :class:`~pyro_smc.OnlineVariationalFilter` trains one step at a time: one
  marginal and one kernel under fixed names, frozen by the filter before it moves on.
* **Offline** (whole trajectory): ``StreamingFilterGuide(state_dim, model, num_steps=T)`` is an
  ordinary Pyro guide for ``model``, a function that runs ``init`` and then ``step`` over a whole
  sequence. Its ``forward(*args)`` samples the last latent site from the marginal and every
  earlier one backward through its own kernel, so ``SVI`` fits a Gaussian smoother. It finds the
  model's latent sites by tracing it once, as ``AutoGuide`` does; without ``num_steps`` it sizes
  its :math:`T - 1` kernels from that trace (the MLP, when used, is shared across steps).

Example:
    >>> import torch, pyro
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> ssm = LinearGaussianSSM(
    ...     0.9 * torch.eye(2),
    ...     0.1 * torch.eye(2),
    ...     torch.eye(2),
    ...     0.1 * torch.eye(2),
    ...     torch.zeros(2),
    ...     torch.eye(2),
    ... )
    >>> def model(ys):
    ...     state = {}
    ...     ssm.init(state)
    ...     for y in ys:
    ...         ssm.step(state, y)
    >>> ys = torch.randn(5, 2)
    >>> # offline role
    >>> guide = StreamingFilterGuide(2, model, num_steps=5, covariance="full")
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(ys)
    >>> guide.marginals()[0].shape
    torch.Size([5, 2])
    >>> StreamingFilterGuide(2).num_kernels  # online role
    1
"""

from __future__ import annotations

from typing import Callable

import pyro
from torch import Tensor

from pyro_smc.guides.streaming.family import BACKWARDS, COVARIANCES, GaussianKernel, StreamingFamily
from pyro_smc.tracing import latent_sites, trace_program

__all__ = ["COVARIANCES", "BACKWARDS", "GaussianKernel", "StreamingFamily", "StreamingFilterGuide"]


class StreamingFilterGuide(StreamingFamily):
    """The backward-factorised Gaussian family, usable online (per step) or as a whole-trajectory guide.

    Args:
        state_dim: ``d``, the size of each latent state :math:`x_t`.
        model: the whole-trajectory model; needed only in the offline role (as a Pyro guide).
        num_steps: ``T`` for the offline role (:math:`T - 1` kernels); ``None`` keeps one kernel (the
            online role) until the guide is first called as a Pyro guide, which sizes it from
            the model's trace.
        covariance: ``"diag"`` or ``"full"``: the covariance of the marginal and of each kernel.
        backward: ``"linear"`` (mean linear in :math:`x_{t}`) or ``"mlp"`` (plus an MLP of :math:`x_t`).
        hidden_dims: hidden layer sizes of the backward MLP.
        init_scale: initial standard deviation of the marginal and the kernels.

    Parameters (fixed names, no growth over time) are those of
    :class:`~pyro_smc.guides.streaming.family.StreamingFamily` with :math:`K = T - 1` offline and
    :math:`K = 1` online, prefixed ``StreamingFilterGuide``.

    Called as a Pyro guide it returns ``{site name: value (d,)}`` for every latent site of the
    model (see :meth:`forward`).

    Raises:
        ValueError: ``num_steps`` is not a positive int or ``None``, or a family argument is
            invalid (as for ``StreamingFamily``).

    Example:
        The offline role: one draw of a whole trajectory, the last state from the marginal and
        each earlier one through its backward kernel.

        >>> import torch, pyro
        >>> from pyro_smc.guides import StreamingFilterGuide
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> def model(ys):
        ...     state = {}
        ...     ssm.init(state)
        ...     for y in ys:
        ...         ssm.step(state, y)
        >>> pyro.clear_param_store()
        >>> pyro.set_rng_seed(0)
        >>> guide = StreamingFilterGuide(2, model, num_steps=3)
        >>> draw = guide(torch.zeros(3, 2))                           # ys: (T, dy)
        >>> len(draw), {value.shape for value in draw.values()}, guide.num_kernels, guide.online
        (3, {torch.Size([2])}, 2, False)
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
        if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive int or None, got {num_steps!r}")
        num_kernels = 1 if num_steps is None else num_steps - 1
        super().__init__(state_dim, num_kernels=num_kernels, covariance=covariance, backward=backward, hidden_dims=hidden_dims, init_scale=init_scale)
        self.num_steps = num_steps
        # A tuple keeps the model out of nn.Module's submodule registry (as AutoGuide does).
        self._model = (model,)
        self._sites: list[str] | None = None

    @property
    def online(self) -> bool:
        """Whether the guide is in its online role (built without ``num_steps`` and never yet
        called as a whole-trajectory guide, which fixes ``num_steps``)."""
        return self.num_steps is None

    # --- the offline role: a whole-trajectory Pyro guide --------------------------------------
    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        """Samples the model's last latent site from the marginal, then each earlier one backward.

        Args:
            *args: the whole-trajectory model's positional arguments (as for any Pyro guide).
            **kwargs: its keyword arguments.

        Returns:
            ``{site name: value (d,)}`` for every latent site of the model.
        """
        if self._sites is None:
            self._sites = self._latent_sites(args, kwargs)
        names = self._sites
        x = pyro.sample(names[-1], self.filtering_distribution())
        out = {names[-1]: x}
        for k in range(len(names) - 2, -1, -1):
            x = pyro.sample(names[k], self.backward_distribution(x, k))
            out[names[k]] = x
        return out

    def _latent_sites(self, args: tuple, kwargs: dict) -> list[str]:
        """The model's latent site names in time order, from one blocked discovery trace; sizes
        the kernels to them when ``num_steps`` was not given."""
        model = self._model[0]
        if model is None:
            raise ValueError("StreamingFilterGuide needs the whole-trajectory model to be used as a guide: StreamingFilterGuide(d, model)")
        trace = trace_program(model, *args, **kwargs)
        names = latent_sites(trace)
        for name in names:
            shape = tuple(trace.nodes[name]["value"].shape)
            if shape != (self.state_dim,):
                raise ValueError(f"site '{name}' has shape {shape}; StreamingFilterGuide expects ({self.state_dim},)")
        if not names:
            raise ValueError("the model has no latent sample sites")
        if len(names) - 1 != self.num_kernels:
            if self.num_steps is not None:
                raise ValueError(f"num_steps={self.num_steps} but the model has {len(names)} latent sites")
            self.num_steps = len(names)
            self._make_kernels(len(names) - 1)
        return names
