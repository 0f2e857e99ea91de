"""mamba-ssm's Triton SSD scan, called with what it demands.

Upstream contract (``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``):
fp32 / fp16 / bf16 inputs on CUDA; ``seq_idx`` ``[B, T]`` (int32, contiguous) for resets;
``initial_states`` per row ``[B, H, P, N]`` only; ``cu_seqlens`` (int32) only together with
``return_varlen_states``, whose backward it does not support.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def ssd_kernel(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
               dt_softplus, dt_limit, return_final_states, return_varlen_states):
    """Run upstream with int32 contiguous ``seq_idx`` (always given, so documents reset)."""
    scan = load_upstream()
    return scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                seq_idx=seq_idx.to(torch.int32).contiguous(),
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous(),
                dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=return_final_states,
                return_varlen_states=return_varlen_states)
