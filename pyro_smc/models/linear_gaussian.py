r"""Linear-Gaussian state-space model: a runnable Pyro model and its exact Kalman oracle.

See ``docs/math/ep.md#kalman-filter``.

:math:`x_1 \sim \mathcal N(\mathrm{init\_mean}, \mathrm{init\_cov})`, :math:`x_t = A x_{t-1} + \mathcal N(0, Q)`, :math:`y_t = C x_t + \mathcal N(0, R)`.
The model follows the ``init``/``step`` protocol of :class:`pyro_smc.SMC` (and of
``pyro.infer.SMCFilter``): ``step(state, y)`` samples the latent site ``f"x_{t}"`` and observes
``f"y_{t}"``, with ``t`` the 0-based time index. :meth:`kalman_filter`, :meth:`rts_smoother` and
:meth:`log_evidence` give the exact answers that every test compares against. Both models satisfy
:class:`~pyro_smc.models.protocol.GaussianStateSpaceModel`, so :class:`pyro_smc.EPSmoother` and the
Gaussian filters and smoothers take them as they are (and reproduce the Kalman answers).

Example:
    >>> import torch
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> xs, ys = ssm.simulate(50)
    >>> float(ssm.log_evidence(ys)) < 0
    True
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch import Tensor

from pyro_smc.ops import kalman

__all__ = ["DiagonalLinearGaussianSSM", "LinearGaussianSSM"]


def _check_matrix(name: str, value: Tensor, shape: tuple[int, int], psd: bool = False, like: Tensor | None = None) -> Tensor:
    if not isinstance(value, Tensor):
        value = torch.as_tensor(value, dtype=torch.get_default_dtype() if like is None else like.dtype)
    if like is not None and (value.dtype != like.dtype or value.device != like.device):
        raise ValueError(f"{name} has dtype {value.dtype} on {value.device}, but A {like.dtype} on {like.device}: give the model one dtype and device")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} has non-finite entries")
    if psd:
        if not torch.allclose(value, value.transpose(-1, -2), rtol=1e-5, atol=1e-8):
            raise ValueError(f"{name} must be symmetric")
        if torch.linalg.cholesky_ex(value).info.item() != 0:
            raise ValueError(f"{name} must be positive definite")
    return value


class LinearGaussianSSM(PyroModule):
    """Linear-Gaussian state-space model with an exact Kalman oracle.

    Args:
        A: transition matrix ``(d, d)``.
        Q: transition noise covariance ``(d, d)``, positive definite.
        C: emission matrix ``(dy, d)``.
        R: observation noise covariance ``(dy, dy)``, positive definite.
        init_mean: mean of :math:`x_1` ``(d,)``.
        init_cov: covariance of :math:`x_1` ``(d, d)``, positive definite.

    Raises:
        ValueError: the matrices' shapes, dtypes or devices do not agree (``A`` sets the model's),
            an entry is not finite, or a covariance is not positive definite.

    Example:
        >>> import torch
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.5 * eye, eye, eye[:1], torch.eye(1), torch.zeros(2), eye)
        >>> xs, ys = ssm.simulate(5)                                  # (T, d), (T, dy)
        >>> xs.shape, ys.shape
        (torch.Size([5, 2]), torch.Size([5, 1]))
        >>> ssm.rts_smoother(ys).covariances.shape                    # exact, (T, d, d)
        torch.Size([5, 2, 2])
        >>> bool(
        ...     torch.isclose(
        ...         ssm.log_evidence(ys), ssm.kalman_filter(ys).log_evidence_increments.sum()
        ...     )
        ... )
        True
    """

    def __init__(self, A: Tensor, Q: Tensor, C: Tensor, R: Tensor, init_mean: Tensor, init_cov: Tensor):
        super().__init__()
        A = torch.as_tensor(A, dtype=torch.get_default_dtype()) if not isinstance(A, Tensor) else A
        C = torch.as_tensor(C, dtype=torch.get_default_dtype()) if not isinstance(C, Tensor) else C
        if A.dim() != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"A must be a square matrix, got shape {tuple(A.shape)}")
        d = A.shape[0]
        if C.dim() != 2 or C.shape[1] != d:
            raise ValueError(f"C must have shape (dy, {d}), got {tuple(C.shape)}")
        dy = C.shape[0]
        if not A.is_floating_point():
            raise ValueError(f"A must be a floating-point tensor (it sets the model's dtype), got {A.dtype}")
        self.register_buffer("A", _check_matrix("A", A, (d, d)))
        self.register_buffer("Q", _check_matrix("Q", Q, (d, d), psd=True, like=A))
        self.register_buffer("C", _check_matrix("C", C, (dy, d), like=A))
        if isinstance(R, Tensor) and R.dim() == 2 and R.shape[0] == R.shape[1] != dy:
            # C and R disagree on the observation size; either may be the wrong one.
            raise ValueError(f"R has shape {tuple(R.shape)} but C has {dy} rows: the observation size must agree (R ({dy}, {dy}) for this C)")
        self.register_buffer("R", _check_matrix("R", R, (dy, dy), psd=True, like=A))
        if isinstance(init_mean, Tensor) and (init_mean.dtype != A.dtype or init_mean.device != A.device):
            raise ValueError(f"init_mean has dtype {init_mean.dtype} on {init_mean.device}, but A {A.dtype} on {A.device}: give the model one dtype and device")
        init_mean = torch.as_tensor(init_mean, dtype=A.dtype, device=A.device)
        if tuple(init_mean.shape) != (d,):
            raise ValueError(f"init_mean must have shape ({d},), got {tuple(init_mean.shape)}")
        self.register_buffer("init_mean", init_mean)
        if not bool(torch.isfinite(init_mean).all()):
            raise ValueError("init_mean has non-finite entries")
        self.register_buffer("init_cov", _check_matrix("init_cov", init_cov, (d, d), psd=True, like=A))
        self._t = 0

    @property
    def state_dim(self) -> int:
        """``d``, the rows of ``A``."""
        return self.A.shape[0]

    @property
    def obs_dim(self) -> int:
        """``e``, the rows of ``C``."""
        return self.C.shape[0]

    # --- the Gaussian-engine protocol -------------------------------------------------------
    @property
    def transition_cov(self) -> Tensor:
        """``Q`` ``(d, d)``."""
        return self.Q

    @property
    def observation_cov(self) -> Tensor:
        """``R`` ``(e, e)``."""
        return self.R

    def transition_fn(self, x: Tensor, t: int) -> Tensor:
        """:math:`A x` for ``x`` of shape ``(..., d)``."""
        return x @ self.A.transpose(-1, -2)

    transition_fn.time_invariant = True  # the projections may batch it over time

    def observation_fn(self, x: Tensor, t: int) -> Tensor:
        """:math:`C x` for ``x`` of shape ``(..., d)``."""
        return x @ self.C.transpose(-1, -2)

    observation_fn.time_invariant = True  # the projections may batch it over time

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, None]:
        """(:math:`A x`, ``None``): linear, no predictive variance."""
        return self.transition_fn(x, t), None

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, None]:
        """(:math:`C x`, ``None``): linear, no predictive variance."""
        return self.observation_fn(x, t), None

    # --- the SMC protocol -------------------------------------------------------------------
    def init(self, state: dict) -> None:
        """Starts a new sequence; the first :meth:`step` samples :math:`x_0` from the prior."""
        self._t = 0
        self._factorise(self.Q, self.R, self.init_cov)

    def _factorise(self, Q: Tensor, R: Tensor, init_cov: Tensor) -> None:
        """The Cholesky factors of ``Q``, ``R`` and ``init_cov``, made once per sequence and kept
        with the tensors they factor: :meth:`step` makes them again when a matrix is another
        tensor than the one factorised (a ``PyroSample`` prior on ``Q`` under ``SMC2`` or
        ``PMMH``, whose filters carry different draws; a cache made in ``init`` alone went stale
        when SMC2 resampled its filters: log-evidence 1.2 nats low, the posterior of ``Q``
        4 standard errors off)."""
        self._sources = (Q, R, init_cov)
        self._scale_q = torch.linalg.cholesky(Q)
        self._scale_r = torch.linalg.cholesky(R)
        self._scale_0 = torch.linalg.cholesky(init_cov)
        # With a diagonal R the observation's entries are independent: observed as a Normal of
        # independent entries, so a partly missing observation can leave the missing ones out.
        diagonal = R.diagonal(dim1=-2, dim2=-1)
        self._obs_sd = diagonal.sqrt() if bool((R == torch.diag_embed(diagonal)).all()) else None

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples :math:`x_t` given ``state["x"]`` (or from the prior at :math:`t = 0`) and observes :math:`y_t`."""
        t = self._t
        Q, R, init_cov = self.Q, self.R, self.init_cov
        if not all(now is then for now, then in zip((Q, R, init_cov), self._sources)):
            self._factorise(Q, R, init_cov)
        # The scale factors are Cholesky factors made in init (which raises on a non-PD matrix), so
        # validating them again at every step only costs time: about 0.4 ms per distribution for a
        # batch of 32 x 100 particles, 15% of an OT filter's run. Non-finite means or observations
        # are still caught, by the engines' own checks of the observations and the weights.
        if "x" in state:
            prior = dist.MultivariateNormal(state["x"] @ self.A.transpose(-1, -2), scale_tril=self._scale_q, validate_args=False)
        else:
            prior = dist.MultivariateNormal(self.init_mean, scale_tril=self._scale_0, validate_args=False)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        # Checked on the handler path; a compiled step's recording (whose shapes are traced values,
        # and whose later steps have this step's shapes) skips it.
        if y is not None and not torch.jit.is_tracing() and tuple(y.shape[-1:]) != tuple(self.C.shape[-2:-1]):
            raise ValueError(f"observation y_{t} has shape {tuple(y.shape)}, but the model observes vectors of size {self.C.shape[-2]}")
        mean = x @ self.C.transpose(-1, -2)
        if self._obs_sd is not None:
            likelihood = dist.Normal(mean, self._obs_sd, validate_args=False).to_event(1)
        else:
            likelihood = dist.MultivariateNormal(mean, scale_tril=self._scale_r, validate_args=False)
        return pyro.sample(f"y_{t}", likelihood, obs=y)

    # --- the exact oracle -------------------------------------------------------------------
    def kalman_filter(self, ys: Tensor) -> kalman.FilterResult:
        r"""Exact filtering distributions :math:`p(x_t \mid y_{1:t})` for ``ys`` of shape ``(T, dy)``."""
        return kalman.kalman_filter(ys, self.A, self.Q, self.C, self.R, self.init_mean, self.init_cov)

    def rts_smoother(self, ys: Tensor) -> kalman.SmootherResult:
        r"""Exact smoothing distributions :math:`p(x_t \mid y_{1:T})`."""
        return kalman.rts_smoother(self.kalman_filter(ys), self.A)

    def log_evidence(self, ys: Tensor) -> Tensor:
        r"""Exact :math:`\log p(y_{1:T})`."""
        return self.kalman_filter(ys).log_evidence

    @torch.no_grad()
    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws ``(xs, ys)`` of shapes ``(T, d)`` and ``(T, dy)`` from the model."""
        d, dy = self.state_dim, self.obs_dim
        sq, sr, s0 = (torch.linalg.cholesky(m) for m in (self.Q, self.R, self.init_cov))
        noise = lambda n: torch.randn(n, dtype=self.A.dtype, device=self.A.device, generator=generator)  # noqa: E731
        xs, ys = [], []
        x = self.init_mean + s0 @ noise(d)
        for t in range(num_steps):
            if t > 0:
                x = self.A @ x + sq @ noise(d)
            xs.append(x)
            ys.append(self.C @ x + sr @ noise(dy))
        return torch.stack(xs), torch.stack(ys)


class DiagonalLinearGaussianSSM(PyroModule):
    r"""Linear-Gaussian model with learnable diagonal dynamics and emissions (``PyroParam`` attributes).

    :math:`x_1 \sim \mathcal N(0, \mathrm{init\_scale}^2 I)`, :math:`x_t = \operatorname{diag}(a) x_{t-1} + \mathcal N(0, q^2 I)`, :math:`y_t = \operatorname{diag}(c) x_t +
    \mathcal N(0, r^2 I)`: the parameter-learning setting of Campbell et al. (2021, Figure 1b), :math:`2d`
    parameters ``a`` (``transition_diag``) and ``c`` (``emission_diag``). :meth:`as_linear_gaussian`
    freezes the current values into a :class:`LinearGaussianSSM`, whose Kalman filter is the oracle.
    The Gaussian engines read the live (differentiable) parameters through the same protocol.

    Args:
        transition_diag: initial ``a`` ``(d,)``.
        emission_diag: initial ``c`` ``(d,)``.
        transition_scale: :math:`q > 0`.
        observation_scale: :math:`r > 0`.
        init_scale: standard deviation of :math:`x_1`.

    Raises:
        ValueError: ``transition_diag`` and ``emission_diag`` are not vectors of one length, or
            a scale is not positive.

    Example:
        The Gaussian filter on the live parameters agrees with the frozen Kalman oracle, and its
        log-evidence is differentiable in them:

        >>> import torch
        >>> from pyro_smc.infer import gaussian_filter
        >>> from pyro_smc.models import DiagonalLinearGaussianSSM
        >>> _ = torch.manual_seed(0)
        >>> ssm = DiagonalLinearGaussianSSM(torch.tensor([0.9, 0.5]), torch.ones(2), 0.5, 0.5)
        >>> _, ys = ssm.simulate(5)                                   # (T, d)
        >>> log_z = gaussian_filter(ssm, ys).log_evidence
        >>> (
        ...     bool(torch.isclose(log_z, ssm.as_linear_gaussian().log_evidence(ys))),
        ...     log_z.requires_grad,
        ... )
        (True, True)
    """

    def __init__(self, transition_diag: Tensor, emission_diag: Tensor, transition_scale: float, observation_scale: float, init_scale: float = 1.0):
        super().__init__()
        a, c = torch.as_tensor(transition_diag), torch.as_tensor(emission_diag)
        if a.dim() != 1 or c.shape != a.shape:
            raise ValueError(f"transition_diag and emission_diag must be vectors of one length, got {tuple(a.shape)} and {tuple(c.shape)}")
        for name, value in (("transition_scale", transition_scale), ("observation_scale", observation_scale), ("init_scale", init_scale)):
            if not float(value) > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.transition_diag = PyroParam(a.clone())
        self.emission_diag = PyroParam(c.clone())
        self.transition_scale = float(transition_scale)
        self.observation_scale = float(observation_scale)
        self.init_scale = float(init_scale)
        self._t = 0

    @property
    def state_dim(self) -> int:
        """``d``, the length of the transition diagonal."""
        return self.transition_diag.shape[0]

    @property
    def obs_dim(self) -> int:
        """``d`` as well: one observation per coordinate."""
        return self.emission_diag.shape[0]

    # --- the Gaussian-engine protocol -------------------------------------------------------
    def _scaled_eye(self, scale: float) -> Tensor:
        a = self.transition_diag
        return scale**2 * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)

    @property
    def init_mean(self) -> Tensor:
        """``(d,)`` zeros."""
        return torch.zeros_like(self.transition_diag)

    @property
    def init_cov(self) -> Tensor:
        r""":math:`\mathrm{init\_scale}^2 I`."""
        return self._scaled_eye(self.init_scale)

    @property
    def transition_cov(self) -> Tensor:
        r""":math:`\mathrm{transition\_scale}^2 I`."""
        return self._scaled_eye(self.transition_scale)

    @property
    def observation_cov(self) -> Tensor:
        r""":math:`\mathrm{observation\_scale}^2 I`."""
        return self._scaled_eye(self.observation_scale)

    def transition_fn(self, x: Tensor, t: int) -> Tensor:
        r""":math:`\operatorname{diag}(a) x` for ``x`` of shape ``(..., d)``."""
        return x * self.transition_diag

    transition_fn.time_invariant = True  # the projections may batch it over time

    def observation_fn(self, x: Tensor, t: int) -> Tensor:
        r""":math:`\operatorname{diag}(c) x` for ``x`` of shape ``(..., d)``."""
        return x * self.emission_diag

    observation_fn.time_invariant = True  # the projections may batch it over time

    def transition_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, None]:
        r"""(:math:`\operatorname{diag}(a) x`, ``None``)."""
        return self.transition_fn(x, t), None

    def observation_mean_var(self, x: Tensor, t: int) -> tuple[Tensor, None]:
        r"""(:math:`\operatorname{diag}(c) x`, ``None``)."""
        return self.observation_fn(x, t), None

    # --- the SMC protocol -------------------------------------------------------------------
    def init(self, state: dict) -> None:
        """Starts a new sequence; the first :meth:`step` samples :math:`x_0` from the prior."""
        self._t = 0

    def step(self, state: dict, y: Tensor | None = None) -> Tensor:
        """Samples :math:`x_t` given ``state["x"]`` (or from the prior at :math:`t = 0`) and observes :math:`y_t`."""
        t = self._t
        a, c = self.transition_diag, self.emission_diag
        if "x" in state:
            prior = dist.Normal(state["x"] * a, self.transition_scale).to_event(1)
        else:
            prior = dist.Normal(torch.zeros_like(a), self.init_scale).to_event(1)
        x = pyro.sample(f"x_{t}", prior)
        state["x"] = x
        self._t = t + 1
        return pyro.sample(f"y_{t}", dist.Normal(x * c, self.observation_scale).to_event(1), obs=y)

    @torch.no_grad()
    def as_linear_gaussian(self) -> LinearGaussianSSM:
        """The current parameter values as a fixed :class:`LinearGaussianSSM` (the Kalman oracle)."""
        a, c = self.transition_diag.detach(), self.emission_diag.detach()
        eye = torch.eye(len(a), dtype=a.dtype, device=a.device)
        return LinearGaussianSSM(
            torch.diag(a), self.transition_scale**2 * eye, torch.diag(c), self.observation_scale**2 * eye, torch.zeros_like(a), self.init_scale**2 * eye
        )

    @torch.no_grad()
    def simulate(self, num_steps: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws ``(xs, ys)`` of shapes ``(T, d)`` from the model at the current parameter values."""
        return self.as_linear_gaussian().simulate(num_steps, generator=generator)
