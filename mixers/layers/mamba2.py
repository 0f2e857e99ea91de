"""``Mamba2Mixer``: mamba-ssm's ``Mamba2`` / Megatron's ``MambaMixer``, packed.

    B = rows, T = tokens, D = hidden, E = d_inner, H = heads, P = head dim, G = groups,
    Ns = state size

in_proj -> [z | x B C | dt]; short conv (SiLU) over ``x B C`` with the packed ``seq_idx`` (in training,
``x``, ``B`` and ``C`` as separate tensors through both: no ``[T, conv_dim]`` concatenation); SSD
scan with ``A = -exp(A_log)``, ``D`` skip, ``dt_bias`` and softplus, reset at every document
through ``seq_idx``; gated RMS norm ``rmsnorm(y * silu(z))`` per group; out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import mamba_chunk_scan_combined
from ._init import inverse_softplus_dt
from .base import SHORT_CONV, MixerBase
from .config import Mamba2Config
from .mamba2_cache import Mamba2Cached
from .norm import GatedRMSNorm, upcast
from .norm_linear import norm_linear
from .projections import shared_input_linear
from .short_conv import ShortConvolution


class Mamba2Mixer(Mamba2Cached, MixerBase):
    """Mamba2 mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Inference: ``allocate_inference_cache`` and ``forward(..., cache=, cache_slots=)``
    (:mod:`mixers.layers.mamba2_cache`).

    Build it from ``hidden_size`` alone (``Mamba2Mixer(512)``), with overrides
    (``Mamba2Mixer(512, state_size=128)``) or from a :class:`Mamba2Config`. ``backend``:
    ``"auto"`` (kernels where they can pack), ``"kernel"`` (checked now; raises if missing) or
    ``"reference"``.
    """

    PLAN = (("short conv", SHORT_CONV), ("SSD scan", (("mamba_ssd", ("seq_idx",)),)))

    def __init__(self, hidden_size: int | None = None, *, config: Mamba2Config | None = None, backend: str = "auto",
                 **overrides):
        super().__init__(Mamba2Config, hidden_size, config, backend, overrides)
        c = self.config
        conv_dim = c.d_inner + 2 * c.num_groups * c.state_size
        self.in_proj = nn.Linear(c.hidden_size, 2 * c.d_inner + 2 * c.num_groups * c.state_size + c.num_heads,
                                 bias=False)
        self.conv = ShortConvolution(conv_dim, c.conv_size, bias=True, activation="silu", backend=backend)
        self.dt_bias = nn.Parameter(inverse_softplus_dt(c.num_heads, c.dt_min, c.dt_max, c.dt_init_floor))
        self.A_log = nn.Parameter(torch.log(torch.empty(c.num_heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(c.num_heads))
        self.norm = GatedRMSNorm(c.d_inner, c.norm_eps, "swish", norm_before_gate=False,
                                 group_size=c.d_inner // c.num_groups)
        self.out_proj = nn.Linear(c.d_inner, c.hidden_size, bias=False)

    def _in_projections(self, hidden_states: torch.Tensor):
        """``(z, x B C, dt)`` of ``hidden_states [B, T, hidden]`` for the cached forward (its conv state
        covers ``x B C`` as one): ``in_proj`` as three products with its weight's row blocks, each its
        own contiguous tensor (the conv reads ``x B C`` without a copy)
        (:func:`mixers.layers.projections.shared_input_linear`)."""
        c = self.config
        sizes = [c.d_inner, c.d_inner + 2 * c.num_groups * c.state_size, c.num_heads]
        return tuple(shared_input_linear(hidden_states, torch.split(self.in_proj.weight, sizes, 0)))

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: mamba2_cache.py
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        c = self.config
        varlen = self.varlen(hidden_states, packed_seq_params)
        b, t, _ = hidden_states.shape
        gn = c.num_groups * c.state_size
        z, x, B, C, dt = shared_input_linear(   # in_proj's row blocks: [z | x | B | C | dt]
            hidden_states, torch.split(self.in_proj.weight, [c.d_inner, c.d_inner, gn, gn, c.num_heads], 0))
        x, B, C = self.conv.forward_parts((x, B, C), varlen)
        y = mamba_chunk_scan_combined(
            x.reshape(b, t, c.num_heads, c.head_dim), dt, -torch.exp(upcast(self.A_log)),
            B.reshape(b, t, c.num_groups, c.state_size), C.reshape(b, t, c.num_groups, c.state_size), c.chunk_size,
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=c.dt_limit, cu_seqlens=varlen,
            backend=self.backend)
        return norm_linear(self.norm, y.reshape(b, t, c.d_inner), z, self.out_proj)
