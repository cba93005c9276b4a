r"""The whitened coordinates in which the online filter's optimiser fits one step of a
:class:`~pyro_smc.guides.streaming.family.StreamingFamily` (:class:`StepFrame`).

See ``docs/math/streaming.md`` and :class:`StepFrame` for the parametrisation: the step's mean,
covariance factor and current backward kernel are moved in units of the distribution at the start
of the step, so that one unit of any variable is one unit of Mahalanobis distance whatever the
units and the orientation of the state.

Example:
    >>> import torch
    >>> from pyro_smc.guides.streaming.family import StreamingFamily
    >>> from pyro_smc.guides.streaming.frame import StepFrame
    >>> q = StreamingFamily(2)
    >>> frame = StepFrame(q)
    >>> params = frame.parameters(frame.variables())  # all zero: the start itself
    >>> all(torch.allclose(params[name], p) for name, p in q.named_parameters())
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_smc.guides.streaming.family import StreamingFamily
from pyro_smc.ops.gaussian import tril_from_vector, tril_to_vector

__all__ = ["StepFrame"]


class StepFrame:
    """Whitened coordinates of a :class:`StreamingFamily` around its parameters at one moment.

    The online filter fits each step's marginal and kernel by Adam, whose iterations move every
    coordinate by about the learning rate in that coordinate's units. In the units of the state
    that is no step size at all: a posterior ``1e4`` times narrower along some direction (a
    precise observation, possibly of a combination of coordinates) is left by any step that is
    fine across it. So the optimiser moves whitened variables ``w`` (zero at the start) instead,
    with ``m_0, L_0`` the start's mean and covariance factor and ``L^k_0`` the kernel's:

    * mean ``m = m_0 + L_0 u``; covariance factor ``L = L_0 T(v)`` (``T`` lower triangular with
      logs on its diagonal, ``T(0) = I``; the diagonal family has ``L = L_0 diag(e^v)``);
    * kernel mean ``W x + b = W_0 x + b_0 + L^k_0 (A L_0^{-1} (x - m_0) + c)``, so that ``A`` and ``c``
      act on the whitened ``x_t`` and move the kernel's mean in its own standard deviations, and
      ``c`` alone at ``x_t = m_0``; kernel factor ``L^k = L^k_0 T(v^k)``;
    * an MLP correction: its first layer on the whitened ``x_t``, its output in ``L^k_0`` units.

    A unit of any ``w`` is then a unit of Mahalanobis distance (or a factor ``e`` in a standard
    deviation) of the distribution at the start, whatever the units and the orientation of the
    state; rescaling the state rescales the whole fit. Only the last kernel is in the frame (the
    current one online); the others keep their values.

    Args:
        family: the family; its current parameters are the frame's origin.

    Example:
        >>> import torch
        >>> q = StreamingFamily(2, covariance="full")
        >>> q.set_marginal(torch.tensor([1.0, 2.0]), torch.tensor([[1e-4, 0.0], [0.0, 4.0]]))
        >>> frame = StepFrame(q)
        >>> w = frame.variables()
        >>> w["loc"] = torch.tensor([1.0, 1.0])  # one sd in each direction
        >>> frame.parameters(w)["loc"]
        tensor([1.0100, 4.0000])
    """

    def __init__(self, family: StreamingFamily):
        self.family = family
        with torch.no_grad():
            d = family.state_dim
            self.base = {name: p.detach().clone() for name, p in family.named_parameters()}
            self.loc0 = family.loc.detach().clone()
            self.tril0 = self._tril(family.scale_raw.detach())
            eye = torch.eye(d, dtype=self.loc0.dtype, device=self.loc0.device)
            self.tril0_inv = torch.linalg.solve_triangular(self.tril0, eye, upper=False)
            self.z0 = self.tril0_inv @ self.loc0  # the start's mean in whitened units
            self.kernel_tril0 = self._tril(family.bwd_scale_raw[-1].detach())

    def _tril(self, raw: Tensor) -> Tensor:
        scale = self.family._scale(raw)
        return torch.diag_embed(scale) if self.family.covariance == "diag" else scale

    def _raw(self, tril0: Tensor, v: Tensor) -> Tensor:
        if self.family.covariance == "diag":
            return tril0.diagonal().log() + v
        return tril_to_vector(tril0 @ tril_from_vector(v, self.family.state_dim))

    def variables(self) -> dict[str, Tensor]:
        """The whitened variables, all zero (leaves that require grad)."""
        d, like = self.family.state_dim, self.loc0
        n = d if self.family.covariance == "diag" else d * (d + 1) // 2
        shapes = {"loc": (d,), "scale": (n,), "weight": (d, d), "bias": (d,), "kernel_scale": (n,)}
        shapes.update({name: tuple(p.shape) for name, p in self.base.items() if name.startswith("bwd_mlp_")})
        return {name: like.new_zeros(shape).requires_grad_(True) for name, shape in shapes.items()}

    def parameters(self, w: dict[str, Tensor]) -> dict[str, Tensor]:
        """The family's parameters at the whitened point ``w`` (differentiable in ``w``), by the
        names of ``named_parameters()``."""
        base, k = self.base, self.family.num_kernels - 1
        A, c = w["weight"], w["bias"]
        weight = base["bwd_weight"][k] + self.kernel_tril0 @ A @ self.tril0_inv
        bias = base["bwd_bias"][k] + self.kernel_tril0 @ (c - A @ self.z0)
        out = {
            "loc": self.loc0 + self.tril0 @ w["loc"],
            "scale_raw": self._raw(self.tril0, w["scale"]),
            "bwd_weight": torch.cat([base["bwd_weight"][:k], weight.unsqueeze(0)]),
            "bwd_bias": torch.cat([base["bwd_bias"][:k], bias.unsqueeze(0)]),
            "bwd_scale_raw": torch.cat([base["bwd_scale_raw"][:k], self._raw(self.kernel_tril0, w["kernel_scale"]).unsqueeze(0)]),
        }
        if self.family.backward == "mlp":
            last = len(self.family.hidden_dims)
            for i in range(last + 1):
                dw, db = w[f"bwd_mlp_w{i}"], w[f"bwd_mlp_b{i}"]
                w0, b0 = base[f"bwd_mlp_w{i}"], base[f"bwd_mlp_b{i}"]
                if i == 0:  # on the whitened x_t, centred at the start's mean
                    w0, b0, dw, db = w0, b0 - dw @ self.z0, dw @ self.tril0_inv, db
                if i == last:  # the output adds to the kernel's mean, in its units
                    dw, db = self.kernel_tril0 @ dw, self.kernel_tril0 @ db
                out[f"bwd_mlp_w{i}"], out[f"bwd_mlp_b{i}"] = w0 + dw, b0 + db
        return out
