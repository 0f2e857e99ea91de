"""Inference for ``AttentionMixer``: a per-slot KV cache, positions continuing from each slot.

    S = slots, L = max_seqlen, N = slots of one call, T = tokens, Hq / Hk = heads, Dh = head dim

The cache holds ``key`` and ``value`` ``[S, L, Hk, Dh]`` (keys after the rotary embedding, in the
activations' dtype); a slot's first ``lengths[slot]`` entries are its sequence. New tokens get
rotary positions that continue from their slot's length.

* rows ``[N, t]`` (decoding, chunks): :func:`mixers.ops.attention_with_kvcache` appends the new
  keys and values at each slot's length and attends over them (flash-attn's
  ``flash_attn_with_kvcache`` with ``cache_batch_idx``);
* a packed call whose slots are all fresh: :func:`mixers.ops.varlen_attention` over the call
  (flash-attn's varlen kernel), then the real tokens' keys and values are stored;
* a packed call continuing slots: the keys and values are stored first, then each document's
  queries (left-aligned into rows, so the causal mask lines up at the bottom right) attend over
  their slot through :func:`mixers.ops.attention_with_kvcache` without new keys.

Padding never enters a slot: only real tokens' keys and values are stored (a padding token's
output is zero on the last path).
"""

from __future__ import annotations

import torch

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import attention_with_kvcache, varlen_attention
from .cached import CachedMixin


class AttentionCached(CachedMixin):
    """The inference half of :class:`mixers.AttentionMixer`."""

    INFERENCE_PLAN = (("KV-cache attention", (("flash_attn", ("kvcache",)),)),)

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        shape = (slots, max_seqlen, c.num_kv_heads, c.head_dim)
        return {"key": torch.zeros(shape, dtype=dtype, device=device),
                "value": torch.zeros(shape, dtype=dtype, device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        c = self.config
        b, t, _ = hidden_states.shape
        q, k, v = self._qkv(hidden_states, batch.positions)
        window = c.window_size if c.window_size is not None else (-1, -1)
        if batch.packed:
            o = self._packed(q[0], k[0], v[0], varlen, cache, batch, window)
        else:
            o = attention_with_kvcache(q, cache["key"], cache["value"], k=k, v=v, cache_seqlens=batch.starts_device,
                                       cache_batch_idx=batch.slots, causal=True, window_size=window,
                                       backend=self.backend)
        return self.o_proj(o.reshape(b, t, c.num_heads * c.head_dim))

    def _packed(self, q, k, v, varlen, cache: LayerCache, batch: SlotBatch, window) -> torch.Tensor:
        """``q [T, Hq, Dh]``, ``k, v [T, Hk, Dh]`` of a packed call -> ``[T, Hq, Dh]``."""
        index, doc, place = batch.real_token_layout
        slots, positions = batch.slots[doc], batch.starts_device[doc] + place
        if batch.all_fresh:
            out = varlen_attention(q, k, v, varlen, None, causal=True, window_size=self.config.window_size,
                                   backend=self.backend)
        cache.write_tokens("key", slots, positions, k[index])
        cache.write_tokens("value", slots, positions, v[index])
        if batch.all_fresh:
            return out
        width = batch.longest
        column = width - batch.counts.to(batch.device)[doc] + place     # right-aligned: last query, last column
        rows = q.new_zeros(len(batch.host), width, *q.shape[1:])
        rows[doc, column] = q[index]
        attended = attention_with_kvcache(rows, cache["key"], cache["value"], cache_seqlens=batch.ends_device,
                                          cache_batch_idx=batch.slots, causal=True, window_size=window,
                                          backend=self.backend)
        out = torch.zeros_like(q)
        out[index] = attended[doc, column]
        return out
