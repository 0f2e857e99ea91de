"""The inference half of ``HybridLM``: its cache, the cached backbone, and ``generate``.

    S = slots, N = documents / rows of one call, T = tokens, D = hidden

``model.allocate_inference_cache(max_batch_size, max_seqlen)`` allocates every block's slots
(:class:`mixers.inference.InferenceCache`); ``model(ids, packed_seq_params=p, cache=cache,
cache_slots=slots)`` is a packed prefill (``ids [1, T]``, one slot per document) and
``model(ids, cache=cache, cache_slots=slots)`` rows (``ids [N, t]``, one slot per row: decoding
or chunked prefill). The slots are checked and resolved once per call, before anything is
written; every block continues and updates its own states for them; the slots' lengths advance
once at the end. ``generate`` runs continuous batching on top (:mod:`mixers.inference.generate`).
"""

from __future__ import annotations

import torch

from ..inference import InferenceCache
from ..inference.generate import generate
from ..inference.slots import SlotBatch
from ..layers import cp_prefill


class CachedLM:
    """Mixed into :class:`mixers.HybridLM` (``self.blocks``, ``self.norm``, ``self.embed``)."""

    def allocate_inference_cache(self, max_batch_size: int, max_seqlen: int, dtype=None,
                                 device=None) -> InferenceCache:
        """Zeroed slots for ``max_batch_size`` sequences of up to ``max_seqlen`` tokens in every block
        (``dtype`` / ``device`` default to the model's)."""
        return InferenceCache.allocate(self, [block.mixer for block in self.blocks], max_batch_size, max_seqlen,
                                       dtype=dtype, device=device)

    def _check_cache(self, cache, hidden_states: torch.Tensor):
        if not isinstance(cache, InferenceCache):
            raise TypeError(f"cache must be the InferenceCache of this model's allocate_inference_cache, got "
                            f"{type(cache).__name__}")
        cache.check(self, hidden_states.dtype, hidden_states.device)
        return cache.table

    def _backbone_cached(self, hidden_states: torch.Tensor, varlen, cache, cache_slots) -> torch.Tensor:
        """The blocks with per-slot states (``varlen``: the packing of a ``[1, T]`` call, or ``None``)."""
        if varlen is not None and varlen.cp is not None:
            return self._backbone_cp_prefill(hidden_states, varlen, cache, cache_slots)
        self._check_cache(cache, hidden_states)
        rows, steps = hidden_states.shape[:2]
        if varlen is not None and rows != 1:
            raise ValueError(f"a packed call is one row [1, T], got {rows} rows; pass packed_seq_params=None "
                             "for rows (one slot per row)")
        owned = not isinstance(cache_slots, SlotBatch)
        batch = cache.resolve(cache_slots, rows, steps, varlen, hidden_states.device) if owned else cache_slots
        for block, layer in zip(self.blocks, cache.layers):
            hidden_states = block(hidden_states, varlen, cache=layer, cache_slots=batch)
        if owned:
            cache.advance(batch)
        return self.norm(hidden_states)

    def _backbone_cp_prefill(self, hidden_states: torch.Tensor, varlen, cache, cache_slots) -> torch.Tensor:
        """A context-parallel prefill (:mod:`mixers.layers.cp_prefill`): this rank's shard through the
        blocks, every block's states and keys / values stored on the ranks that passed a cache."""
        prefill = cp_prefill.agree(varlen, cache, cache_slots, name=type(self).__name__,
                                   check_cache=lambda c: self._check_cache(c, hidden_states),
                                   rows=hidden_states.shape[0], device=hidden_states.device)
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, layer in zip(self.blocks, layers):
            sink = cp_prefill.ShardedLayerCache(prefill, layer)
            hidden_states = block(hidden_states, varlen, cache=sink, cache_slots=prefill.batch)
        if cache is not None:
            cache.advance(prefill.batch)
        return self.norm(hidden_states)

    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, **options) -> list[list[int]]:
        """Continuations of ``prompts`` (token-id sequences) by continuous batching; see
        :func:`mixers.inference.generate.generate` for ``options`` (``max_batch_size``,
        ``prefill_chunk``, ``eos_token_id``, ``generator``, ``cache``, ``prefilled``). ``temperature`` must be finite
        and >= 0 (0 = greedy)."""
        return generate(self, prompts, max_new_tokens, temperature, **options)
