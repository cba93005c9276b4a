r"""Online variational filtering and parameter learning, at constant cost per observation.

See ``docs/math/streaming.md#value-function-and-elbo`` and
``docs/math/streaming.md#per-step-elbo-increment``.

The variational smoothing distribution is backward-factorised (:class:`~pyro_smc.guides.StreamingFilterGuide`),
:math:`q_t(x_{1:t}) = q_t(x_t) \prod_k q_{k+1}(x_k \mid x_{k+1})`, and at time ``t`` only the current
marginal and kernel :math:`\phi_t` are fitted (Campbell, Shi, Rainforth and
Doucet, 2021). One :meth:`OnlineVariationalFilter.step` reads as its equations::

    delta(x_{t-1}, x_t) = log q_{t-1}(x_{t-1}) + log f(x_t | x_{t-1}) + log g(y_t | x_t)
                          - log q_t(x_{t-1} | x_t) - log q_t(x_t)
    phi_t   = argmax E_{q_t(x_t) q_t(x_{t-1} | x_t)} [ U_{t-1}(x_{t-1}) + delta ]      (reparameterised)
    U_t     = regress  x_t  ->  U_{t-1}(x_{t-1}) + delta           (U_t approximates V_t - log q_t)
    L_t     = E[ U_{t-1}(x_{t-1}) + delta ]                          (log_evidence, the running ELBO)

:math:`U_t = V_t - \log q_t` is regressed rather than the value function :math:`V_t` itself because it is
nearly constant (exactly :math:`\log p(y_{1:t})` when every ``q`` is exact), which is easy to fit.
At :math:`t = 0` the increment is :math:`\log \mu(x_0) + \log g(y_0 \mid x_0) - \log q_0(x_0)`.

The parts, one module each: the step's fixed inputs and model runs
(:mod:`~pyro_smc.infer.online.context`), where the optimisation starts
(:mod:`~pyro_smc.infer.online.start`), the objective and its optimiser
(:mod:`~pyro_smc.infer.online.objective`), the step's estimate once fitted
(:mod:`~pyro_smc.infer.online.assimilation`), the regressors (:mod:`~pyro_smc.regression`),
online parameter learning (:mod:`~pyro_smc.infer.online.learning`), what is checked so that no
wrong number is reported silently (:mod:`~pyro_smc.infer.online.checks`), checkpoints
(``pyro_smc.infer.online.checkpoint``) and the result
(:mod:`~pyro_smc.infer.online.result`). The filter here orchestrates them and owns the carried
state.

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
    >>> vf = vf.step(None)  # a missing observation: predict only
    >>> vf.filtering_distribution().mean.shape, vf.t
    (torch.Size([2]), 6)
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, Callable

import pyro
import pyro.poutine as poutine
import torch
from torch import Tensor

from pyro_smc.checks import int_at_least, positive_float, positive_int
from pyro_smc.guides.streaming.family import StreamingFamily, marginal_covariance
from pyro_smc.infer.online import checkpoint
from pyro_smc.infer.online.assimilation import assimilate, mark_unreliable
from pyro_smc.infer.online.checks import EXTRAPOLATION_LIMIT, INITIALIZE, OnlineFilterWarning, check_marginal, check_settings, warn_if_few_regression_samples, warn_unconverged
from pyro_smc.infer.online.context import StepContext, observation_missing
from pyro_smc.infer.online.learning import ParameterLearner, model_parameter_names, robbins_monro, step_sizes
from pyro_smc.infer.online.objective import StepOptimiser
from pyro_smc.infer.online.result import OnlineFilterResult
from pyro_smc.infer.online.start import initialise
from pyro_smc.infer.online.stopping import STOP_SIGMAS_DEFAULT
from pyro_smc.observations import check_observations
from pyro_smc.progress import progress, progress_enabled
from pyro_smc.regression import Regressor, make_regressor
from pyro_smc.tracing import module_context

__all__ = ["EXTRAPOLATION_LIMIT", "INITIALIZE", "STOP_SIGMAS_DEFAULT", "TOL_DEFAULT", "OnlineFilterWarning", "OnlineVariationalFilter", "robbins_monro"]

TOL_DEFAULT = None
"""The default ``tol`` of :class:`OnlineVariationalFilter`'s objective stopping rule: off. The
gradient rule (``stop_sigmas``, on by default) stops a step instead: ``tol=1e-3`` stopped a d = 10
step early enough to cost accuracy (its joint KL to Kalman 0.256 against 0.25 at all 100
iterations), and a step at its optimum still ran 20 iterations under it."""


class OnlineVariationalFilter:
    r"""Streaming variational filter, smoother and parameter learner (constant cost per step).

    Args:
        model: an ``init``/``step`` model as :class:`~pyro_smc.SMC` runs it (a ``PyroModule``
            with ``PyroParam``s, or any object whose ``step`` calls ``pyro.param``).
        guide: a :class:`~pyro_smc.guides.StreamingFilterGuide` in its online role
            (``StreamingFilterGuide(d)``, no ``num_steps``), or a
            :class:`~pyro_smc.guides.StreamingFamily` with one kernel.
        num_samples: Monte Carlo samples per optimisation iteration.
        num_iterations: Adam iterations on :math:`\phi_t` per observation (0: use the guide as it is),
            at most: see ``stop_sigmas`` and ``tol``. The iterations each step ran are in
            ``result.iterations``.
        stop_sigmas: the gradient stopping rule (default 3; ``None``: off): before the first
            iteration, and every 10 after, the whitened gradient of the step's objective is
            estimated on ``num_regression_samples`` fresh draws (in 16 groups, whose spread gives
            its Monte Carlo noise), and the step stops once the estimate of its squared norm is at
            most ``stop_sigmas`` standard deviations above zero: nothing more can be resolved
            from the draws the step's estimate is made from (which are those draws; see
            ``pyro_smc.infer.online.stopping``). A step whose start is optimal (the start of a
            linear-Gaussian step is exact) runs no iteration, but for about 1-3% of steps.
        tol: the objective stopping rule (default ``None``: off; see ``TOL_DEFAULT``): a step's
            optimisation stops once the mean objective of its last 10 iterations exceeds that of
            the 10 before by less than ``tol`` times its absolute value
            (``pyro_smc.infer.online.objective.converged``), so at least 20 iterations run. With
            both rules on, a step stops at the first that says so.
        lr: Adam learning rate for :math:`\phi_t` in the whitened units of the step's start (decayed
            tenfold over each step's iterations): an iteration moves the marginal's and the
            kernel's means by about ``lr`` of their standard deviations in any direction and
            their scales by a factor of about :math:`e^{\mathrm{lr}}` (``StepFrame`` in
            ``pyro_smc.guides.streaming.frame``), whatever the units and the orientation of the
            state.
        initial_lr: the rate at the first step (default ``10 * lr``).
        regressor: ``"quadratic"`` (exact for linear-Gaussian models), ``"kernel"``, ``"mlp"``
            or a :class:`~pyro_smc.regression.Regressor` (copied for the value and the score).
        num_regression_samples: samples per regression fit (and in the carried state batch).
        window: number of past backward kernels kept for lagged smoothing samples.
        initialize: how each step's optimisation starts (``pyro_smc.infer.online.start``).
            ``"laplace"``: :math:`q_t` at the Laplace approximation of the model's one-step prediction
            from :math:`q_{t-1}` times :math:`g(y_t \mid x_t)`, and the kernel at the linear regression of
            :math:`x_{t-1}` on :math:`x_t` under the prediction, with the transition mean's linear part
            as a control variate (both exact, to rounding, for linear-Gaussian models);
            ``"predict"``: the same without the Newton steps;
            ``"previous"``: the guide's current parameters.
        learn_parameters: update the model's parameters online.
        parameter_lr: :math:`\eta_0` of the Robbins-Monro schedule, or a callable :math:`t \mapsto \eta_t`.
        state_key: the ``state`` entry holding the latent (found automatically when ``None``). The
            state is that latent alone: another entry that varies over the draws (a stored
            ``A x``, a lag) cannot be redrawn with ``x_{t-1}`` and is an error.
        progress_bar: a tqdm bar in :meth:`run`: ``None`` (default) in interactive use only,
            ``True`` always, ``False`` never (:mod:`pyro_smc.progress`).

    Attributes:
        t: the number of observations assimilated since :meth:`init`.
        log_evidence: the running ELBO :math:`L_t`, a Monte Carlo estimate of a lower bound on
            :math:`\log p(y_{1:t})` (scalar tensor). ``elbo`` is the same number.
        log_evidence_standard_error: its Monte Carlo standard error, :math:`\sqrt{\sum_t s_t^2 / N}`
            with :math:`s_t` the sd of step ``t``'s ``N`` regression targets: each step's mean adds
            its own error, and the regression :math:`U_{t-1}` carries the earlier ones (exactly so
            while each kernel's draws lie where :math:`U_{t-1}` was fitted, which the filter checks).
        log_evidence_increment: :math:`L_t - L_{t-1}`.
        last_increments: the last step's per-sample increments :math:`\delta` ``(N,)``.
        unreliable_steps: the steps whose kernel extrapolated the value regression, or whose
            optimisation (with ``initialize`` other than ``"laplace"``) ran all its iterations
            without meeting its stopping rule (see :class:`~pyro_smc.infer.OnlineFilterWarning`,
            emitted at the first); ``log_evidence`` is unreliable from the first of them on.

    Raises:
        ValueError: (from :meth:`step` and :meth:`run`) an invalid observation (naming the step:
            of another shape than the site observing it, partly NaN, or with an ``inf``), and a
            step whose filtering mean or covariance, or ELBO increment, is not finite (naming
            the step); the filter's state is then that of the step before (but for the guide's
            parameters, and with ``learn_parameters`` the model's, when those became non-finite).

    Example:
        >>> import torch
        >>> from pyro_smc import OnlineVariationalFilter
        >>> from pyro_smc.guides import StreamingFilterGuide
        >>> from pyro_smc.models import LinearGaussianSSM
        >>> eye = torch.eye(2)
        >>> ssm = LinearGaussianSSM(0.9 * eye, 0.1 * eye, eye, 0.1 * eye, torch.zeros(2), eye)
        >>> _, ys = ssm.simulate(4)
        >>> vf = OnlineVariationalFilter(ssm, StreamingFilterGuide(2), num_iterations=5).run(ys)
        >>> vf.t, bool(vf.log_evidence == vf.elbo)
        (4, True)
    """

    def __init__(
        self,
        model: Any,
        guide: StreamingFamily,
        *,
        num_samples: int = 32,
        num_iterations: int = 100,
        tol: float | None = TOL_DEFAULT,
        stop_sigmas: float | None = STOP_SIGMAS_DEFAULT,
        lr: float = 0.03,
        initial_lr: float | None = None,
        regressor: str | Regressor = "quadratic",
        num_regression_samples: int = 256,
        window: int = 10,
        initialize: str = "laplace",
        learn_parameters: bool = False,
        parameter_lr: float | Callable[[int], float] = 0.01,
        state_key: str | None = None,
        progress_bar: bool | None = None,
    ):
        check_settings(model, guide, state_key, initialize)
        lr = positive_float("lr", lr)
        self.model = model
        self.guide = guide
        self.num_samples = positive_int("num_samples", num_samples)
        self.num_iterations = int_at_least("num_iterations", num_iterations, 0)
        if tol is not None and not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and math.isfinite(tol) and tol > 0):
            raise ValueError(f"tol must be a finite number > 0, or None (always run num_iterations), got {tol!r}")
        self.tol = None if tol is None else float(tol)
        if stop_sigmas is not None and not (isinstance(stop_sigmas, (int, float)) and not isinstance(stop_sigmas, bool) and math.isfinite(stop_sigmas) and stop_sigmas >= 0):
            raise ValueError(f"stop_sigmas must be a finite number >= 0, or None (no gradient check), got {stop_sigmas!r}")
        self.stop_sigmas = None if stop_sigmas is None else float(stop_sigmas)
        self.num_regression_samples = int_at_least("num_regression_samples", num_regression_samples, 2)
        self.window = positive_int("window", window)
        self.initialize = initialize
        if not isinstance(learn_parameters, bool):
            # bool("no") is True: a string or a number here is a mistake, not a switch.
            raise ValueError(f"learn_parameters must be True or False, got {learn_parameters!r}")
        self.learn_parameters = learn_parameters
        self.parameter_schedule = step_sizes(parameter_lr)
        try:
            self._value_regressor = make_regressor(regressor) if isinstance(regressor, str) else copy.deepcopy(make_regressor(regressor))
        except ValueError as error:
            raise ValueError(f"regressor: {error}") from None
        self._learner = ParameterLearner(copy.deepcopy(self._value_regressor), self.parameter_schedule)
        warn_if_few_regression_samples(self._value_regressor, guide.state_dim, self.num_regression_samples)
        self._state_key = state_key
        self.progress_bar = progress_bar
        progress_enabled(progress_bar)  # its TypeError, at construction
        self.lr = lr
        self.initial_lr = 10.0 * self.lr if initial_lr is None else positive_float("initial_lr", initial_lr)
        self._optimiser = StepOptimiser(
            guide, lr=self.lr, initial_lr=self.initial_lr, num_iterations=self.num_iterations, num_samples=self.num_samples, tol=self.tol,
            stop_sigmas=self.stop_sigmas, check_samples=self.num_regression_samples,
        )
        self.init()

    # --- public interface --------------------------------------------------------------------
    def init(self, *args, **kwargs) -> OnlineVariationalFilter:
        """Starts a new stream: runs ``model.init(state, *args)`` and forgets everything carried
        (the model's parameter values are kept). Returns ``self``."""
        self.t = 0
        self.log_evidence = torch.zeros(())
        self.log_evidence_increment = torch.zeros(())
        self.log_evidence_standard_error = torch.zeros(())
        self.unreliable_steps: list[int] = []
        self._state: dict[str, Tensor] = {}
        self._previous = None  # the frozen q_{t-1}(x_{t-1})
        self._kernels: deque = deque(maxlen=self.window)
        self._value: Regressor | None = None
        self._learner.reset()
        self._obs_shape: torch.Size | None = None
        self.last_increments: Tensor | None = None
        # Per-step summaries for `result`: O(T d^2) memory, a few hundred bytes a step for small d.
        self._history: dict[str, list[Tensor]] = {"log_evidence_increments": [], "filtering_means": [], "filtering_covariances": [], "iterations": []}
        with poutine.block(), module_context(self.model):
            trace = poutine.trace(self.model.init).get_trace(self._state, *args, **kwargs)
        # Every parameter the model has (a PyroModule's) or has read (init's, then each step's).
        names = model_parameter_names(self.model) + [name for name, site in trace.nodes.items() if site["type"] == "param"]
        self._param_names = dict.fromkeys(names)
        return self

    def step(self, y: Tensor | None, *args, **kwargs) -> OnlineVariationalFilter:
        r"""Assimilates one observation :math:`y_t`: fits :math:`\phi_t`, refits the regressors and, with
        ``learn_parameters``, updates the model's parameters.

        Args:
            y: the observation. ``None`` or all-NaN is a missing measurement (a predict-only
                step: no observed site is scored); partly NaN or with an ``inf`` is an error.
            *args: ``model.step``'s further positional arguments.
            **kwargs: ``model.step``'s further keyword arguments.

        Returns:
            ``self``.
        """
        where = f"step {self.t}"
        missing = observation_missing(y, self.t, self._obs_shape)
        context = StepContext(self.model, dict(vars(self.model)), self._state, self._previous, y, missing, self.t, args, kwargs, state_key=self._state_key)
        context, prior = context.discover(self.num_regression_samples, self.guide.state_dim)
        if prior.x_prior.dtype != self.guide.loc.dtype:
            # Else the first product of a draw of the guide with a model tensor fails deep inside
            # model.step ("expected m1 and m2 to have the same dtype"), naming neither.
            raise ValueError(
                f"at {where}: the model computes its latent site '{context.site}' in {prior.x_prior.dtype} but the guide's "
                f"parameters are {self.guide.loc.dtype}: create the guide under the model's dtype "
                f"(torch.set_default_dtype) or convert it with guide.to({prior.x_prior.dtype})"
            )
        if isinstance(y, Tensor) and self._obs_shape is None:
            self._obs_shape = y.shape
        self._state_key = context.state_key
        self._param_names.update(dict.fromkeys(prior.param_names))
        self._learner.track(prior.param_names)
        if self.initialize != "previous":
            # A missing observation's step may still observe something (a second sensor, a
            # pyro.factor): its Laplace start then takes that in (from the bare prediction the
            # optimiser left variances 8-9 times the exact ones, unflagged).
            laplace = self.initialize == "laplace" and (not missing or context.observes(prior))
            initialise(self.guide, context, prior, laplace=laplace)
            check_marginal(self.guide, where)
        self._optimiser.fit(context, self._value)
        if self._optimiser.exhausted and self.initialize != "laplace":
            # A Laplace start is a sound approximation by itself; the others can be far off.
            mark_unreliable(self, lambda: warn_unconverged(self.t, self._optimiser.num_iterations, self.initialize))
        if self._optimiser.iterations or self.initialize == "previous":  # else the start, checked above
            check_marginal(self.guide, where)
        assimilate(self, context)
        self._optimiser.checked = None  # its draws and their graph are the step's only
        marginal, kernel = self.guide.freeze()
        if self.t > 0:
            self._kernels.append(kernel)
        self._previous = marginal
        self._history["log_evidence_increments"].append(self.log_evidence_increment.detach().clone())
        self._history["filtering_means"].append(marginal.mean.detach().clone())
        self._history["filtering_covariances"].append(marginal_covariance(marginal).detach().clone())
        self._history.setdefault("iterations", []).append(torch.tensor(self._optimiser.iterations))
        self.t += 1
        return self

    def run(self, observations: Tensor, *args, **kwargs) -> OnlineVariationalFilter:
        """``init(*args)`` then ``step(observations[t], *args)`` for every leading-dim slice, as
        :meth:`pyro_smc.SMC.run` does. To continue a stream (e.g. after :meth:`load_state_dict`),
        call :meth:`step` in a loop instead.

        Args:
            observations: tensor ``(T, ...)``; an all-NaN slice is a missing measurement.

        Returns:
            ``self``.

        Raises:
            ValueError: ``observations`` is not a tensor with a leading time dimension (of shape
                ``(T, model.obs_dim)`` when the model declares ``obs_dim``, or ``(T,)`` when that is
                1), or a slice is partly NaN or has an ``inf`` (checked before anything runs); and
                as for :meth:`step`.
        """
        if not isinstance(observations, Tensor):
            raise ValueError(f"observations must be a tensor of shape (T, ...), got {type(observations).__name__}")
        if observations.dim() == 0:
            raise ValueError("observations must have a leading time dimension, got a scalar")
        obs_dim = getattr(self.model, "obs_dim", None)
        if isinstance(obs_dim, int) and not isinstance(obs_dim, bool) and observations.is_floating_point():
            # A model that declares its observation size is held to the rule every engine applies.
            observations, _ = check_observations(observations, obs_dim)
        for t, y in enumerate(observations):
            observation_missing(y, t, None)
        self.init(*args, **kwargs)
        for y in progress(observations, desc="OnlineVariationalFilter", enabled=progress_enabled(self.progress_bar)):
            self.step(y, *args, **kwargs)
        return self

    @property
    def result(self) -> OnlineFilterResult:
        """A snapshot of the stream so far as an :class:`~pyro_smc.infer.online.result.OnlineFilterResult`:
        the running ELBO ``log_evidence`` and its standard error, its per-step increments ``(T,)``,
        the filtering marginals' means ``(T, d)`` and covariances ``(T, d, d)`` (detached), and the
        optimisation iterations each step ran ``(T,)`` (``None`` after a checkpoint that lacks them)."""
        if not self._history["filtering_means"]:
            raise RuntimeError("no observation has been assimilated yet; call run(observations) or step(y) first")
        stacked = {name: torch.stack(values) for name, values in self._history.items()}
        if "iterations" in stacked and len(stacked["iterations"]) != len(stacked["filtering_means"]):
            del stacked["iterations"]  # a stream restored from a checkpoint made before they were recorded
        return OnlineFilterResult(log_evidence=self.log_evidence, log_evidence_standard_error=self.log_evidence_standard_error, **stacked)

    @property
    def log_evidence_gradient(self) -> dict[str, Tensor]:
        r"""With ``learn_parameters``, the online estimate of :math:`\nabla_\theta \log p(y_{1:t})`:
        Fisher's identity, the mean under :math:`q_t` of the regressed score :math:`S_t`, per parameter
        name, with respect to its unconstrained value (detached). Empty before the first update.
        A parameter first read at a later step joins with a zero score and gradient up to that
        step, and the recursion of the others goes on.

        While the parameters are being learnt, each step's score is taken at that step's
        parameter values, so the sum mixes the path's values: it is the recursion that drives
        the learning, not the gradient at the current values (a new user's 1500 learnt steps read
        180 where the exact gradient at the learnt value was 26.8). With the parameters held
        fixed (``parameter_lr`` 0) it estimates the gradient at them."""
        return self._learner.gradient()

    @property
    def elbo(self) -> Tensor:
        """The running ELBO, the same number as ``log_evidence``."""
        return self.log_evidence

    def filtering_distribution(self):
        """The (frozen) filtering marginal :math:`q_t(x_t)` after the last step, event shape ``(d,)``."""
        if self._previous is None:
            raise RuntimeError("no observation has been assimilated yet; call step(y) first")
        return self._previous

    def smoothing_samples(self, num_samples: int, lag: int | None = None) -> Tensor:
        r"""Samples of :math:`(x_{t-\mathrm{lag}}, \dots, x_t)` from the variational smoother, ``(num_samples, lag + 1, d)``:
        :math:`x_t` from the filtering marginal, then backward through the stored kernels.

        Args:
            num_samples: an int >= 1.
            lag: an int in ``[0, K]`` with ``K`` the number of kernels stored (at most ``window``);
                ``None`` is ``K``.

        Raises:
            ValueError: ``num_samples`` or ``lag`` out of range; RuntimeError before the first step.
        """
        available = len(self._kernels)
        lag = available if lag is None else lag
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= available:
            raise ValueError(f"lag must be an int in [0, {available}] (the stored window), got {lag!r}")
        with torch.no_grad():
            x = self.filtering_distribution().sample((positive_int("num_samples", num_samples),))
            path = [x]
            for kernel in list(self._kernels)[len(self._kernels) - lag :][::-1]:
                x = kernel.distribution(x).sample()
                path.append(x)
        return torch.stack(path[::-1], dim=1)

    def parameters(self) -> dict[str, Tensor]:
        """The model's current parameters, ``{Pyro name: constrained value}`` (detached copies).

        Every parameter of a ``PyroModule`` model from the start, and every ``pyro.param`` that
        ``model.init`` or a ``model.step`` so far has read; with ``learn_parameters`` those that
        ``model.step`` reads are the ones learned. Empty for a model without parameters.
        """
        store = pyro.get_param_store()
        return {name: pyro.param(name).detach().clone() for name in self._param_names if name in store}

    # --- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream exactly (``pyro_smc.infer.online.checkpoint``):
        the step count, the running ``log_evidence`` with its increment and standard error, the
        guide's parameters, the frozen previous marginal and kernel window, the regressors, the
        carried state batch, the model's parameters (unconstrained) and plain attributes, and the
        torch RNG state. Save it with ``torch.save``."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any], restore_rng: bool = True) -> None:
        """Restores :meth:`state_dict` into a filter built with the same model class, guide
        configuration and settings; with ``restore_rng`` the stream continues bit-identically
        (continue it with :meth:`step`: :meth:`run` starts a new stream)."""
        checkpoint.load_state_dict(self, state, restore_rng)
