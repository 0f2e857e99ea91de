"""Inference for ``Mamba2Mixer``: per-slot conv and SSM states, packed prefill, chunks and decoding.

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

import torch

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import mamba_chunk_scan_combined, selective_state_update
from ..ops.chunks import compute_dtype
from .cached import CachedMixin
from .norm import upcast
from .short_conv_cache import conv_cached


class Mamba2Cached(CachedMixin):
    """The inference half of :class:`mixers.Mamba2Mixer`."""

    INFERENCE_PLAN = (
        ("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),
        ("SSD decode", (("mamba_decode", ("state_batch_indices",)),)),
    )

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
