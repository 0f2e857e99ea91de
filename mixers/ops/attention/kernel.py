"""flash-attn's ``flash_attn_varlen_func``: fp16 / bf16 on CUDA, int32 ``cu_seqlens`` covering every token.

The padding tail after the last document attends among itself, so the call gets
:attr:`ssm_pack.VarlenBatch.covering_cu_seqlens` (a final boundary at T; the extra document is
empty when there is no tail, which flash-attn skips). Nothing is read on the host.
"""

from __future__ import annotations

import torch

from ._validate import AttentionCall

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


MAX_HEAD_DIM = 256      # flash-attn 2 (csrc/flash_attn/flash_api.cpp): head_size <= 256


def unsupported(q: torch.Tensor) -> str | None:
    """What flash-attn's varlen kernel cannot take (``None``: it can): fp16 / bf16, head dim <= 256."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} (flash-attn takes fp16 / bf16)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} (flash-attn takes head dims <= {MAX_HEAD_DIM})"
    return None


def load_upstream():
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def flash_varlen(call: AttentionCall):
    q = call.q
    cu = call.varlen.covering_cu_seqlens.to(device=q.device, dtype=torch.int32)
    return load_upstream()(q, call.k, call.v, cu, cu, call.max_seqlen, call.max_seqlen, softmax_scale=call.scale,
                           causal=call.causal, window_size=call.window)
