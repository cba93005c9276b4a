"""Data-parallel SVI with ``torch.distributed``: average losses and gradients across ranks.

:class:`DistributedELBO` wraps any ``pyro.infer.ELBO`` (our :class:`~pyro_smc.SMCELBO`,
``Trace_ELBO``, ``TraceMeanField_ELBO``, ...). Each rank computes the wrapped ELBO's loss and
gradients on its own share of the work, then the gradients of every parameter in Pyro's param
store, and of the model's and guide's own parameters when they are modules (a ``PyroModule``
under ``pyro.settings.set(module_local_params=True)`` keeps them out of the store), are averaged
with one ``all_reduce`` per dtype (gloo on CPU, NCCL on GPU), so ``SVI``'s optimiser
step is the same on every rank and the parameters stay in sync. Two ways to share the work:

* **Independent filters.** ``SMCELBO(num_filters=B)`` is ``-mean_b log Z_b``; with ``W`` ranks each
  running ``B / W`` filters (seeded differently), the averaged gradient is that of ``B`` filters.
* **Sharded minibatches.** A model with ``pyro.plate("data", N, subsample=idx)`` scales each
  rank's shard by ``N / len(idx)``; with equal shards the average of the ranks' losses is the loss
  of their union, so the averaged gradient is the gradient of the whole (global) minibatch.

Every rank must start from the same parameters: seed each rank identically before the first SVI
step (or call :func:`broadcast_params` after it), then reseed per rank for the data/particles.

Example (``torchrun --nproc_per_node=2 script.py``)::

    import torch.distributed as dist
    from pyro_smc.distributed import DistributedELBO
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pyro.set_rng_seed(0)                     # identical initial parameters everywhere
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), DistributedELBO(Trace_ELBO()))
    for step in range(1000):
        idx = torch.randperm(N, generator=g)[:batch]           # same global batch on all ranks
        svi.step(x, y, subsample=idx.chunk(world)[rank])      # each rank its shard
    dist.destroy_process_group()             # without it gloo may abort the process at exit
"""

from __future__ import annotations

import pyro
import torch
import torch.distributed as dist
from pyro.infer import ELBO

__all__ = ["DistributedELBO", "broadcast_params"]


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _params(*owners: object) -> list[tuple[str, torch.Tensor]]:
    """The trainable tensors: Pyro's param store, then those of each ``torch.nn.Module`` in
    ``owners`` (the model and guide) not already among them, in an order every rank shares."""
    # Sorted names: every rank must reduce the same tensors in the same order.
    store = pyro.get_param_store()
    params = [(name, store[name].unconstrained()) for name in sorted(store.keys())]
    # With pyro.settings.set(module_local_params=True) a PyroModule keeps its parameters out of
    # the store: reducing the store alone averaged nothing, and the ranks drifted apart silently.
    seen = {id(p) for _, p in params}
    for k, owner in enumerate(owners):
        if isinstance(owner, torch.nn.Module):
            for name, p in owner.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append((f"{k}.{name}", p))
    return params


def broadcast_params(src: int = 0, *modules: torch.nn.Module) -> None:
    """Copies every parameter in Pyro's param store, and those of ``modules``, from rank ``src``
    to all ranks.

    Without an initialised process group (or with one rank) it does nothing.

    Args:
        src: the rank whose parameters every rank takes.
        *modules: modules whose parameters live outside the param store (a ``PyroModule`` model or
            guide under ``pyro.settings.set(module_local_params=True)``).

    Returns:
        ``None``; the param store's tensors (any shape) are overwritten in place.

    Example:
        >>> import pyro, torch
        >>> from pyro_smc.distributed import broadcast_params
        >>> pyro.clear_param_store()
        >>> loc = pyro.param("loc", torch.ones(2))
        >>> broadcast_params(src=0)                          # one process: a no-op
        >>> pyro.param("loc")
        tensor([1., 1.], requires_grad=True)
    """
    if _world() == 1:
        return
    with torch.no_grad():
        for _, p in _params(*modules):
            dist.broadcast(p.data, src)


class DistributedELBO(ELBO):
    """Averages the wrapped ELBO's loss and gradients over the ranks of ``torch.distributed``.

    Without an initialised process group (or with one rank) it is the wrapped ELBO unchanged.

    Args:
        elbo: any ``pyro.infer.ELBO`` instance.

    Returns:
        ``loss`` and ``loss_and_grads`` return the rank-averaged loss (a float);
        ``differentiable_loss`` this rank's loss, a scalar tensor (shape ``()``).

    Raises:
        ValueError: ``elbo`` is not a ``pyro.infer.ELBO``.

    Example:
        In a single process the wrapped ELBO's loss comes back unchanged:

        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro.infer import Trace_ELBO
        >>> from pyro_smc.distributed import DistributedELBO
        >>> def model():
        ...     pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> def guide():
        ...     pyro.sample("z", dist.Normal(pyro.param("loc", torch.tensor(0.5)), 1.0))
        >>> pyro.clear_param_store()
        >>> elbo = DistributedELBO(Trace_ELBO(num_particles=10))
        >>> pyro.set_rng_seed(0)
        >>> loss = elbo.loss(model, guide)
        >>> pyro.set_rng_seed(0)
        >>> loss == Trace_ELBO(num_particles=10).loss(model, guide)
        True
    """

    def __init__(self, elbo: ELBO):
        if not isinstance(elbo, ELBO):
            raise ValueError(f"elbo must be a pyro.infer.ELBO, got {type(elbo).__name__}")
        super().__init__(num_particles=elbo.num_particles, max_plate_nesting=elbo.max_plate_nesting)
        self.elbo = elbo

    def _mean(self, value: float) -> float:
        if _world() == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / _world()

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The rank-averaged loss."""
        return self._mean(self.elbo.loss(model, guide, *args, **kwargs))

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """This rank's differentiable loss (gradients are averaged only by :meth:`loss_and_grads`)."""
        return self.elbo.differentiable_loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """The wrapped ``loss_and_grads``, then one ``all_reduce`` of every parameter's gradient:
        the param store's, and the model's and guide's own when they are modules."""
        loss = self.elbo.loss_and_grads(model, guide, *args, **kwargs)
        world = _world()
        if world > 1:
            params = [p for _, p in _params(model, guide)]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            # One flat buffer per dtype/device keeps it to a few collectives.
            groups: dict[tuple, list[int]] = {}
            for i, g in enumerate(grads):
                groups.setdefault((g.dtype, g.device), []).append(i)
            for index in groups.values():
                flat = torch.cat([grads[i].reshape(-1) for i in index])
                dist.all_reduce(flat)
                flat /= world
                offset = 0
                for i in index:
                    n = grads[i].numel()
                    params[i].grad = flat[offset : offset + n].view_as(params[i]).clone()
                    offset += n
        return self._mean(loss)

    def _get_trace(self, model, guide, args, kwargs):
        return self.elbo._get_trace(model, guide, args, kwargs)
