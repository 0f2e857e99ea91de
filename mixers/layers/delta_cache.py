"""Inference for the delta-rule mixers (GDN, KDA, Gated DeltaProduct): per-slot conv and
recurrent states.

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
from ..ops.chunks import compute_dtype
from .cached import CachedMixin
from .norm import upcast
from .short_conv_cache import conv_cached

_CHUNK = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}
_STEP = {"gdn": fused_recurrent_gated_delta_rule, "kda": fused_recurrent_kda,
         "gdp": fused_recurrent_gated_delta_product}


class DeltaCached(CachedMixin):
    """The inference half of the delta-rule mixers; ``KIND`` (``gdn``, ``kda``, ``gdp``) picks the ops."""

    KIND = "gdn"
    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("scan decode", (("fla", ("fused_recurrent",)),)),
    )

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
