"""``AttentionMixer``: grouped-query attention with rotary embeddings, packed.

    B = rows, T = tokens, D = hidden, Hq / Hk = query / key-value heads, Dh = head dim

Rotary positions restart at 0 at every document (from the physical boundaries), and attention
never crosses a document (:func:`mixers.ops.varlen_attention`: PyTorch's varlen_attn, then flash-attn, on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import varlen_attention
from .attention_cache import AttentionCached
from .base import MixerBase
from .config import AttentionConfig
from .norm import upcast
from .projections import project
from .rotary import apply_rotary, rotary_tables


class AttentionMixer(AttentionCached, MixerBase):
    """GQA attention mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``."""

    PLAN = (("varlen attention", (("torch_varlen", ()), ("flash_attn", ("varlen",)))),)

    def __init__(self, hidden_size: int | None = None, *, config: AttentionConfig | None = None,
                 backend: str = "auto", **overrides):
        super().__init__(AttentionConfig, hidden_size, config, backend, overrides)
        c = self.config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: attention_cache.py
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
        (:func:`mixers.layers.projections.project`)."""
        c = self.config
        b, t, _ = hidden_states.shape
        q, k, v = project(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        # one table for q and k (computed in fp32 at least, as each would ask)
        cos, sin = rotary_tables(positions, c.rope_theta, c.head_dim // 2,
                                 torch.promote_types(upcast(q).dtype, upcast(k).dtype))
        q = apply_rotary(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(b, t, c.num_kv_heads, c.head_dim)
