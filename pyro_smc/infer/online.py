r"""Online variational filtering and parameter learning, at constant cost per observation.

The variational smoothing distribution is backward-factorised (:class:`~pyro_smc.guides.StreamingFilterGuide`),
``q_t(x_{1:t}) = q_t(x_t) prod_k q_{k+1}(x_k | x_{k+1})``, and at time ``t`` only the current
marginal and kernel ``phi_t`` are fitted (Campbell, Shi, Rainforth and
Doucet, 2021). One :meth:`OnlineVariationalFilter.step` reads as its equations::

    delta(x_{t-1}, x_t) = log q_{t-1}(x_{t-1}) + log f(x_t | x_{t-1}) + log g(y_t | x_t)
                          - log q_t(x_{t-1} | x_t) - log q_t(x_t)
    phi_t   = argmax E_{q_t(x_t) q_t(x_{t-1} | x_t)} [ U_{t-1}(x_{t-1}) + delta ]      (reparameterised)
    U_t     = regress  x_t  ->  U_{t-1}(x_{t-1}) + delta           (U_t approximates V_t - log q_t)
    L_t     = E[ U_{t-1}(x_{t-1}) + delta ]                          (the running ELBO)

``U_t = V_t - log q_t`` is regressed rather than the value function ``V_t`` itself because it is
nearly constant (exactly ``log p(y_{1:t})`` when every ``q`` is exact), which is easy to fit.
At ``t = 0`` the increment is ``log mu(x_0) + log g(y_0 | x_0) - log q_0(x_0)``.

With ``learn_parameters=True`` the model's parameters ``theta`` (every ``pyro.param`` /
``PyroParam`` that ``model.step`` reads) follow the variational analogue of recursive maximum
likelihood: per-sample scores ``s_t = grad_theta [log f + log g]`` feed a second regression
``S_t(x_t) ~ S_{t-1}(x_{t-1}) + s_t``, ``G_t = E_{q_t}[S_t]`` estimates ``grad_theta L_t``, and
``theta <- theta + eta_t (G_t - G_{t-1})`` with the Robbins-Monro step ``eta_t = lr * 10 / (10 + t^0.6)``.

Constant cost: the guide has one fixed set of parameters (no new ``pyro.param`` per step), the
optimiser's state is reset each step, the regressors see a fixed number of samples, and what is
carried forward (the previous marginal, the last ``window`` backward kernels, the regressors, a
state batch) is detached. No observation is stored.

The model is any object with ``init(state, *args)`` and ``step(state, y, *args)`` as :class:`~pyro_smc.SMC`
runs it, sampling exactly one latent site of shape ``(d,)`` per step and storing it in ``state``.
``step`` is re-run many times per observation; the model's plain attributes (such as a time
counter) are restored before each re-run, so a model that counts steps in ``self._t`` works.

Example:
    >>> import torch
    >>> from pyro_smc import OnlineVariationalFilter
    >>> from pyro_smc.guides import StreamingFilterGuide
    >>> from pyro_smc.models import LinearGaussianSSM
    >>> eye = torch.eye(2)
    >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
    >>> _, ys = ssm.simulate(5)
    >>> vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=20)
    >>> for y in ys:
    ...     vf = vf.step(y)
    >>> vf.filtering_distribution().mean.shape
    torch.Size([2])
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import deque
from typing import Any, Callable

import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.nn import PyroModule
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from tqdm.auto import tqdm

from pyro_smc.guides.streaming import GaussianKernel, StreamingFilterGuide, _gaussian
from pyro_smc.infer.checkpoint import plain_attributes, restore_attributes, rng_state, set_rng_state
from pyro_smc.ops.jacobian import per_sample_gradients
from pyro_smc.ops.laplace import jittered, laplace_newton, regression_kernel
from pyro_smc.regression import QuadraticRegressor, Regressor, make_regressor

__all__ = ["INITIALIZE", "OnlineVariationalFilter", "robbins_monro"]

INITIALIZE = ("laplace", "predict", "previous")
_NEWTON_STEPS = 5


def robbins_monro(lr: float) -> Callable[[int], float]:
    """The step-size schedule ``eta_t = lr * 10 / (10 + t^0.6)`` ."""
    return lambda t: lr * 10.0 / (10.0 + t**0.6)


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class OnlineVariationalFilter:
    """Streaming variational filter, smoother and parameter learner (constant cost per step).

    Args:
        model: an ``init``/``step`` model as :class:`~pyro_smc.SMC` runs it (a ``PyroModule``
            with ``PyroParam``s, or any object whose ``step`` calls ``pyro.param``).
        guide: a :class:`~pyro_smc.guides.StreamingFilterGuide` in online mode (``num_steps=None``).
        num_samples: Monte Carlo samples per optimisation iteration.
        num_iterations: Adam iterations on ``phi_t`` per observation (0: use the guide as it is).
        lr: Adam learning rate for ``phi_t`` (decayed tenfold over each step's iterations).
        initial_lr: the rate at the first step, which starts from the prior (default ``10 * lr``).
        regressor: ``"quadratic"`` (exact for linear-Gaussian models), ``"kernel"``, ``"mlp"``
            or a :class:`~pyro_smc.regression.Regressor` (copied for the value and the score).
        num_regression_samples: samples per regression fit (and in the carried state batch).
        window: number of past backward kernels kept for lagged smoothing samples.
        initialize: how each step's optimisation starts. ``"laplace"``: ``q_t`` at the Laplace
            approximation of the model's one-step prediction from ``q_{t-1}`` times ``g(y_t | x_t)``
            (clipped-curvature Newton steps with backtracking; the Kalman update for a
            linear-Gaussian observation), and the kernel at the linear
            regression of ``x_{t-1}`` on ``x_t`` under the prediction (both exact for
            linear-Gaussian models up to Monte Carlo error); ``"predict"``: the same without the
            Newton step; ``"previous"``: the guide's current parameters.
        learn_parameters: update the model's parameters online.
        parameter_lr: ``eta_0`` of the Robbins-Monro schedule, or a callable ``t -> eta_t``.
        state_key: the ``state`` entry holding the latent (found automatically when ``None``).
        progress_bar: show a tqdm progress bar in :meth:`run`.
    """

    def __init__(
        self,
        model: Any,
        guide: StreamingFilterGuide,
        *,
        num_samples: int = 32,
        num_iterations: int = 100,
        lr: float = 0.01,
        initial_lr: float | None = None,
        regressor: str | Regressor = "quadratic",
        num_regression_samples: int = 256,
        window: int = 10,
        initialize: str = "laplace",
        learn_parameters: bool = False,
        parameter_lr: float | Callable[[int], float] = 0.01,
        state_key: str | None = None,
        progress_bar: bool = False,
    ):
        if not (hasattr(model, "init") and hasattr(model, "step")):
            raise ValueError("model must have init(state, ...) and step(state, y, ...) methods")
        if not isinstance(guide, StreamingFilterGuide):
            raise ValueError(f"guide must be a StreamingFilterGuide, got {type(guide).__name__}")
        if guide.num_steps is not None:
            raise ValueError("guide must be in online mode (StreamingFilterGuide(state_dim) without num_steps)")
        if initialize not in INITIALIZE:
            raise ValueError(f"initialize must be one of {INITIALIZE}, got {initialize!r}")
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not callable(parameter_lr) and not (isinstance(parameter_lr, (int, float)) and parameter_lr > 0):
            raise ValueError(f"parameter_lr must be > 0 or a callable t -> step size, got {parameter_lr!r}")
        self.model = model
        self.guide = guide
        self.num_samples = _positive_int("num_samples", num_samples)
        self.num_iterations = _positive_int("num_iterations", num_iterations, minimum=0)
        self.num_regression_samples = _positive_int("num_regression_samples", num_regression_samples, minimum=2)
        self.window = _positive_int("window", window)
        self.initialize = initialize
        self.learn_parameters = bool(learn_parameters)
        self.parameter_schedule = parameter_lr if callable(parameter_lr) else robbins_monro(float(parameter_lr))
        try:
            self._value_regressor = make_regressor(regressor) if isinstance(regressor, str) else copy.deepcopy(make_regressor(regressor))
        except ValueError as error:
            raise ValueError(f"regressor: {error}") from None
        self._score_regressor = copy.deepcopy(self._value_regressor)
        if isinstance(self._value_regressor, QuadraticRegressor):
            features = 1 + guide.state_dim + guide.state_dim * (guide.state_dim + 1) // 2
            if self.num_regression_samples < 2 * features:
                # Measured: at d = 10 (66 features) 64 samples give NaN and 128 a runaway theta.
                warnings.warn(
                    f"num_regression_samples={self.num_regression_samples} is below twice the {features} quadratic features of a "
                    f"{guide.state_dim}-d state; the regressions (and online parameter learning) can diverge",
                    stacklevel=2,
                )
        self._state_key = state_key
        self.progress_bar = bool(progress_bar)
        self.lr = float(lr)
        self.initial_lr = 10.0 * self.lr if initial_lr is None else float(initial_lr)
        if not self.initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, got {initial_lr!r}")
        self._optim = torch.optim.Adam(list(guide.parameters()), lr=lr)
        self.init()

    # --- public interface --------------------------------------------------------------------
    def init(self, *args, **kwargs) -> OnlineVariationalFilter:
        """Starts a new stream: runs ``model.init(state, *args)`` and forgets everything carried."""
        self.t = 0
        self.elbo = torch.zeros(())
        self.elbo_increment = torch.zeros(())
        self._state: dict[str, Tensor] = {}
        self._previous = None  # the frozen q_{t-1}(x_{t-1})
        self._kernels: deque = deque(maxlen=self.window)
        self._value: Regressor | None = None
        self._score: Regressor | None = None
        self._grad_previous: Tensor | None = None
        self._theta: dict[str, Tensor] | None = None
        self._obs_shape: torch.Size | None = None
        self.last_increments: Tensor | None = None
        with self._model_context():
            self.model.init(self._state, *args, **kwargs)
        return self

    def step(self, y: Tensor, *args, **kwargs) -> OnlineVariationalFilter:
        """Assimilates one observation ``y_t``: fits ``phi_t``, refits the regressors and, with
        ``learn_parameters``, updates the model's parameters. An all-NaN ``y`` is a missing
        measurement (a predict-only step). Returns ``self``."""
        missing = self._check_observation(y)
        snapshot = dict(vars(self.model))
        site, x_prev, x_prior, prior_fn = self._discover(snapshot, y, args, kwargs)
        if self.initialize != "previous":
            laplace = (snapshot, site, y, x_prev, args, kwargs) if self.initialize == "laplace" and not missing else None
            self._predictive_init(x_prev, x_prior, prior_fn, laplace)
        self._optimise(snapshot, site, y, missing, args, kwargs)
        self._regress(snapshot, site, y, missing, args, kwargs)
        marginal, kernel = self.guide.freeze()
        if self.t > 0:
            self._kernels.append(kernel)
        self._previous = marginal
        self.t += 1
        return self

    def run(self, observations: Tensor, *args, **kwargs) -> OnlineVariationalFilter:
        """Steps through the leading dimension of ``observations`` (``init`` is the caller's)."""
        for y in tqdm(observations, desc="OnlineVariationalFilter", disable=not self.progress_bar, leave=False):
            self.step(y, *args, **kwargs)
        return self

    def filtering_distribution(self):
        """The (frozen) filtering marginal ``q_t(x_t)`` after the last step, event shape ``(d,)``."""
        if self._previous is None:
            raise RuntimeError("no observation has been assimilated yet; call step(y) first")
        return self._previous

    def smoothing_samples(self, num_samples: int, lag: int | None = None) -> Tensor:
        """Samples of ``(x_{t-lag}, ..., x_t)`` from the variational smoother, ``(num_samples, lag + 1, d)``:
        ``x_t`` from the filtering marginal, then backward through the stored kernels."""
        available = len(self._kernels)
        lag = available if lag is None else lag
        if not 0 <= lag <= available:
            raise ValueError(f"lag must be in [0, {available}] (the stored window), got {lag}")
        with torch.no_grad():
            x = self.filtering_distribution().sample((_positive_int("num_samples", num_samples),))
            path = [x]
            for kernel in list(self._kernels)[len(self._kernels) - lag :][::-1]:
                x = kernel.distribution(x).sample()
                path.append(x)
        return torch.stack(path[::-1], dim=1)

    def parameters(self) -> dict[str, Tensor]:
        """The model's current parameters (constrained values, detached)."""
        if self._theta is None:
            return {}
        return {name: pyro.param(name).detach().clone() for name in self._theta}

    # --- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream exactly: the step count and running ELBO, the
        guide's parameters, the frozen previous marginal and kernel window, the regressors, the
        carried state batch, the model's parameters (unconstrained) and plain attributes
        (scalars such as a step counter, and cached tensors), and the torch RNG state. Adam's moments are not included: they
        are reset at every step. Save it with ``torch.save``."""

        def frozen(marginal):
            if marginal is None:
                return None
            scale = marginal.scale_tril if hasattr(marginal, "scale_tril") else marginal.base_dist.scale
            return {"loc": marginal.mean.clone(), "scale": scale.clone()}

        return {
            "t": self.t,
            "elbo": self.elbo.clone(),
            "elbo_increment": self.elbo_increment.clone(),
            "guide": {k: v.detach().clone() for k, v in self.guide.state_dict().items()},
            "previous": frozen(self._previous),
            "kernels": [vars(k).copy() for k in self._kernels],
            "value": None if self._value is None else self._value.state_dict(),
            "score": None if self._score is None else self._score.state_dict(),
            "grad_previous": self._grad_previous,
            "theta": None if self._theta is None else {name: leaf.detach().clone() for name, leaf in self._theta.items()},
            "state": dict(self._state),
            "state_key": self._state_key,
            "obs_shape": self._obs_shape,
            "model_attributes": plain_attributes(self.model),
            **rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any], restore_rng: bool = True) -> None:
        """Restores :meth:`state_dict` into a filter built with the same model class, guide
        configuration and settings; with ``restore_rng`` the stream continues bit-identically."""
        self.t = int(state["t"])
        self.elbo, self.elbo_increment = state["elbo"].clone(), state["elbo_increment"].clone()
        self.guide.load_state_dict(state["guide"])
        prev = state["previous"]
        self._previous = None if prev is None else _gaussian(prev["loc"].clone(), prev["scale"].clone())
        self._kernels = deque((GaussianKernel(**k) for k in state["kernels"]), maxlen=self.window)
        self._value = self._restore(self._value_regressor, state["value"])
        self._score = self._restore(self._score_regressor, state["score"])
        self._grad_previous = state["grad_previous"]
        self._theta = None
        if state["theta"] is not None:
            self._register_model_params()
            self._theta = {}
            for name, value in state["theta"].items():
                if name not in pyro.get_param_store():
                    raise ValueError(
                        f"load_state_dict: parameter {name!r} is not in Pyro's param store; for a model that is not a "
                        "PyroModule, restore the param store (pyro.get_param_store().set_state) first"
                    )
                leaf = pyro.param(name).unconstrained()
                with torch.no_grad():
                    leaf.copy_(value)
                self._theta[name] = leaf
        self._state = dict(state["state"])
        self._state_key = state["state_key"]
        self._obs_shape = state["obs_shape"]
        restore_attributes(self.model, state["model_attributes"])
        if restore_rng:
            set_rng_state(state)

    def _register_model_params(self) -> None:
        """Reads every ``PyroParam`` / ``nn.Parameter`` of a ``PyroModule`` model inside its context,
        which puts it in the param store under the name the model's sites use."""
        if not isinstance(self.model, PyroModule):
            return
        with self._model_context():
            for module in self.model.modules():
                if isinstance(module, PyroModule):
                    for name in list(module._pyro_params) + [n for n, _ in module.named_parameters(recurse=False)]:
                        getattr(module, name.removesuffix("_unconstrained"))

    @staticmethod
    def _restore(regressor: Regressor, state: dict | None) -> Regressor | None:
        if state is None:
            return None
        regressor.load_state_dict(state)
        return regressor

    # --- internals ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _model_context(self):
        # Block the model's sites from any enclosing handler; enter a PyroModule's context so its
        # PyroParams resolve through the param store (as SMC does).
        with poutine.block(), contextlib.ExitStack() as stack:
            if isinstance(self.model, PyroModule):
                stack.enter_context(self.model._pyro_context)
            yield

    def _check_observation(self, y: Tensor) -> bool:
        where = f"step {self.t}"
        if not isinstance(y, Tensor):
            raise ValueError(f"observation at {where} must be a Tensor, got {type(y).__name__}")
        if self._obs_shape is None:
            self._obs_shape = y.shape
        elif y.shape != self._obs_shape:
            raise ValueError(f"observation at {where} has shape {tuple(y.shape)}, expected {tuple(self._obs_shape)}")
        if not y.is_floating_point():
            return False
        nan = torch.isnan(y)
        if bool(torch.isinf(y).any()):
            raise ValueError(f"observation at {where} contains inf")
        if bool(nan.any()) and not bool(nan.all()):
            raise ValueError(f"observation at {where} is partly NaN; only a wholly missing (all-NaN) observation is supported")
        return bool(nan.all()) and y.numel() > 0

    def _run_model(self, snapshot: dict, x_prev: Tensor | None, condition: dict, y, args, kwargs):
        vars(self.model).update(snapshot)
        state = dict(self._state)
        if x_prev is not None:
            state[self._state_key] = x_prev
        with self._model_context():
            model = poutine.condition(self.model.step, data=condition) if condition else self.model.step
            trace = poutine.trace(model).get_trace(state, y, *args, **kwargs)
        return trace, state

    def _discover(self, snapshot: dict, y, args, kwargs):
        """One plain run of ``model.step`` from ``q_{t-1}`` samples: finds the latent site, the state
        entry holding it and the model's parameters, and returns prior draws of ``x_t``."""
        n = self.num_regression_samples
        x_prev = None if self._previous is None else self._previous.sample((n,))
        trace, state = self._run_model(snapshot, x_prev, {}, y, args, kwargs)
        latent = [
            name for name, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"] and not site_is_subsample(s)
        ]
        if len(latent) != 1:
            raise ValueError(f"model.step at step {self.t} must sample exactly one latent site, got {latent}")
        site = trace.nodes[latent[0]]
        value, d = site["value"], self.guide.state_dim
        if value.shape[-1:] != (d,) or value.dim() > 2:
            raise ValueError(f"latent site '{latent[0]}' at step {self.t} has shape {tuple(value.shape)}; the guide's state_dim is {d}")
        if self._state_key is None:
            keys = [k for k, v in state.items() if v is value]
            if len(keys) != 1:
                raise ValueError(f"could not find the state entry holding '{latent[0]}'; pass state_key= to OnlineVariationalFilter")
            self._state_key = keys[0]
        names = [name for name, s in trace.nodes.items() if s["type"] == "param"]
        if self._theta is None or not set(names) <= set(self._theta):
            # A parameter first read at this step (e.g. the transition's, unused at t = 0):
            # extend theta and restart the score recursion, whose vectors change length.
            theta = dict(self._theta or {})
            theta.update({name: pyro.param(name).unconstrained() for name in names if name not in theta})
            self._theta = theta
            self._score, self._grad_previous = None, None
        return latent[0], x_prev, value.reshape(-1, d), site["fn"]

    @torch.no_grad()
    def _predictive_init(self, x_prev: Tensor | None, x_prior: Tensor, prior_fn, laplace: tuple | None) -> None:
        """``q_t`` at the one-step prediction (law of total covariance over the ``q_{t-1}`` draws),
        then, with ``laplace``, up to five Newton steps on ``log g(y_t | x_t)``; the kernel at the linear
        regression of ``x_{t-1}`` on ``x_t`` under the prediction (which does not depend on ``y_t``)."""
        d = self.guide.state_dim
        try:
            mean = prior_fn.mean.expand(x_prior.shape[:-1] + (d,)).reshape(-1, d)
            var = prior_fn.covariance_matrix if hasattr(prior_fn, "covariance_matrix") else torch.diag_embed(prior_fn.variance)
            within = var.expand(mean.shape[:-1] + (d, d)).mean(0)
        except (NotImplementedError, AttributeError):
            mean, within = x_prior, torch.zeros(d, d, dtype=x_prior.dtype, device=x_prior.device)
        m = mean.mean(0)
        centred = mean - m
        cov = within + centred.T @ centred / max(len(mean), 1)
        cov = jittered(cov)
        if laplace is not None:
            m, cov = self._newton_update(m, cov, *laplace)
        self.guide.set_marginal(m, cov)
        if x_prev is not None:
            self.guide.set_kernel(*regression_kernel(x_prior, x_prev))

    def _newton_update(self, m: Tensor, cov: Tensor, snapshot, site, y, x_prev, args, kwargs) -> tuple[Tensor, Tensor]:
        """The Laplace approximation of ``N(x; m, cov) g(y_t | x)`` (:func:`pyro_smc.ops.laplace.laplace_newton`)."""
        prev = None if x_prev is None else x_prev[:1]

        def log_g(x):
            trace, _ = self._run_model(snapshot, prev, {site: x.unsqueeze(0)}, y, args, kwargs)
            return self._log_density(trace, site, False, 1, x, observed_only=True).sum()

        return laplace_newton(log_g, m, cov, _NEWTON_STEPS)

    def _log_density(self, trace, site: str, missing: bool, n: int, like: Tensor, observed_only: bool = False) -> Tensor:
        """``log f + log g`` per sample from a conditioned trace (``log g`` alone with ``observed_only``)."""
        total = like.new_zeros(n)
        for name, s in trace.nodes.items():
            if s["type"] != "sample" or site_is_subsample(s):
                continue
            if name != site and s["is_observed"] and missing:
                continue  # a missing measurement: predict-only
            if observed_only and (name == site or not s["is_observed"]):
                continue
            log_p = scale_and_mask(s["fn"].log_prob(s["value"], *s["args"], **s["kwargs"]), s["scale"], s["mask"])
            log_p = torch.as_tensor(log_p, dtype=like.dtype, device=like.device)
            if log_p.dim() and log_p.shape[0] == n:
                log_p = log_p.reshape(n, -1).sum(-1)
            else:
                log_p = log_p.sum().expand(n)
            total = total + log_p
        return total

    def _increment(self, snapshot, site, y, missing, x_prev, x_t, args, kwargs, marginal, kernel_dist) -> tuple[Tensor, dict]:
        """``delta`` per sample (and the state after the step)."""
        trace, state = self._run_model(snapshot, x_prev, {site: x_t}, y, args, kwargs)
        log_joint = self._log_density(trace, site, missing, x_t.shape[0], x_t)
        delta = log_joint - marginal.log_prob(x_t)
        if x_prev is not None:
            delta = delta + self._previous.log_prob(x_prev) - kernel_dist.log_prob(x_prev)
        return delta, state

    def _draw(self, n: int, reparameterise: bool):
        marginal = self.guide.filtering_distribution()
        x_t = marginal.rsample((n,)) if reparameterise else marginal.sample((n,))
        if self._previous is None:
            return marginal, x_t, None, None
        kernel_dist = self.guide.backward_distribution(x_t)
        x_prev = kernel_dist.rsample() if reparameterise else kernel_dist.sample()
        return marginal, x_t, kernel_dist, x_prev

    def _optimise(self, snapshot, site, y, missing, args, kwargs) -> None:
        params = [p for p in self.guide.parameters() if p.requires_grad]
        self._optim.state.clear()  # per-step Adam moments: nothing from earlier steps is carried
        # The first step starts from the prior, far from the posterior; later ones start at the
        # prediction. The rate decays tenfold within a step to damp the Monte Carlo noise.
        lr = self.initial_lr if self.t == 0 else self.lr
        n = self.num_iterations
        for i in range(n):
            for group in self._optim.param_groups:
                group["lr"] = lr * 0.1 ** (i / n)
            marginal, x_t, kernel_dist, x_prev = self._draw(self.num_samples, reparameterise=True)
            delta, _ = self._increment(snapshot, site, y, missing, x_prev, x_t, args, kwargs, marginal, kernel_dist)
            objective = delta if x_prev is None else delta + self._value(x_prev).reshape(-1)
            grads = torch.autograd.grad(-objective.mean(), params, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = None if g is None else g
            self._optim.step()

    def _regress(self, snapshot, site, y, missing, args, kwargs) -> None:
        with torch.no_grad():
            marginal, x_t, kernel_dist, x_prev = self._draw(self.num_regression_samples, reparameterise=False)
        learn = self.learn_parameters and bool(self._theta)
        with torch.set_grad_enabled(learn):
            delta, state = self._increment(snapshot, site, y, missing, x_prev, x_t, args, kwargs, marginal, kernel_dist)
        past = 0.0 if x_prev is None else self._value(x_prev).reshape(-1)
        increments = delta.detach()
        targets = past + increments
        self.last_increments = increments
        elbo = targets.mean()
        self.elbo_increment = elbo - self.elbo
        self.elbo = elbo
        self._value = self._value_regressor.fit(x_t, targets)
        if learn:
            self._learn(delta, x_t, x_prev)
        state = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in state.items()}
        self._state = state

    def _learn(self, delta: Tensor, x_t: Tensor, x_prev: Tensor | None) -> None:
        """Per-sample scores by one batched backward pass, the score regression, then
        ``theta <- theta + eta_t (G_t - G_{t-1})``."""
        leaves = [self._theta[name] for name in self._theta]
        # Only log f + log g depend on theta, so the per-sample gradient of delta is the score s_t.
        scores = per_sample_gradients(delta, leaves)
        if x_prev is not None and self._score is not None:
            scores = scores + self._score(x_prev)
        self._score = self._score_regressor.fit(x_t, scores)
        grad = self._score(x_t).mean(0)
        step = grad if self._grad_previous is None else grad - self._grad_previous
        self._grad_previous = grad
        eta = self.parameter_schedule(self.t)
        with torch.no_grad():
            offset = 0
            for leaf in leaves:
                size = leaf.numel()
                leaf.add_(eta * step[offset : offset + size].reshape(leaf.shape))
                offset += size
