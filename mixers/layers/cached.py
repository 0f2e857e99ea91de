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
from . import cp_prefill
from .base import plan_support


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

    def _check_cache(self, cache, hidden_states: torch.Tensor) -> SlotTable:
        if not isinstance(cache, LayerCache):
            raise TypeError(f"{type(self).__name__}: cache must be the LayerCache of this mixer's "
                            f"allocate_inference_cache, got {type(cache).__name__}")
        cache.check(self, hidden_states)
        return cache.table

    def _forward_cached(self, hidden_states: torch.Tensor, packed_seq_params, cache, cache_slots) -> torch.Tensor:
        name = type(self).__name__
        if isinstance(cache, cp_prefill.ShardedLayerCache):          # a model's CP prefill: resolved there
            varlen = self.varlen(hidden_states, packed_seq_params)
            cache.check(self, hidden_states)
            if cache_slots is not cache.prefill.batch or varlen is not cache.prefill.varlen:
                raise ValueError(f"{name}: cache_slots were resolved for another cache or another call")
            return self._cached(hidden_states, varlen, cache, cache_slots)
        if cp_prefill.is_context_parallel(packed_seq_params):
            return self._cp_prefill(hidden_states, packed_seq_params, cache, cache_slots)
        varlen = self.varlen(hidden_states, packed_seq_params)
        self._check_cache(cache, hidden_states)
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

    def _cp_prefill(self, hidden_states: torch.Tensor, packed_seq_params, cache, cache_slots) -> torch.Tensor:
        """A context-parallel prefill of this mixer alone (:mod:`.cp_prefill`): ``cache=None`` on the
        ranks that keep no states."""
        name = type(self).__name__
        cp_prefill.refuse_unsupported(packed_seq_params, name)
        if isinstance(cache_slots, SlotBatch):
            raise ValueError(f"{name}: a context-parallel prefill takes cache_slots as ints (one per document of "
                             "the whole row); resolved SlotBatches come from a model's own call")
        varlen = self.varlen(hidden_states, packed_seq_params)
        prefill = cp_prefill.agree(varlen, cache, cache_slots, name=name,
                                   check_cache=lambda c: self._check_cache(c, hidden_states),
                                   rows=hidden_states.shape[0], device=hidden_states.device)
        if hidden_states.shape[1] == 0:
            out = torch.zeros_like(hidden_states)
        else:
            out = self._cached(hidden_states, varlen, cp_prefill.ShardedLayerCache(prefill, cache), prefill.batch)
        if cache is not None:
            cache.table.advance(prefill.batch)
        return out
