"""``Mamba1Mixer``: Mamba's selective-scan block (mamba-ssm's ``Mamba``, transformers' ``MambaMixer``,
``FalconMambaMixer``, ``JambaMambaMixer``), packed.

    B = rows, T = tokens, D = hidden, E = d_inner, R = dt rank, Ns = state size, W = conv width

The spec, one document at a time (nothing else enters it):

1. ``x, z = in_proj(h).chunk(2)``, each ``[T, E]``;
2. ``x = silu(causal_depthwise_conv(x))`` (the terms before the document's first token are zero);
3. ``dt_low, B, C = x_proj(x).split([R, Ns, Ns])``; optionally an RMS norm on each of the three
   (Falcon-Mamba: without weights; Jamba: with weights), then ``dt = dt_low @ dt_proj.weight^T``;
4. the selective scan with ``A = -exp(A_log)`` ``[E, Ns]``, ``softplus(dt + dt_proj.bias)``, the
   ``D`` skip and the ``silu(z)`` gate (:func:`mixers.ops.selective_scan_fn`);
5. ``out = out_proj(y)``.

Steps 2 and 4 mix tokens, so the packed forward hands both the forward's packing metadata: the
convolution (:func:`mixers.ops.causal_conv1d_fn`) and the scan restart at every document, take
per-document states and run under context parallelism by state passing; steps 1, 3 and 5 act on
each token alone.

Inference: the cache holds ``conv [S, E, W-1]`` (the last W-1 inputs of the conv, in the
activations' dtype) and ``ssm [S, E, Ns]`` (mamba-ssm's layout, in the compute dtype). Decoding
runs :func:`mixers.ops.selective_scan_update` in place by slot index; a packed prefill continues
each slot from its state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import selective_scan_fn, selective_scan_update
from ..ops.common.chunks import compute_dtype
from .base import SHORT_CONV, MixerBase, positive
from .blocks.init import inverse_softplus_dt
from .blocks.norm import upcast
from .blocks.short_conv import ShortConvolution
from .blocks.short_conv_cache import conv_cached
from .cached import CachedMixin

DT_BC_NORMS = (None, "weightless", "weighted")


@dataclass(frozen=True)
class Mamba1Config:
    """Mamba-1 mixer: ``d_inner = expand * hidden_size`` (or ``d_inner`` given), ``dt_rank``
    (``None``: ``ceil(hidden_size / 16)``, mamba-ssm's ``"auto"``).

    ``conv_bias`` / ``proj_bias``: biases on the conv and on ``in_proj`` / ``out_proj``
    (mamba-ssm: True / False). ``dt_bc_norm``: an RMS norm on ``dt_low``, ``B`` and ``C`` before
    ``dt_proj`` and the scan: ``None`` (Mamba), ``"weightless"`` (Falcon-Mamba), ``"weighted"``
    (Jamba: three learnt weights ``[R]``, ``[Ns]``, ``[Ns]``), with ``norm_eps``.
    ``chunk_size``: the scan's chunk length (memory only).
    """

    hidden_size: int
    expand: int = 2
    d_inner: int | None = None
    state_size: int = 16
    conv_size: int = 4
    dt_rank: int | None = None
    conv_bias: bool = True
    proj_bias: bool = False
    dt_bc_norm: str | None = None
    norm_eps: float = 1e-6
    chunk_size: int = 64
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4

    def __post_init__(self):
        for name in ("hidden_size", "expand", "state_size", "conv_size", "chunk_size"):
            positive(name, getattr(self, name))
        if self.d_inner is None:
            object.__setattr__(self, "d_inner", self.expand * self.hidden_size)
        positive("d_inner", self.d_inner)
        if self.dt_rank is None:
            object.__setattr__(self, "dt_rank", math.ceil(self.hidden_size / 16))
        positive("dt_rank", self.dt_rank)
        for name in ("conv_bias", "proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dt_bc_norm not in DT_BC_NORMS:
            raise ValueError(f"dt_bc_norm must be one of {DT_BC_NORMS}, got {self.dt_bc_norm!r}")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive number, got {self.norm_eps!r}")


def rms_normalized(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in fp32 for half inputs and cast back, then times
    ``weight`` (if any): how Falcon-Mamba and Jamba normalise ``dt_low``, ``B`` and ``C``."""
    xf = upcast(x)
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else weight * out


class Mamba1Mixer(CachedMixin, MixerBase):
    """Mamba-1 selective-scan mixer: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Build it from ``hidden_size`` alone (``Mamba1Mixer(512)``), with overrides
    (``Mamba1Mixer(512, state_size=8)``) or from a :class:`Mamba1Config`. ``backend``: ``"auto"``,
    ``"kernel"`` (checked now; the conv's kernels; the scan has none that packs) or ``"reference"``.
    """

    CONFIG = Mamba1Config
    PLAN = (("short conv", SHORT_CONV),)
    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("scan decode", (("mamba_decode", ("state_batch_indices",)),)),
    )

    def __init__(self, hidden_size: int | None = None, *, config: Mamba1Config | None = None, backend: str = "auto",
                 **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c = self.config
        self.scan_backend = "auto" if backend == "kernel" else backend    # the scan has no packing kernel
        self.in_proj = nn.Linear(c.hidden_size, 2 * c.d_inner, bias=c.proj_bias)
        self.conv = ShortConvolution(c.d_inner, c.conv_size, bias=c.conv_bias, activation="silu", backend=backend)
        self.x_proj = nn.Linear(c.d_inner, c.dt_rank + 2 * c.state_size, bias=False)
        self.dt_proj = nn.Linear(c.dt_rank, c.d_inner, bias=True)
        with torch.no_grad():
            bound = c.dt_rank ** -0.5
            self.dt_proj.weight.uniform_(-bound, bound)
            self.dt_proj.bias.copy_(inverse_softplus_dt(c.d_inner, c.dt_min, c.dt_max, c.dt_init_floor))
        A = torch.arange(1, c.state_size + 1, dtype=torch.float32).expand(c.d_inner, -1)
        self.A_log = nn.Parameter(torch.log(A).contiguous())
        self.D = nn.Parameter(torch.ones(c.d_inner))
        if c.dt_bc_norm == "weighted":
            self.dt_norm = nn.Parameter(torch.ones(c.dt_rank))
            self.b_norm = nn.Parameter(torch.ones(c.state_size))
            self.c_norm = nn.Parameter(torch.ones(c.state_size))
        self.out_proj = nn.Linear(c.d_inner, c.hidden_size, bias=c.proj_bias)

    def _scan_inputs(self, x: torch.Tensor):
        """``(dt_low @ dt_proj.weight^T, B, C)`` of the conv's output ``x [B, T, E]`` (step 3)."""
        c = self.config
        dt, B, C = torch.split(self.x_proj(x), [c.dt_rank, c.state_size, c.state_size], dim=-1)
        if c.dt_bc_norm is not None:
            weighted = c.dt_bc_norm == "weighted"
            dt = rms_normalized(dt, self.dt_norm if weighted else None, c.norm_eps)
            B = rms_normalized(B, self.b_norm if weighted else None, c.norm_eps)
            C = rms_normalized(C, self.c_norm if weighted else None, c.norm_eps)
        return dt @ self.dt_proj.weight.t(), B, C

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        varlen = self.varlen(hidden_states, packed_seq_params)
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        x = self.conv(x, varlen)
        dt, B, C = self._scan_inputs(x)
        y = selective_scan_fn(x.transpose(1, 2), dt.transpose(1, 2), -torch.exp(upcast(self.A_log)),
                              B.transpose(1, 2), C.transpose(1, 2), self.D, z.transpose(1, 2),
                              delta_bias=self.dt_proj.bias, delta_softplus=True, cu_seqlens=varlen,
                              chunk_size=self.config.chunk_size, backend=self.scan_backend)
        return self.out_proj(y.transpose(1, 2))

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        return {"conv": torch.zeros(slots, c.d_inner, c.conv_size - 1, dtype=dtype, device=device),
                "ssm": torch.zeros(slots, c.d_inner, c.state_size, dtype=compute_dtype(dtype), device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        x = conv_cached(self.conv, x.contiguous(), cache, "conv", batch)
        dt, B, C = self._scan_inputs(x)
        A = -torch.exp(upcast(self.A_log))
        if batch.decode:
            y = selective_scan_update(cache["ssm"], x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D=self.D, z=z[:, 0],
                                      dt_bias=self.dt_proj.bias, dt_softplus=True, state_batch_indices=batch.slots,
                                      backend=self.backend)
            return self.out_proj(y.unsqueeze(1))
        initial = None if batch.all_fresh else cache.gather("ssm", batch)
        args = (x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), self.D,
                z.transpose(1, 2))
        kwargs = dict(delta_bias=self.dt_proj.bias, delta_softplus=True, chunk_size=self.config.chunk_size,
                      backend=self.scan_backend)
        if batch.packed:
            y, states = selective_scan_fn(*args, initial_states=batch.spread(initial), cu_seqlens=batch.state_varlen,
                                          return_varlen_states=True, **kwargs)
            states = batch.pick(states)
        else:
            y, states = selective_scan_fn(*args, return_last_state=True, initial_states=initial, **kwargs)
        cache.write("ssm", batch, states)
        return self.out_proj(y.transpose(1, 2))
