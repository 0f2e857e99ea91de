"""``AttentionMixer``: grouped-query attention with rotary embeddings, packed.

    B = rows, T = tokens, D = hidden, Hq / Hk = query / key-value heads, Dh = head dim

Rotary positions restart at 0 at every document (from the physical boundaries), and attention
never crosses a document (:func:`mixers.ops.varlen_attention`: PyTorch's varlen_attn, then
flash-attn, on CUDA).

Made of (where each piece lives):

* constructor preamble, kernel plan, packing metadata: :class:`.base.MixerBase`;
* sizes: :class:`AttentionConfig` below;
* q / k / v in one call: :func:`.blocks.projections.project`; rotary: :mod:`.blocks.rotary`;
* attention: :func:`mixers.ops.varlen_attention` (training),
  :func:`mixers.ops.attention_with_kvcache` (inference);
* cache allocation and the cached forward's preamble: :class:`.cached.CachedMixin`; this
  mixer's cache and cached forward: ``_cache_states``, ``_cached`` and ``_packed`` below.

Inference: a per-slot KV cache, positions continuing from each slot.

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
  their slot through :func:`mixers.ops.attention_with_kvcache` without new keys. When the call
  records gradients (training through :class:`mixers.model.CarriedStates`), the rows attend over
  their slots' keys and values with this call's own tokens taken from ``k`` / ``v`` rather than
  from the (detached) cache, so their gradient flows; the earlier pieces' stay constants.

Padding never enters a slot: only real tokens' keys and values are stored (a padding token's
output is zero on the last path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import attention_with_kvcache, varlen_attention
from .base import MixerBase, default_heads, divides, positive
from .blocks.norm import upcast
from .blocks.projections import project
from .blocks.rotary import apply_rotary, rotary_tables
from .cached import CachedMixin


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with rotary embeddings restarting at every document."""

    hidden_size: int
    head_dim: int = 64
    num_heads: int | None = None
    num_kv_heads: int | None = None
    rope_theta: float = 10000.0
    window_size: tuple[int, int] | None = None

    def __post_init__(self):
        positive("hidden_size", self.hidden_size)
        positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", default_heads(self.hidden_size, self.head_dim, 1.0))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", max(1, self.num_heads // 2) if self.num_heads % 2 == 0
                               else self.num_heads)
        positive("num_heads", self.num_heads)
        positive("num_kv_heads", self.num_kv_heads)
        divides("num_kv_heads", self.num_kv_heads, "num_heads", self.num_heads)


class AttentionMixer(CachedMixin, MixerBase):
    """GQA attention mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``."""

    CONFIG = AttentionConfig
    PLAN = (("varlen attention", (("torch_varlen", ()), ("flash_attn", ("varlen",)))),)
    INFERENCE_PLAN = (("KV-cache attention", (("flash_attn", ("kvcache",)),)),)

    def __init__(self, hidden_size: int | None = None, *, config: AttentionConfig | None = None,
                 backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c = self.config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        c = self.config
        varlen = self.varlen(hidden_states, packed_seq_params)
        b, t, _ = hidden_states.shape
        if varlen is None:                         # every row is one sequence
            positions = torch.arange(t, device=hidden_states.device).expand(b, t)
            varlen = torch.arange(b + 1, device=hidden_states.device, dtype=torch.int32) * t
        else:
            positions = varlen.position_ids
        q, k, v = self._qkv(hidden_states, positions)
        o = varlen_attention(q.reshape(b * t, c.num_heads, c.head_dim), k.reshape(b * t, c.num_kv_heads, c.head_dim),
                             v.reshape(b * t, c.num_kv_heads, c.head_dim), varlen, None, causal=True,
                             window_size=c.window_size, backend=self.backend)
        return self.o_proj(o.reshape(b, t, c.num_heads * c.head_dim))

    def _qkv(self, hidden_states: torch.Tensor, positions: torch.Tensor):
        """``(q [B, T, Hq, Dh], k, v [B, T, Hk, Dh])``, q and k rotated by ``positions [B, T]``: the
        three projections in one call with one input gradient
        (:func:`mixers.layers.blocks.projections.project`)."""
        c = self.config
        b, t, _ = hidden_states.shape
        q, k, v = project(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        # one table for q and k (computed in fp32 at least, as each would ask)
        cos, sin = rotary_tables(positions, c.rope_theta, c.head_dim // 2,
                                 torch.promote_types(upcast(q).dtype, upcast(k).dtype))
        q = apply_rotary(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(b, t, c.num_kv_heads, c.head_dim)

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
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            keys, values, source = self._own_tokens_differentiable(k, v, cache, batch, index, doc, positions)
        else:
            keys, values, source = cache["key"], cache["value"], batch.slots
        attended = attention_with_kvcache(rows, keys, values, cache_seqlens=batch.ends_device,
                                          cache_batch_idx=source, causal=True, window_size=window,
                                          backend=self.backend)
        out = torch.zeros_like(q)
        out[index] = attended[doc, column]
        return out

    @staticmethod
    def _own_tokens_differentiable(k, v, cache: LayerCache, batch: SlotBatch, index, doc, positions):
        """Training through carried states: each slot's keys and values ``[N, K, Hk, Dh]`` (``K`` its
        longest), the earlier pieces' from the cache (constants) and this call's own tokens' ``k`` /
        ``v`` in their places, so the gradient reaches them (the cache holds detached copies)."""
        longest = max(int((batch.starts + batch.counts).max()), 1)
        keys = cache["key"][:, :longest].index_select(0, batch.slots)
        values = cache["value"][:, :longest].index_select(0, batch.slots)
        keys = keys.index_put((doc, positions), k[index].to(keys.dtype))
        values = values.index_put((doc, positions), v[index].to(values.dtype))
        return keys, values, None
