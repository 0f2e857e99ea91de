"""``GatedDeltaProductMixer``: fla's ``GatedDeltaProduct`` (``num_householder`` delta steps per
token, one scalar decay per token), packed.

    k, v, beta: ``[B, T * nh, ...]`` (each token's sub-steps interleaved, fla's layout)
    g = -exp(A_log) * softplus(a_proj(x) + dt_bias)      [B, T, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import chunk_gated_delta_product
from .config import GatedDeltaProductConfig
from .delta_base import DeltaMixerBase, inverse_softplus_dt
from .norm import GatedRMSNorm, upcast


class GatedDeltaProductMixer(DeltaMixerBase):
    """Gated DeltaProduct mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    ``GatedDeltaProductMixer(512)`` derives every size from ``hidden_size`` (see
    :class:`GatedDeltaProductConfig`; two householder steps and negative eigenvalues by default).
    """

    CONFIG = GatedDeltaProductConfig

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(hidden_size, config=config, backend=backend, **overrides)
        c = self.config
        self.a_proj = nn.Linear(c.hidden_size, c.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(c.num_v_heads).uniform_(1e-3, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(c.num_v_heads))
        self.g_proj = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(c.head_v_dim, c.norm_eps, "swish")

    def _gate(self, x):
        return -torch.exp(upcast(self.A_log)) * F.softplus(upcast(self.a_proj(x)) + self.dt_bias)

    def _output_gate(self, x):
        return self.g_proj(x)

    def _scan(self, q, k, v, g, beta, cu_seqlens):
        o, _ = chunk_gated_delta_product(q, k, v, g, beta, self.config.num_householder,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                         chunk_size=self.config.chunk_size, backend=self.backend)
        return o
