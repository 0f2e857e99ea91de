"""``AttentionMixer``: grouped-query attention with rotary embeddings, packed.

    B = rows, T = tokens, D = hidden, Hq / Hk = query / key-value heads, Dh = head dim

Rotary positions restart at 0 at every document (from the physical boundaries), and attention
never crosses a document (:func:`mixers.ops.varlen_attention`, flash-attn on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import varlen_attention
from .attention_cache import AttentionCached
from .base import MixerBase
from .config import AttentionConfig
from .norm import upcast


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [..., T, H, Dh]`` by ``positions [..., T]`` (half-split rotary; fp32 angles at least)."""
    half = x.shape[-1] // 2
    wide = upcast(x)
    freq = theta ** (-torch.arange(half, device=x.device, dtype=wide.dtype) / half)
    angle = positions.to(wide.dtype).unsqueeze(-1) * freq                        # [..., T, half]
    cos, sin = angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)
    x1, x2 = wide[..., :half], wide[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class AttentionMixer(AttentionCached, MixerBase):
    """GQA attention mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``."""

    PLAN = (("varlen attention", (("flash_attn", ("varlen",)),)),)

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
        q = rotary(self.q_proj(hidden_states).reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rotary(self.k_proj(hidden_states).reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(hidden_states).reshape(b, t, c.num_kv_heads, c.head_dim)
        o = varlen_attention(q.reshape(b * t, c.num_heads, c.head_dim), k.reshape(b * t, c.num_kv_heads, c.head_dim),
                             v.reshape(b * t, c.num_kv_heads, c.head_dim), varlen, None, causal=True,
                             window_size=c.window_size, backend=self.backend)
        return self.o_proj(o.reshape(b, t, c.num_heads * c.head_dim))

