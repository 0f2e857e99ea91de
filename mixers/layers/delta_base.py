"""What Gated DeltaNet, KDA and Gated DeltaProduct mixers share (fla's layer structure).

    B = rows, T = tokens, D = hidden, H = key heads, HV = value heads, K / V = head dims,
    nh = delta steps per token (1 except for Gated DeltaProduct)

q / k / v projections, each through a short convolution (SiLU) fed the packed ``seq_idx``;
``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``); the subclass's gate and scan;
a gated RMS norm per value head and out_proj, as one function (:mod:`.norm_linear`). The kernel
and reference paths share all of it: only the op call inside ``_scan`` differs, and the op
chooses the backend.

Made of (where each piece lives; the subclasses :mod:`.gated_deltanet`, :mod:`.kda` and
:mod:`.gated_deltaproduct` add their gate and pick their op):

* constructor preamble, kernel plan, packing metadata: :class:`.base.MixerBase`;
* sizes: :mod:`.config`; gate initialisation and the decay gate: :mod:`._init`;
* q / k / v / beta projections in one call: :func:`.projections.project`;
* short convs: :class:`.short_conv.ShortConvolution` (cached: :func:`.short_conv_cache.conv_cached`);
* scan: the ``chunk_*`` ops of :mod:`mixers.ops` (decoding: the ``fused_recurrent_*`` ops);
* gated norm and out_proj as one function: :class:`.norm.GatedRMSNorm`, :func:`.norm_linear.norm_linear`;
* cache allocation and the cached forward's preamble: :class:`.cached.CachedMixin`; the cache
  and cached forward of these mixers: the methods of :class:`DeltaMixerBase` after ``forward``.

Inference: per-slot conv and recurrent states.

    S = slots, N = slots of one call, H / HV = key / value heads, K / V = head dims,
    nh = delta steps per token (Gated DeltaProduct), W = conv width

The cache holds ``q_conv [S, H K, W-1]``, ``k_conv [S, nh H K, W-1]``, ``v_conv [S, nh HV V, W-1]``
(the short convs' last inputs, in the activations' dtype) and ``recurrent [S, HV, K, V]`` (fla's
layout, in the compute dtype: fp32 for fp16 / bf16). Decoding runs the ``fused_recurrent_*`` ops
(fla's Triton fused recurrent kernels), a packed call the chunked ops with ``cu_seqlens`` and
per-document initial states (fla's chunk kernels take them), rows of t tokens the chunked ops
with per-row states.
"""

from __future__ import annotations

import torch
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import (
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)
from ..ops.common.chunks import compute_dtype
from ._init import decay_gate, inverse_softplus_dt
from .base import SHORT_CONV, MixerBase
from .cached import CachedMixin
from .norm import GatedRMSNorm, upcast
from .norm_linear import norm_linear
from .projections import project
from .short_conv import ShortConvolution
from .short_conv_cache import conv_cached

_CHUNK = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}
_STEP = {"gdn": fused_recurrent_gated_delta_rule, "kda": fused_recurrent_kda,
         "gdp": fused_recurrent_gated_delta_product}


class DeltaMixerBase(CachedMixin, MixerBase):
    """Base of the delta-rule mixers; subclasses set ``CONFIG`` and build the gates."""

    CONFIG = None
    PLAN = (("short convs", SHORT_CONV), ("delta-rule scan", (("fla", ("varlen",)),)))
    HOUSEHOLDER = 1
    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("scan decode", (("fla", ("fused_recurrent",)),)),
    )

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c, nh = self.config, self.householder
        self.q_proj = nn.Linear(c.hidden_size, c.key_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.key_dim * nh, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.value_dim * nh, bias=False)
        self.b_proj = nn.Linear(c.hidden_size, c.num_v_heads * nh, bias=False)
        self.q_conv = ShortConvolution(c.key_dim, c.conv_size, activation="silu", backend=backend)
        self.k_conv = ShortConvolution(c.key_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.v_conv = ShortConvolution(c.value_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.o_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    @property
    def householder(self) -> int:
        return getattr(self.config, "num_householder", 1)

    def _project(self, hidden_states: torch.Tensor):
        """``(q, k, v, beta_logits, gate_in, output_gate)``: every projection of ``hidden_states`` in
        one call with one input gradient (:func:`mixers.layers.projections.project`); ``gate_in``
        feeds the subclass's ``_gate``, ``output_gate`` the output norm. The subclass's
        ``_gate_inputs()`` names the last two projections."""
        return project(hidden_states, (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self._gate_inputs()))

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``; packed input needs ``B == 1``. With ``cache``: inference
        (the methods after ``forward``)."""
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        c, nh = self.config, self.householder
        varlen = self.varlen(hidden_states, packed_seq_params)
        b, t, _ = hidden_states.shape
        q, k, v, beta, gate_in, out_gate = self._project(hidden_states)
        q = self.q_conv(q, varlen).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_conv(k, varlen).reshape(b, t * nh, c.num_heads, c.head_dim)
        v = self.v_conv(v, varlen).reshape(b, t * nh, c.num_v_heads, c.head_v_dim)
        beta = torch.sigmoid(upcast(beta)).reshape(b, t * nh, c.num_v_heads)
        if c.allow_neg_eigval:
            beta = beta * 2
        o = self._scan(q, k, v.to(q.dtype), self._gate(gate_in), beta.to(q.dtype), varlen)
        return norm_linear(self.o_norm, o.reshape(b, t, c.value_dim), out_gate, self.o_proj)   # per value head

    KIND = "gdn"
    def _cache_states(self, slots, max_seqlen, dtype, device):
        c, nh, width = self.config, self.householder, self.config.conv_size - 1
        zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return {"q_conv": zeros(slots, c.key_dim, width), "k_conv": zeros(slots, c.key_dim * nh, width),
                "v_conv": zeros(slots, c.value_dim * nh, width),
                "recurrent": zeros(slots, c.num_v_heads, c.head_dim, c.head_v_dim, dtype=compute_dtype(dtype))}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        c, nh = self.config, self.householder
        b, t, _ = hidden_states.shape
        q, k, v, beta, gate_in, out_gate = self._project(hidden_states)
        q = conv_cached(self.q_conv, q, cache, "q_conv", batch)
        k = conv_cached(self.k_conv, k, cache, "k_conv", batch)
        v = conv_cached(self.v_conv, v, cache, "v_conv", batch)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = k.reshape(b, t * nh, c.num_heads, c.head_dim)
        v = v.reshape(b, t * nh, c.num_v_heads, c.head_v_dim)
        beta = torch.sigmoid(upcast(beta)).reshape(b, t * nh, c.num_v_heads)
        if c.allow_neg_eigval:
            beta = beta * 2
        o = self._scan_cached(q, k, v.to(q.dtype), self._gate(gate_in), beta.to(q.dtype), cache, batch)
        o = self.o_norm(o, out_gate.reshape(b, t, c.num_v_heads, c.head_v_dim))
        return self.o_proj(o.reshape(b, t, c.value_dim))

    def _scan_cached(self, q, k, v, g, beta, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        extra = (self.householder,) if self.KIND == "gdp" else ()
        initial = None if batch.all_fresh else cache.gather("recurrent", batch)
        kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, backend=self.backend)
        if batch.decode:
            o, state = _STEP[self.KIND](q, k, v, g, beta, *extra, initial_state=initial, **kwargs)
        elif batch.packed:
            o, state = _CHUNK[self.KIND](q, k, v, g, beta, *extra, initial_state=batch.spread(initial),
                                         cu_seqlens=batch.state_varlen, chunk_size=self.config.chunk_size, **kwargs)
            state = batch.pick(state)
        else:
            o, state = _CHUNK[self.KIND](q, k, v, g, beta, *extra, initial_state=initial,
                                         chunk_size=self.config.chunk_size, **kwargs)
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
