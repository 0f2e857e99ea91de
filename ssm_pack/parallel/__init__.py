"""Context parallelism: one packed row split over the ranks of a process group.

* :mod:`.layout`: :class:`ContextParallelLayout` (who holds which tokens of which document),
  :func:`shard_for_context_parallel` and the per-forward run a :class:`ssm_pack.VarlenBatch` carries;
* :mod:`.balance`: cost-balanced contiguous shard bounds (equal work per rank, not equal tokens);
* :mod:`.layout_check`: whether every rank runs the same layout (a small all-reduce per forward);
* :mod:`.groups`: which process groups a microbatch runs on (Megatron-core's dynamic CP).
"""

from .balance import balanced_bounds
from .groups import resolve_cp_group, resolve_tp_cp_group
from .layout import ContextParallelLayout, ContextParallelRun, shard_for_context_parallel
from .layout_check import set_layout_check

__all__ = ["ContextParallelLayout", "ContextParallelRun", "balanced_bounds", "resolve_cp_group", "resolve_tp_cp_group",
           "set_layout_check", "shard_for_context_parallel"]
