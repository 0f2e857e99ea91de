"""``KDAMixer``: fla's ``KimiDeltaAttention`` (per-channel decay), packed.

    g = -exp(A_log[h]) * softplus(f_proj(x) + dt_bias)   [B, T, HV, K], f_proj low rank

Made of: everything but the gate lives in :mod:`.delta_base` (projections, short convs, scan call,
norm and out_proj, the cache); the low-rank per-channel gate is below, its initialisation in
:mod:`.blocks.init`; sizes in :class:`KDAConfig` below; the ops are :func:`mixers.ops.chunk_kda` and, decoding,
:func:`mixers.ops.fused_recurrent_kda`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops import chunk_kda, fused_recurrent_kda
from .blocks.decay_gate import decay_gate
from .blocks.init import inverse_softplus_dt
from .blocks.norm import GatedRMSNorm
from .delta_base import DeltaConfig, DeltaMixerBase


@dataclass(frozen=True)
class KDAConfig(DeltaConfig):
    """fla's ``KimiDeltaAttention``: per-channel decay, low-rank gate projections, sigmoid output gate.

    ``output_gate_bias``: the output gate's second projection has a bias in fla (True) and none in
    Hugging Face's Kimi-Linear (False).
    """

    expand_v: float = 1.0
    heads_share: float = field(default=1.0, repr=False)
    output_gate_bias: bool = True


class KDAMixer(DeltaMixerBase):
    """Kimi Delta Attention mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``KDAMixer(512)`` derives every size from ``hidden_size`` (see :class:`KDAConfig`).
    """

    CONFIG = KDAConfig
    CHUNK = staticmethod(chunk_kda)
    STEP = staticmethod(fused_recurrent_kda)

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(hidden_size, config=config, backend=backend, **overrides)
        c = self.config
        gate_dim = c.num_v_heads * c.head_dim
        self.f_proj = nn.Sequential(nn.Linear(c.hidden_size, c.head_v_dim, bias=False),
                                    nn.Linear(c.head_v_dim, gate_dim, bias=False))
        self.A_log = nn.Parameter(torch.log(torch.empty(c.num_v_heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(gate_dim))
        self.g_proj = nn.Sequential(nn.Linear(c.hidden_size, c.head_v_dim, bias=False),
                                    nn.Linear(c.head_v_dim, c.value_dim, bias=c.output_gate_bias))
        self.o_norm = GatedRMSNorm(c.head_v_dim, c.norm_eps, "sigmoid")

    def _gate_inputs(self):
        return self.f_proj, self.g_proj

    def _gate(self, f):
        """The per-channel log decay ``[B, T, HV, K]`` from ``f_proj``'s output ``[B, T, HV K]``."""
        c = self.config
        gate = decay_gate(f, self.dt_bias, self.A_log.repeat_interleave(c.head_dim))
        return gate.reshape(*f.shape[:2], c.num_v_heads, c.head_dim)
