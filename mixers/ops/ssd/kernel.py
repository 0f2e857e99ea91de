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

from ._validate import SSDCall

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def canonical_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int32: per row 0 for the first segment, +1 at every change of value."""
    changed = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return torch.cat([torch.zeros_like(changed[:, :1]), changed.cumsum(1, dtype=torch.int32)], dim=1).contiguous()


def unsupported(call: SSDCall) -> str | None:
    """What mamba-ssm's scan cannot do for ``call``, or ``None``."""
    x = call.x
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype}"
    if call.per_doc:
        return "per-document initial states"
    if call.return_varlen_states and call.initial_states is not None:
        return "varlen states together with initial states"
    tensors = (x, call.dt, call.A, call.B, call.C, call.D, call.z, call.dt_bias, call.initial_states)
    if call.return_varlen_states and torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                                      for t in tensors):
        return "a backward pass through varlen states"
    return None


def ssd_kernel(call: SSDCall):
    """Run upstream with canonical int32 contiguous ``seq_idx`` on ``x``'s device (always given, so documents
    reset: upstream resets only at ``seq_idx``; a Triton kernel reads every pointer on its own device)."""
    x, varlen, seq_idx = call.x, call.varlen, call.seq_idx
    if seq_idx is None:
        seq_idx = varlen.seq_idx if varlen is not None else \
            torch.zeros(x.shape[0], x.shape[1], dtype=torch.int32, device=x.device)
    scan = load_upstream()
    cu_seqlens = varlen.cu_seqlens if call.return_varlen_states else None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int32).contiguous()
    return scan(x, call.dt, call.A, call.B, call.C, call.chunk_size, D=call.D, z=call.z, dt_bias=call.dt_bias,
                initial_states=call.initial_states, seq_idx=canonical_seq_idx(seq_idx.to(x.device)),
                cu_seqlens=cu_seqlens, dt_softplus=call.dt_softplus, dt_limit=tuple(call.dt_limit),
                return_final_states=call.return_final_states, return_varlen_states=call.return_varlen_states)
