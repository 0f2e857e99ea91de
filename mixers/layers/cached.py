"""What every mixer's inference path shares: allocating its cache and the cached forward's preamble.

    B = rows, T = tokens, D = hidden, S = slots, N = documents / rows of one call

``allocate_inference_cache(max_batch_size, max_seqlen)`` returns the mixer's
:class:`~mixers.inference.LayerCache` (its states from ``_cache_states``);
``forward(hidden_states, packed_seq_params, cache=, cache_slots=)`` comes here (the layers'
forwards branch off first thing), which checks the cache and resolves the slots **before**
anything is computed or written, runs the mixer's ``_cached`` step and advances the slots:

* a packed call, ``hidden_states [1, T, D]`` with ``packed_seq_params`` and one slot per
  document: a packed prefill (or chunk) continuing each slot;
* rows ``[N, t, D]`` without ``packed_seq_params``, one slot per row: decoding (``t == 1``,
  the decode-step kernels) or a chunk of ``t`` tokens per row.

A fresh slot (none of its tokens since its last reset) starts from zero; afterwards each named
slot holds the state after its last real token; padding never enters a slot; slots not named are
not touched.
"""

from __future__ import annotations

import torch

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch, SlotTable
from .base import plan_support


def refuse_context_parallel(packed_seq_params, name: str) -> None:
    """Refuse an inference cache with context-parallel metadata (``cp_group`` set, or a rank's shard
    from :func:`ssm_pack.shard_for_context_parallel`): each rank would keep a partial state of a
    document it shares. Reads attributes only, so it runs before anything is built or written."""
    if packed_seq_params is None:
        return
    layout = getattr(packed_seq_params, "cp_layout", None)
    group = getattr(packed_seq_params, "cp_group", None)
    run = getattr(packed_seq_params, "cp", None)                  # a resolved VarlenBatch
    if layout is None and group is None and run is None:
        return
    seen = (f"cp_layout splits the row over {layout.size} ranks" if layout is not None
            else "a CP run" if run is not None else "cp_group is set")
    raise ValueError(f"{name}: no decoding cache under CP: packed_seq_params describe a context-parallel shard "
                     f"({seen}) but cache= was given; run the prefill with the whole row's params on one "
                     "process (no cp_group, no shard), or drop cache= for a context-parallel forward")


class CachedMixin:
    """Inference for a mixer: subclasses define ``_cache_states``, ``_cached`` and ``INFERENCE_PLAN``
    (the kernels of its decode and prefill parts, rows of the requirements table like ``PLAN``:
    what the report shows and what ``backend="kernel"`` checks when a cache is allocated)."""

    INFERENCE_PLAN: tuple = ()

    def _cache_states(self, slots: int, max_seqlen: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        raise NotImplementedError

    def allocate_inference_cache(self, max_batch_size: int, max_seqlen: int, dtype=None, device=None, *,
                                 table: SlotTable | None = None) -> LayerCache:
        """Zeroed per-slot states for ``max_batch_size`` sequences of up to ``max_seqlen`` tokens.

        ``dtype`` / ``device`` default to the mixer's parameters'; ``table`` shares one slot table
        among the mixers of a model (what ``HybridLM.allocate_inference_cache`` does)."""
        reference = next(self.parameters())
        dtype = reference.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        device = reference.device if device is None else torch.device(device)
        if self.backend == "kernel":
            for part, kernel, ok, reason in plan_support(self.INFERENCE_PLAN):
                if not ok:
                    raise RuntimeError(f"{type(self).__name__}(backend='kernel'): its {part} cannot run on {kernel}: "
                                       f"{reason}")
        shared = table is not None
        if table is None:
            table = SlotTable(max_batch_size, max_seqlen)
        elif (table.capacity, table.max_seqlen) != (max_batch_size, max_seqlen):
            raise ValueError(f"table holds {table.capacity} slots x {table.max_seqlen} tokens, not "
                             f"{max_batch_size} x {max_seqlen}")
        states = self._cache_states(table.capacity, table.max_seqlen, dtype, device)
        return LayerCache(self, table, states, dtype, shared=shared)

    def _forward_cached(self, hidden_states: torch.Tensor, packed_seq_params, cache, cache_slots) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(cache, LayerCache):
            raise TypeError(f"{name}: cache must be the LayerCache of this mixer's allocate_inference_cache, got "
                            f"{type(cache).__name__}")
        refuse_context_parallel(packed_seq_params, name)
        varlen = self.varlen(hidden_states, packed_seq_params)
        cache.check(self, hidden_states)
        rows, steps = hidden_states.shape[:2]
        owned = not isinstance(cache_slots, SlotBatch)
        if owned:
            batch = cache.table.resolve(cache_slots, rows, steps, varlen, hidden_states.device)
        else:
            batch = cache_slots
            if batch.table is not cache.table or batch.varlen is not varlen or batch.steps != steps:
                raise ValueError(f"{name}: cache_slots were resolved for another cache or another call")
        if steps == 0:                              # no token: nothing to read or write
            return torch.zeros_like(hidden_states)
        out = self._cached(hidden_states, varlen, cache, batch)
        if owned:
            cache.table.advance(batch)
        return out
