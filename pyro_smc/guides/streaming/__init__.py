"""The streaming variational filter's family: ``StreamingFamily`` (``family``: the filtering
marginal plus backward kernels that the online filter trains one step at a time) and
``StreamingFilterGuide`` (``guide``: that family usable online or as a whole-trajectory Pyro guide).
"""

from pyro_smc.guides.streaming.family import GaussianKernel, StepFrame, StreamingFamily
from pyro_smc.guides.streaming.guide import StreamingFilterGuide

__all__ = ["GaussianKernel", "StepFrame", "StreamingFamily", "StreamingFilterGuide"]
