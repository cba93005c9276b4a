"""Online variational filtering and parameter learning (``OnlineVariationalFilter``).

One module per part: ``filter`` (the filter: it orchestrates the others and owns the carried
state), ``context`` (one step's frozen inputs and the model runs from them), ``start`` (where each
step's optimisation starts), ``objective`` (the per-step ELBO increment and its optimiser),
``assimilation`` (the step's estimate once fitted: the running ELBO, the value regression),
``learning`` (online parameter learning), ``checks`` (what is checked so that no wrong number is
reported silently), ``checkpoint`` (``state_dict``) and ``result`` (``OnlineFilterResult``).
"""

from pyro_smc.infer.online.checks import OnlineFilterWarning
from pyro_smc.infer.online.filter import EXTRAPOLATION_LIMIT, INITIALIZE, OnlineVariationalFilter
from pyro_smc.infer.online.learning import robbins_monro
from pyro_smc.infer.online.result import OnlineFilterResult

__all__ = [
    "EXTRAPOLATION_LIMIT",
    "INITIALIZE",
    "OnlineFilterResult",
    "OnlineFilterWarning",
    "OnlineVariationalFilter",
    "robbins_monro",
]
