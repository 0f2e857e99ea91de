"""What Gated DeltaNet, KDA and Gated DeltaProduct mixers share (fla's layer structure).

    B = rows, T = tokens, D = hidden, H = key heads, HV = value heads, K / V = head dims,
    nh = num_householder, the delta steps per token (1 except for Gated DeltaProduct)

q / k / v projections, each through a short convolution (SiLU) fed the packed ``seq_idx``;
``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``); the subclass's gate and scan;
a gated RMS norm per value head and out_proj, as one function (:mod:`.blocks.norm_linear`). The
kernel and reference paths share all of it, and so do training and the cached forward
(:meth:`DeltaMixerBase._prepare`): only the short convs (plain or continuing their slots) and the
op call differ, and the op chooses the backend.

Made of (where each piece lives; the subclasses :mod:`.gated_deltanet`, :mod:`.kda` and
:mod:`.gated_deltaproduct` hold their config, add their gate and name their ops, ``CHUNK`` and
``STEP``):

* constructor preamble, kernel plan, packing metadata: :class:`.base.MixerBase`;
* sizes: :class:`DeltaConfig` and the subclasses' configs; gate initialisation:
  :mod:`.blocks.init`; the decay gate: :mod:`.blocks.decay_gate`;
* q / k / v / beta projections in one call: :func:`.blocks.projections.project`;
* short convs: :class:`.blocks.short_conv.ShortConvolution` (cached:
  :func:`.blocks.short_conv_cache.conv_cached`);
* scan: the ``chunk_*`` ops of :mod:`mixers.ops` (decoding: the ``fused_recurrent_*`` ops);
* gated norm and out_proj as one function: :class:`.blocks.norm.GatedRMSNorm`,
  :func:`.blocks.norm_linear.norm_linear`;
* cache allocation and the cached forward's preamble: :class:`.cached.CachedMixin`; the cache
  and cached forward of these mixers: the methods of :class:`DeltaMixerBase` after ``forward``.

Inference: per-slot conv and recurrent states.

    S = slots, N = slots of one call, H / HV = key / value heads, K / V = head dims,
    nh = num_householder (Gated DeltaProduct), W = conv width

The cache holds ``q_conv [S, H K, W-1]``, ``k_conv [S, nh H K, W-1]``, ``v_conv [S, nh HV V, W-1]``
(the short convs' last inputs, in the activations' dtype) and ``recurrent [S, HV, K, V]`` (fla's
layout, in the compute dtype: fp32 for fp16 / bf16). Decoding runs the ``fused_recurrent_*`` ops
(fla's Triton fused recurrent kernels), a packed call the chunked ops with ``cu_seqlens`` and
per-document initial states (fla's chunk kernels take them), rows of t tokens the chunked ops
with per-row states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops.common.checks import check_chunk_size
from ..ops.common.chunks import compute_dtype
from .base import SHORT_CONV, MixerBase, default_heads, divides, positive
from .blocks.decay_gate import decay_gate
from .blocks.init import inverse_softplus_dt
from .blocks.norm import GatedRMSNorm, upcast
from .blocks.norm_linear import norm_linear
from .blocks.projections import project
from .blocks.short_conv import ShortConvolution
from .blocks.short_conv_cache import conv_cached
from .cached import CachedMixin


@dataclass(frozen=True)
class DeltaConfig:
    """Shared by GDN, KDA and Gated DeltaProduct: key heads of ``head_dim``, value heads of
    ``head_dim * expand_v`` (``num_v_heads`` a multiple of ``num_heads``: grouped values).

    ``norm_eps`` of the gated output norm: 1e-5 in fla; 1e-6 (``rms_norm_eps``) in Hugging Face's
    Qwen3-Next and Kimi-Linear.
    """

    hidden_size: int
    head_dim: int = 64
    num_heads: int | None = None
    num_v_heads: int | None = None
    expand_v: float = 2.0
    conv_size: int = 4
    chunk_size: int = 64
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5
    heads_share: float = field(default=0.75, repr=False)   # num_heads * head_dim = 0.75 * hidden (fla's GDN)

    def __post_init__(self):
        positive("hidden_size", self.hidden_size)
        positive("head_dim", self.head_dim)
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", default_heads(self.hidden_size, self.head_dim, self.heads_share))
        if self.num_v_heads is None:
            object.__setattr__(self, "num_v_heads", self.num_heads)
        positive("num_heads", self.num_heads)
        positive("num_v_heads", self.num_v_heads)
        divides("num_heads", self.num_heads, "num_v_heads", self.num_v_heads)
        if self.head_v_dim * 1.0 != self.head_dim * self.expand_v or self.head_v_dim < 1:
            raise ValueError(f"head_dim * expand_v = {self.head_dim * self.expand_v} must be a positive integer")
        check_chunk_size(self.chunk_size)

    @property
    def head_v_dim(self) -> int:
        return int(round(self.head_dim * self.expand_v))

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


class DeltaMixerBase(CachedMixin, MixerBase):
    """Base of the delta-rule mixers; subclasses set ``CONFIG``, their ops ``CHUNK`` (the chunked
    op: training, packed prefill, chunks of rows) and ``STEP`` (the decode step), and build the gates."""

    CHUNK = None
    STEP = None
    PLAN = (("short convs", SHORT_CONV), ("delta-rule scan", (("fla", ("varlen",)),)))
    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("scan decode", (("fla", ("fused_recurrent",)),)),
    )

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c, nh = self.config, self.num_householder
        self.q_proj = nn.Linear(c.hidden_size, c.key_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.key_dim * nh, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.value_dim * nh, bias=False)
        self.b_proj = nn.Linear(c.hidden_size, c.num_v_heads * nh, bias=False)
        self.q_conv = ShortConvolution(c.key_dim, c.conv_size, activation="silu", backend=backend)
        self.k_conv = ShortConvolution(c.key_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.v_conv = ShortConvolution(c.value_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.o_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    @property
    def num_householder(self) -> int:
        """Delta steps per token: the config's ``num_householder`` (Gated DeltaProduct), else 1."""
        return getattr(self.config, "num_householder", 1)

    def _op_args(self) -> tuple:
        """The ops' positional arguments after ``beta`` (Gated DeltaProduct: ``num_householder``)."""
        return ()

    def _project(self, hidden_states: torch.Tensor):
        """``(q, k, v, beta_logits, gate_in, output_gate)``: every projection of ``hidden_states`` in
        one call with one input gradient (:func:`mixers.layers.blocks.projections.project`); ``gate_in``
        feeds the subclass's ``_gate``, ``output_gate`` the output norm. The subclass's
        ``_gate_inputs()`` names the last two projections."""
        return project(hidden_states, (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self._gate_inputs()))

    def _prepare(self, hidden_states: torch.Tensor, conv):
        """``(q, k, v, g, beta, output_gate)`` for the scan, shared by training and the cached forward:
        the projections, ``conv(module, x, name)`` for each short conv (``name``: its cache state),
        heads, ``beta`` and the gate."""
        c, nh = self.config, self.num_householder
        b, t, _ = hidden_states.shape
        q, k, v, beta, gate_in, out_gate = self._project(hidden_states)
        q = conv(self.q_conv, q, "q_conv").reshape(b, t, c.num_heads, c.head_dim)
        k = conv(self.k_conv, k, "k_conv").reshape(b, t * nh, c.num_heads, c.head_dim)
        v = conv(self.v_conv, v, "v_conv").reshape(b, t * nh, c.num_v_heads, c.head_v_dim)
        beta = torch.sigmoid(upcast(beta)).reshape(b, t * nh, c.num_v_heads)
        if c.allow_neg_eigval:
            beta = beta * 2
        return q, k, v.to(q.dtype), self._gate(gate_in), beta.to(q.dtype), out_gate

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``; packed input needs ``B == 1``. With ``cache``: inference
        (the methods after ``forward``)."""
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        c = self.config
        varlen = self.varlen(hidden_states, packed_seq_params)
        b, t, _ = hidden_states.shape
        q, k, v, g, beta, out_gate = self._prepare(hidden_states, lambda conv, x, name: conv(x, varlen))
        o, _ = self.CHUNK(q, k, v, g, beta, *self._op_args(), use_qk_l2norm_in_kernel=True, cu_seqlens=varlen,
                          chunk_size=c.chunk_size, backend=self.backend)
        return norm_linear(self.o_norm, o.reshape(b, t, c.value_dim), out_gate, self.o_proj)   # per value head

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c, nh, width = self.config, self.num_householder, self.config.conv_size - 1
        zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return {"q_conv": zeros(slots, c.key_dim, width), "k_conv": zeros(slots, c.key_dim * nh, width),
                "v_conv": zeros(slots, c.value_dim * nh, width),
                "recurrent": zeros(slots, c.num_v_heads, c.head_dim, c.head_v_dim, dtype=compute_dtype(dtype))}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        c = self.config
        b, t, _ = hidden_states.shape
        q, k, v, g, beta, out_gate = self._prepare(
            hidden_states, lambda conv, x, name: conv_cached(conv, x, cache, name, batch))
        o = self._scan_cached(q, k, v, g, beta, cache, batch)
        o = self.o_norm(o, out_gate.reshape(b, t, c.num_v_heads, c.head_v_dim))
        return self.o_proj(o.reshape(b, t, c.value_dim))

    def _scan_cached(self, q, k, v, g, beta, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        args = (q, k, v, g, beta, *self._op_args())
        initial = None if batch.all_fresh else cache.gather("recurrent", batch)
        kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, backend=self.backend)
        if batch.decode:
            o, state = self.STEP(*args, initial_state=initial, **kwargs)
        elif batch.packed:
            o, state = self.CHUNK(*args, initial_state=batch.spread(initial), cu_seqlens=batch.state_varlen,
                                  chunk_size=self.config.chunk_size, **kwargs)
            state = batch.pick(state)
        else:
            o, state = self.CHUNK(*args, initial_state=initial, chunk_size=self.config.chunk_size, **kwargs)
        cache.write("recurrent", batch, state)
        return o


class ScalarGateMixer(DeltaMixerBase):
    """GDN and Gated DeltaProduct: ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` per value
    head and a SiLU-gated output norm with ``g_proj(x)``."""

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(hidden_size, config=config, backend=backend, **overrides)
        c = self.config
        self.a_proj = nn.Linear(c.hidden_size, c.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(c.num_v_heads).uniform_(1e-3, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(c.num_v_heads))
        self.g_proj = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(c.head_v_dim, c.norm_eps, "swish")

    def _gate_inputs(self):
        return self.a_proj, self.g_proj

    def _gate(self, a):
        """The log decay ``[B, T, HV]`` from ``a_proj``'s output."""
        return decay_gate(a, self.dt_bias, self.A_log)
