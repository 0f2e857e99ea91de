"""flash-attn's ``flash_attn_with_kvcache``: attention of new queries over a slot-indexed KV cache.

Upstream contract (``cache_batch_idx`` since flash-attn 2.3.1): ``q [N, t, Hq, D]``, caches
``[S, L, Hk, D]``, fp16 / bf16 on CUDA, ``cache_seqlens`` int32 ``[N]`` (the cached length of
each row, before the new keys), ``cache_batch_idx`` int32 ``[N]``; ``k`` / ``v`` ``[N, t, Hk, D]``
are written into the caches in place at ``cache_seqlens``; the causal mask is aligned to the
bottom right (query j of a row sits at ``cache_seqlens + t_new - t + j``). ssm-pack applies the
rotary embedding itself (its half-split layout), so no ``rotary_cos`` / ``rotary_sin`` is passed.
It has no backward: a call autograd records takes the reference.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ._validate import KVCacheCall

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def unsupported(q, k_cache, *inputs) -> str | None:
    """Why the kernel cannot take these inputs (``inputs``: the other tensors, for autograd), or ``None``."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} (flash-attn takes fp16 / bf16)"
    if k_cache.dtype != q.dtype:
        return f"a {k_cache.dtype} cache with {q.dtype} queries"
    return dispatch.forward_only("flash_attn_with_kvcache", q, k_cache, *inputs)


def load_upstream():
    from flash_attn import flash_attn_with_kvcache
    return flash_attn_with_kvcache


def kvcache_kernel(call: KVCacheCall):
    attend = load_upstream()
    q = call.q
    seqlens = call.cache_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    index = None if call.cache_batch_idx is None else \
        call.cache_batch_idx.to(device=q.device, dtype=torch.int32).contiguous()
    return attend(q, call.k_cache, call.v_cache, k=call.k, v=call.v, cache_seqlens=seqlens, cache_batch_idx=index,
                  softmax_scale=call.scale, causal=call.causal, window_size=call.window)
