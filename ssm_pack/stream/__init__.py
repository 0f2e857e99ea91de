"""Documents into packs.

* :mod:`.packs`: :func:`pack_stream`, streaming, resumable, rank- and worker-aware packs
  (reading documents: :mod:`.source`; which pieces form a pack: :mod:`.buffer`; one pack laid
  out: :mod:`.assemble`);
* :mod:`.planner`: :func:`plan_packs`, the budgeted first-fit-decreasing plan of a known list.
"""

from .packs import PackStream, pack_stream
from .planner import PackPlan, plan_packs

__all__ = ["PackPlan", "PackStream", "pack_stream", "plan_packs"]
