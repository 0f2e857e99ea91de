"""The model: ``HybridLM`` and what trains and serves it.

* :mod:`.hybrid`: :class:`HybridLM`, any stack of the registered mixers (one letter per block),
  its loss on packed rows, and the token and target checks;
* :mod:`.cached`: its inference half (the slot cache, the cached backbone, ``generate``);
* :mod:`.carry`: :class:`CarriedStates`, training on packs whose long documents continue in the
  next pack;
* :mod:`.cp_loss`: the next-token loss of a row split over context-parallel ranks;
* :mod:`.sizes`: which hidden sizes a pattern of mixers can be built with, and the fix when not.
"""

from .carry import CarriedStates
from .hybrid import HybridLM

__all__ = ["CarriedStates", "HybridLM"]
