"""``Mamba2Mixer``: mamba-ssm's ``Mamba2`` / Megatron's ``MambaMixer``, packed.

    B = rows, T = tokens, D = hidden, E = d_inner, H = heads, P = head dim, G = groups,
    Ns = state size

in_proj -> [z | x B C | dt]; short conv (SiLU) over ``x B C`` with the packed ``seq_idx`` (in training,
``x``, ``B`` and ``C`` as separate tensors through both: no ``[T, conv_dim]`` concatenation); SSD
scan with ``A = -exp(A_log)``, ``D`` skip, ``dt_bias`` and softplus, reset at every document
through ``seq_idx``; gated RMS norm ``rmsnorm(y * silu(z))`` per group; out_proj.

Made of (where each piece lives):

* constructor preamble, kernel plan, packing metadata: :class:`.base.MixerBase`;
* sizes: :class:`Mamba2Config` below; ``dt`` / ``A`` initialisation: :mod:`.blocks.init`;
* in_proj as three linears over one input: :func:`.blocks.projections.shared_input_linear`;
* short conv: :class:`.blocks.short_conv.ShortConvolution` (cached:
  :func:`.blocks.short_conv_cache.conv_cached`);
* SSD scan: :func:`mixers.ops.mamba_chunk_scan_combined` (decoding:
  :func:`mixers.ops.selective_state_update`);
* gated norm and out_proj as one function: :class:`.blocks.norm.GatedRMSNorm`,
  :func:`.blocks.norm_linear.norm_linear`;
* cache allocation and the cached forward's preamble: :class:`.cached.CachedMixin`; this
  mixer's cache and cached forward: the methods after ``forward``.

Inference: per-slot conv and SSM states, packed prefill, chunks and decoding.

    S = slots, N = documents / rows of one call (one slot each), E = d_inner, H = heads,
    P = head dim, G = groups, Ns = state size, W = conv width

The cache holds ``conv [S, E + 2 G Ns, W-1]`` (the last W-1 inputs of the short conv, in the
activations' dtype) and ``ssm [S, H, P, Ns]`` (mamba-ssm's layout, in the compute dtype: fp32 for
fp16 / bf16). Decoding runs :func:`mixers.ops.selective_state_update` (mamba-ssm's Triton kernel
with ``state_batch_indices``, in place on the pool); a packed call runs the SSD scan with
``cu_seqlens`` and per-document initial states (mamba-ssm's kernel cannot take those: the
reference then; when every slot is fresh there are none and the kernel runs), rows of t tokens
with per-row initial and final states (the kernel takes those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import mamba_chunk_scan_combined, selective_state_update
from ..ops.common.chunks import compute_dtype
from .base import SHORT_CONV, MixerBase, divides, positive
from .blocks.init import inverse_softplus_dt
from .blocks.norm import GatedRMSNorm, upcast
from .blocks.norm_linear import norm_linear
from .blocks.projections import shared_input_linear
from .blocks.short_conv import ShortConvolution
from .blocks.short_conv_cache import conv_cached
from .cached import CachedMixin


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 (SSD) mixer: ``d_inner = expand * hidden_size``, ``d_inner / head_dim`` heads.

    ``num_heads`` instead sets ``d_inner = num_heads * head_dim`` for checkpoints whose inner width
    is not a multiple of ``hidden_size`` (Megatron's / NemotronH's ``mamba_num_heads``, FalconH1's
    ``mamba_d_ssm``); giving both ``expand`` and ``num_heads`` requires them to agree.
    ``norm_eps``: 1e-5 in mamba-ssm and Megatron; HF checkpoints carry their own
    (``layer_norm_epsilon`` / ``rms_norm_eps``, often 1e-6).
    """

    hidden_size: int
    expand: int | None = None
    head_dim: int = 64
    state_size: int = 64
    num_groups: int = 1
    conv_size: int = 4
    chunk_size: int = 128
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    num_heads: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "state_size", "num_groups", "conv_size", "chunk_size"):
            positive(name, getattr(self, name))
        if self.num_heads is None:
            if self.expand is None:
                object.__setattr__(self, "expand", 2)
            positive("expand", self.expand)
            divides("head_dim", self.head_dim, "expand * hidden_size", self.expand * self.hidden_size)
            object.__setattr__(self, "num_heads", self.expand * self.hidden_size // self.head_dim)
        else:
            positive("num_heads", self.num_heads)
            if self.expand is not None and self.expand * self.hidden_size != self.d_inner:
                raise ValueError(f"expand={self.expand} gives d_inner={self.expand * self.hidden_size} but "
                                 f"num_heads * head_dim = {self.d_inner}; give one of them (expand=None)")
        divides("num_groups", self.num_groups, "num_heads", self.num_heads)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim


class Mamba2Mixer(CachedMixin, MixerBase):
    """Mamba2 mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Inference: ``allocate_inference_cache`` and ``forward(..., cache=, cache_slots=)``
    (the methods after ``forward``).

    Build it from ``hidden_size`` alone (``Mamba2Mixer(512)``), with overrides
    (``Mamba2Mixer(512, state_size=128)``) or from a :class:`Mamba2Config`. ``backend``:
    ``"auto"`` (kernels where they can pack), ``"kernel"`` (checked now; raises if missing) or
    ``"reference"``.
    """

    CONFIG = Mamba2Config
    PLAN = (("short conv", SHORT_CONV), ("SSD scan", (("mamba_ssd", ("seq_idx",)),)))
    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("SSD decode", (("mamba_decode", ("state_batch_indices",)),)),
    )

    def __init__(self, hidden_size: int | None = None, *, config: Mamba2Config | None = None, backend: str = "auto",
                 **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
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
        (:func:`mixers.layers.blocks.projections.shared_input_linear`)."""
        c = self.config
        sizes = [c.d_inner, c.d_inner + 2 * c.num_groups * c.state_size, c.num_heads]
        return tuple(shared_input_linear(hidden_states, torch.split(self.in_proj.weight, sizes, 0)))

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
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

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        conv_dim = c.d_inner + 2 * c.num_groups * c.state_size
        return {"conv": torch.zeros(slots, conv_dim, c.conv_size - 1, dtype=dtype, device=device),
                "ssm": torch.zeros(slots, c.num_heads, c.head_dim, c.state_size, dtype=compute_dtype(dtype),
                                   device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        c = self.config
        b, t, _ = hidden_states.shape
        heads, p, groups, ns = c.num_heads, c.head_dim, c.num_groups, c.state_size
        z, xbc, dt = self._in_projections(hidden_states)
        xbc = conv_cached(self.conv, xbc, cache, "conv", batch)
        x, B, C = torch.split(xbc, [c.d_inner, groups * ns, groups * ns], -1)
        A = -torch.exp(upcast(self.A_log))
        if batch.decode:
            y = selective_state_update(
                cache["ssm"], x.reshape(b, heads, p), dt.reshape(b, heads, 1).expand(b, heads, p),
                A[:, None, None].expand(heads, p, ns), B.reshape(b, groups, ns), C.reshape(b, groups, ns),
                D=self.D[:, None].expand(heads, p), dt_bias=self.dt_bias[:, None].expand(heads, p),
                dt_softplus=True, state_batch_indices=batch.slots, dt_limit=c.dt_limit, backend=self.backend)
            return self.out_proj(self.norm(y.reshape(b, 1, c.d_inner), z))
        initial = None if batch.all_fresh else cache.gather("ssm", batch)
        args = (x.reshape(b, t, heads, p), dt, A, B.reshape(b, t, groups, ns), C.reshape(b, t, groups, ns),
                c.chunk_size)
        kwargs = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=c.dt_limit, backend=self.backend)
        if batch.packed:
            y, states = mamba_chunk_scan_combined(*args, initial_states=batch.spread(initial),
                                                  cu_seqlens=batch.state_varlen, return_varlen_states=True, **kwargs)
            states = batch.pick(states)
        else:
            y, states = mamba_chunk_scan_combined(*args, initial_states=initial, return_final_states=True, **kwargs)
        cache.write("ssm", batch, states)
        return self.out_proj(self.norm(y.reshape(b, t, c.d_inner), z))
