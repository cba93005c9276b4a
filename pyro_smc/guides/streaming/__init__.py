"""The streaming variational filter's family: ``StreamingFamily`` (``family``: the filtering
marginal plus backward kernels that the online filter trains one step at a time),
``StreamingFilterGuide`` (``guide``: that family usable online or as a whole-trajectory Pyro guide)
and ``StepFrame`` (``frame``: the whitened coordinates in which the online filter's optimiser fits
a step).
"""

from pyro_smc.guides.streaming.family import GaussianKernel, StreamingFamily
from pyro_smc.guides.streaming.frame import StepFrame
from pyro_smc.guides.streaming.guide import StreamingFilterGuide

__all__ = ["GaussianKernel", "StepFrame", "StreamingFamily", "StreamingFilterGuide"]
