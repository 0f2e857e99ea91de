"""flash-attn's ``flash_attn_varlen_func``: fp16 / bf16 on CUDA, int32 ``cu_seqlens`` covering every token."""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def unsupported(q: torch.Tensor) -> str | None:
    return None if q.dtype in KERNEL_DTYPES else f"dtype {q.dtype} (flash-attn takes fp16 / bf16)"


def load_upstream():
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def flash_varlen(q, k, v, cu_seqlens, max_seqlen, causal, window, scale):
    total = q.shape[0]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    tail = total - int(cu[-1])
    if tail > 0:                                         # the padding tail attends among itself
        cu = torch.cat([cu, cu.new_tensor([total])])
        max_seqlen = max(max_seqlen, tail)
    return load_upstream()(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal,
                           window_size=window)
