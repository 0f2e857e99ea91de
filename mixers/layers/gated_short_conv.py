"""``GatedShortConvMixer``: LFM2's gated short convolution (``Lfm2ShortConv``), packed.

    B = rows, T = tokens, D = hidden, W = conv width (LFM2's ``conv_L_cache``)

The spec, one document at a time (nothing else enters it):

1. ``B, C, x = in_proj(h).chunk(3)``, each ``[T, D]`` (in that order: the input gate first);
2. ``v = causal_depthwise_conv(B * x)``: ``v[t] = sum_j w[:, j] * (B * x)[t - (W-1) + j] (+ bias)``,
   the terms before the document's first token being zero; no activation;
3. ``out = out_proj(C * v)``.

Only step 2 mixes tokens, so the packed forward hands it the forward's packing metadata: the
convolution restarts at every document (:func:`mixers.ops.causal_conv1d_fn` with ``seq_idx`` /
``cu_seqlens``, per-document initial and final states, context parallelism by state passing);
steps 1 and 3 act on each token alone.

Made of: constructor preamble, kernel plan, packing metadata: :class:`.base.MixerBase`; the
convolution: :class:`.blocks.short_conv.ShortConvolution` (weight ``[D, 1, W]``, ``nn.Conv1d``'s
layout, as LFM2 stores it); cache and cached forward: :class:`.cached.CachedMixin` and
:func:`.blocks.short_conv_cache.conv_cached`.

Inference: the cache holds ``conv [S, D, W-1]`` (the last W-1 values of ``B * x`` per slot, in
the activations' dtype); decoding runs :func:`mixers.ops.causal_conv1d_update` in place by slot
index; a packed prefill continues each slot from its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from .base import SHORT_CONV, MixerBase, positive
from .blocks.short_conv import ShortConvolution
from .blocks.short_conv_cache import conv_cached
from .cached import CachedMixin


@dataclass(frozen=True)
class GatedShortConvConfig:
    """LFM2's gated short convolution: ``in_proj`` to ``3 * hidden_size``, a depthwise conv of
    width ``conv_size`` (LFM2's ``conv_L_cache``, 3 in the released models), ``out_proj``.

    ``proj_bias``: biases on ``in_proj`` and ``out_proj``; ``conv_bias``: a bias on the
    convolution (LFM2's one ``conv_bias`` sets all three; False in the released models).
    """

    hidden_size: int
    conv_size: int = 3
    proj_bias: bool = False
    conv_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "conv_size"):
            positive(name, getattr(self, name))
        for name in ("proj_bias", "conv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")


class GatedShortConvMixer(CachedMixin, MixerBase):
    """Gated short convolution: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Build it from ``hidden_size`` alone (``GatedShortConvMixer(512)``), with overrides
    (``GatedShortConvMixer(512, conv_size=4)``) or from a :class:`GatedShortConvConfig`.
    ``backend``: ``"auto"``, ``"kernel"`` (checked now; raises if missing) or ``"reference"``.
    """

    CONFIG = GatedShortConvConfig
    PLAN = (("short conv", SHORT_CONV),)
    INFERENCE_PLAN = (("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),)

    def __init__(self, hidden_size: int | None = None, *, config: GatedShortConvConfig | None = None,
                 backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c = self.config
        self.in_proj = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.proj_bias)
        self.conv = ShortConvolution(c.hidden_size, c.conv_size, bias=c.conv_bias, activation=None, backend=backend)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.proj_bias)

    def _gated_input(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B * x, C)`` of ``hidden_states [B, T, D]`` (steps 1 and the input gate of 2)."""
        B, C, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        return B * x, C

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        varlen = self.varlen(hidden_states, packed_seq_params)
        bx, C = self._gated_input(hidden_states)
        return self.out_proj(C * self.conv(bx, varlen))

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        return {"conv": torch.zeros(slots, c.hidden_size, c.conv_size - 1, dtype=dtype, device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        bx, C = self._gated_input(hidden_states)
        return self.out_proj(C * conv_cached(self.conv, bx, cache, "conv", batch))
