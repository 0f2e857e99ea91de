"""``LightningMixer``: MiniMax's lightning attention (``MiniMaxLightningAttention``), packed.

    B = rows, T = tokens, D = hidden, H = heads, K = head dim (keys and values alike), E = H * K

The spec, one document at a time (nothing else enters it):

1. ``q, k, v = silu(qkv_proj(h))``, ``[T, H, 3K]`` split per head into ``[q | k | v]``
   (MiniMax's layout: each head's three slices side by side);
2. per head, ``S_t = exp(-slope_h) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` (no scale), from the
   document's initial state (zero for a fresh document);
3. ``out = out_proj(rmsnorm(o) * weight * sigmoid(output_gate(h)))``, the RMS norm over all ``E``
   channels of a token at once (not per head), eps 1e-6.

The slopes are MiniMax's, ALiBi's geometric rates scaled down with depth::

    slope_h = (2 ** (-8 / H)) ** (h + 1) * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)

computed in fp32 as upstream computes them, and kept as a buffer ``slope [H]`` (MiniMax's ``slope_rate``
``[H, 1, 1]``): saved with the weights, never trained.

Only step 2 mixes tokens; it is :func:`mixers.ops.chunk_simple_gla` with ``g_gamma = -slope``,
``scale = 1`` and the forward's packing metadata, so the state restarts at every document (per-document
initial and final states, context parallelism by state passing: the op's). Steps 1 and 3 act on each
token alone.

Inference: the cache holds ``recurrent [S, H, K, K]`` (``k^T v`` summed with decay, MiniMax's own
cache layout, in the compute dtype: fp32 for fp16 / bf16); decoding runs the op's one-token step,
a packed prefill continues each slot from its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import chunk_simple_gla, fused_recurrent_simple_gla
from ..ops.common.chunks import compute_dtype
from .base import MixerBase, default_heads, positive
from .blocks.norm import GatedRMSNorm
from .blocks.norm_linear import norm_linear
from .cached import CachedMixin


def minimax_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """``[H]`` fp32: MiniMax's per-head decay rates for layer ``layer_idx`` of ``num_layers``."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (torch.arange(num_heads, dtype=torch.int64) + 1)).to(torch.float32) * factor


@dataclass(frozen=True)
class LightningConfig:
    """MiniMax's lightning attention: ``num_heads`` heads of ``head_dim`` (default: as many as fit in
    ``hidden_size``), the slopes of layer ``layer_idx`` of ``num_layers`` (``HybridLM`` sets both from
    the block's place in its pattern), ``norm_eps`` of the output norm (MiniMax: 1e-6),
    ``chunk_size`` of the scan.
    """

    hidden_size: int
    head_dim: int = 64
    num_heads: int | None = None
    layer_idx: int = 0
    num_layers: int = 1
    norm_eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "num_layers", "chunk_size"):
            positive(name, getattr(self, name))
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", default_heads(self.hidden_size, self.head_dim, 1.0))
        positive("num_heads", self.num_heads)
        if isinstance(self.layer_idx, bool) or not isinstance(self.layer_idx, int) or \
                not 0 <= self.layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, num_layers={self.num_layers}), got {self.layer_idx!r}")
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or self.norm_eps < 0:
            raise ValueError(f"norm_eps must be a float >= 0, got {self.norm_eps!r}")

    @property
    def inner_size(self) -> int:
        """``E = num_heads * head_dim``."""
        return self.num_heads * self.head_dim


class LightningMixer(CachedMixin, MixerBase):
    """Lightning attention: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Build it from ``hidden_size`` alone (``LightningMixer(512)``), with overrides
    (``LightningMixer(512, head_dim=128, layer_idx=3, num_layers=8)``) or from a
    :class:`LightningConfig`. ``backend``: ``"auto"``, ``"kernel"`` (checked now; raises if missing)
    or ``"reference"``.
    """

    CONFIG = LightningConfig
    PLAN = (("linear attention scan", (("fla_simple_gla", ("varlen",)), ("mamba_ssd", ("seq_idx",)))),)
    INFERENCE_PLAN = ()

    def __init__(self, hidden_size: int | None = None, *, config: LightningConfig | None = None,
                 backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c = self.config
        self.qkv_proj = nn.Linear(c.hidden_size, 3 * c.inner_size, bias=False)
        self.output_gate = nn.Linear(c.hidden_size, c.inner_size, bias=False)
        self.norm = GatedRMSNorm(c.inner_size, c.norm_eps, "sigmoid", norm_before_gate=True)
        self.out_proj = nn.Linear(c.inner_size, c.hidden_size, bias=False)
        self.register_buffer("slope", minimax_slopes(c.num_heads, c.layer_idx, c.num_layers))

    def _qkv(self, hidden_states: torch.Tensor):
        """``(q, k, v)`` each ``[B, T, H, K]`` (step 1)."""
        c = self.config
        b, t, _ = hidden_states.shape
        qkv = F.silu(self.qkv_proj(hidden_states)).reshape(b, t, c.num_heads, 3 * c.head_dim)
        return qkv.split(c.head_dim, dim=-1)

    def _out(self, o: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Step 3 on ``o [B, T, H, K]``."""
        b, t = o.shape[:2]
        return norm_linear(self.norm, o.reshape(b, t, -1), self.output_gate(hidden_states), self.out_proj)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        varlen = self.varlen(hidden_states, packed_seq_params)
        q, k, v = self._qkv(hidden_states)
        o, _ = chunk_simple_gla(q, k, v, g_gamma=-self.slope, scale=1.0, cu_seqlens=varlen,
                                chunk_size=self.config.chunk_size, backend=self.backend)
        return self._out(o, hidden_states)

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        return {"recurrent": torch.zeros(slots, c.num_heads, c.head_dim, c.head_dim, dtype=compute_dtype(dtype),
                                         device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        q, k, v = self._qkv(hidden_states)
        initial = None if batch.all_fresh else cache.gather("recurrent", batch)
        kwargs = dict(g_gamma=-self.slope, scale=1.0, output_final_state=True, backend=self.backend)
        if batch.decode:
            o, state = fused_recurrent_simple_gla(q, k, v, initial_state=initial, **kwargs)
        elif batch.packed:
            o, state = chunk_simple_gla(q, k, v, initial_state=batch.spread(initial), cu_seqlens=batch.state_varlen,
                                        chunk_size=self.config.chunk_size, **kwargs)
            state = batch.pick(state)
        else:
            o, state = chunk_simple_gla(q, k, v, initial_state=initial, chunk_size=self.config.chunk_size, **kwargs)
        cache.write("recurrent", batch, state)
        return self._out(o, hidden_states)
