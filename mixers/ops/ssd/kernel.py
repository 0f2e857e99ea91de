"""mamba-ssm's Triton SSD scan, called with what it demands.

Upstream contract (``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``):
fp32 / fp16 / bf16 inputs on CUDA; ``seq_idx`` ``[B, T]`` (int32, contiguous) for resets;
``initial_states`` per row ``[B, H, P, Ns]`` only; ``cu_seqlens`` (int32) only together with
``return_varlen_states``, whose backward it does not support.

What its kernels really do with ``seq_idx`` (mamba-ssm 2.3.2.post1, run in the interpreter lane):
they compare values for equality only, and take the value before a row's first token to be 0.
So a row whose ``seq_idx`` does not start at 0 (a leading empty document makes the derived
``seq_idx`` start at 1) silently loses its initial state in the outputs, and a value used again
by a later segment of the same chunk joins the two segments. ssm-pack's semantics are "a
boundary at every change of value", so ``ssd_kernel`` hands upstream the canonical form: per
row, 0 for the first segment and +1 at every change.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def canonical_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int32: per row 0 for the first segment, +1 at every change of value."""
    changed = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return torch.cat([torch.zeros_like(changed[:, :1]), changed.cumsum(1, dtype=torch.int32)], dim=1).contiguous()


def ssd_kernel(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
               dt_softplus, dt_limit, return_final_states, return_varlen_states):
    """Run upstream with canonical int32 contiguous ``seq_idx`` on ``x``'s device (always given, so documents
    reset; a Triton kernel reads every pointer on its own device)."""
    scan = load_upstream()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int32).contiguous()
    return scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                seq_idx=canonical_seq_idx(seq_idx.to(x.device)), cu_seqlens=cu_seqlens,
                dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=return_final_states,
                return_varlen_states=return_varlen_states)
