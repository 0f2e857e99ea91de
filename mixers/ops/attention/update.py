"""``attention_with_kvcache``: new queries attending over a slot-indexed KV cache (decoding).

    N = rows of this call, t = queries per row, S = cache slots, L = cache length,
    Hq / Hk = query / key-value heads, D = head dim

Mirrors flash-attn's ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
cache_batch_idx, softmax_scale, causal, window_size)`` (no rotary, paged or split arguments:
the mixers rotate their keys before caching them): ``q [N, t, Hq, D]``; caches ``[S, L, Hk, D]``;
row i reads slot ``cache_batch_idx[i]`` (row i without it) whose first ``cache_seqlens[i]`` keys
are cached; ``k``, ``v`` ``[N, t_new, Hk, D]``, when given, are written into the caches **in place**
after them, and row i then attends over ``cache_seqlens[i] + t_new`` keys. The causal mask is
aligned to the bottom right: query j of a row sits at key position ``total - t + j``; a query
with no key to attend to returns zeros. ``window_size=(left, right)`` as in flash-attn (-1 =
unbounded). The kernel is flash-attn's (fp16 / bf16, CUDA); the reference gathers each row's
keys and runs SDPA with the mask (the compute dtype of the references, fp64 exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import KVCacheCall, checked_kvcache
from .update_kernel import kvcache_kernel, unsupported

__all__ = ["attention_with_kvcache"]


def _append(k_cache, v_cache, k, v, index, lens):
    """Write the new keys and values after each row's cached ones (in place)."""
    positions = lens.unsqueeze(1) + torch.arange(k.shape[1], device=lens.device)
    if positions.numel() and int(positions.max()) >= k_cache.shape[1]:
        raise ValueError(f"the new keys reach position {int(positions.max())} of a cache of {k_cache.shape[1]}; "
                         "allocate a longer cache")
    rows = index.unsqueeze(1).expand_as(positions)
    k_cache[rows, positions] = k.to(k_cache.dtype)
    v_cache[rows, positions] = v.to(v_cache.dtype)


def _attend(q, k_cache, v_cache, index, total, scale, causal, window):
    """Each row's queries over its slot's first ``total`` keys (bottom-right aligned)."""
    compute = compute_dtype(q.dtype)
    rows, steps, hq, d = q.shape
    longest = max(int(total.max()) if rows else 0, 1)
    keys = k_cache[:, :longest].index_select(0, index).to(compute)            # [N, K, Hk, D]
    values = v_cache[:, :longest].index_select(0, index).to(compute)
    groups = hq // k_cache.shape[2]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=2), values.repeat_interleave(groups, dim=2)
    key_pos = torch.arange(longest, device=q.device)
    query_pos = total.unsqueeze(1) - steps + torch.arange(steps, device=q.device)     # [N, t]
    keep = key_pos < total[:, None, None]                                          # [N, 1, K]
    keep = keep & (key_pos <= query_pos[..., None]) if causal else keep
    left, right = window
    if left >= 0:
        keep = keep & (key_pos >= query_pos[..., None] - left)
    if right >= 0 and not causal:
        keep = keep & (key_pos <= query_pos[..., None] + right)
    keep = keep.expand(rows, steps, longest)
    out = F.scaled_dot_product_attention(q.to(compute).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=keep.unsqueeze(1), scale=scale)
    out = out.transpose(1, 2)
    return torch.where(keep.any(-1)[..., None, None], out, torch.zeros_like(out)).to(q.dtype)


def _reference(call: KVCacheCall) -> torch.Tensor:
    """The new keys and values appended (in place), then each row's queries over its slot."""
    q, k, lens = call.q, call.k, call.cache_seqlens
    index = torch.arange(q.shape[0], device=q.device) if call.cache_batch_idx is None else \
        call.cache_batch_idx.to(device=q.device, dtype=torch.int64)
    if k is not None:
        _append(call.k_cache, call.v_cache, k.detach(), call.v.detach(), index, lens)
        lens = lens + k.shape[1]
    return _attend(q, call.k_cache, call.v_cache, index, lens, call.scale, call.causal, call.window)


@outside_autocast
def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), *, backend="auto"):
    """Queries ``[N, t, Hq, D]`` over the cached keys of their slots (see the module docstring).

    Returns ``[N, t, Hq, D]``; ``k_cache`` / ``v_cache`` hold ``k`` / ``v`` afterwards when given.
    """
    call = checked_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size, backend=backend)
    choice = dispatch.select_backend("attention_with_kvcache", backend, on_cuda=dispatch.is_cuda(q),
                                     support_state=lambda: dispatch.cached_support("flash_attn", ("kvcache",)),
                                     missing_feature=unsupported(q, k_cache, v_cache, k, v))
    return kvcache_kernel(call) if choice == "kernel" else _reference(call)
