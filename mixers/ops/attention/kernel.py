"""flash-attn's ``flash_attn_varlen_func``: fp16 / bf16 on CUDA, int32 ``cu_seqlens`` covering every token.

The padding tail after the last document attends among itself, so the call gets
:attr:`ssm_pack.VarlenBatch.covering_cu_seqlens` (a final boundary at T; the extra document is
empty when there is no tail, which flash-attn skips). Nothing is read on the host.
"""

from __future__ import annotations

import torch

from ..device_policy import attention_kernel_limit
from ._validate import AttentionCall

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


MAX_HEAD_DIM = 256      # flash-attn 2 (csrc/flash_attn/flash_api.cpp): head_size <= 256


def unsupported_for(dtype: torch.dtype, head_dim: int, device=None) -> str | None:
    """What flash-attn's varlen kernel cannot take (``None``: it can): fp16 / bf16, head dim <= 256,
    a device of compute capability >= 8.0 (``device`` ``None``: not checked)."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (flash-attn takes fp16 / bf16)"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (flash-attn takes head dims <= {MAX_HEAD_DIM})"
    return None if device is None else attention_kernel_limit(device)


def load_upstream():
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def varlen_call(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, window: tuple[int, int],
                scale: float):
    """``flash_attn_varlen_func``: ``q [Tq, Hq, D]`` over ``k, v [Tk, Hk, D]``; with ``Tq < Tk`` in a
    document the causal mask aligns bottom-right (flash-attn >= 2.1)."""
    return load_upstream()(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                           window_size=window)


def flash_varlen(call: AttentionCall):
    q = call.q
    cu = call.varlen.covering_cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_call(q, call.k, call.v, cu, cu, call.max_seqlen, call.max_seqlen, causal=call.causal,
                       window=call.window, scale=call.scale)
