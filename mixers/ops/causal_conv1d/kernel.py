"""causal-conv1d's CUDA kernel, called with exactly what it demands.

Upstream contract (``causal_conv1d_fwd``): fp32 / fp16 / bf16; width 2..4; with ``seq_idx``
the input must be channel-last (``x.stride(1) == 1``) with ``D % 8 == 0`` and ``x.stride(0)``,
``x.stride(2)`` multiples of 8; ``seq_idx`` int32, contiguous, ``[B, T]``; no
``return_final_states`` together with ``seq_idx`` (ssm-pack gathers final states itself).
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    """The upstream functions (imported only when a kernel call is really made)."""
    from causal_conv1d import causal_conv1d_fn
    try:
        from causal_conv1d.causal_conv1d_varlen import causal_conv1d_varlen_states
    except ImportError:  # older releases
        causal_conv1d_varlen_states = None
    return causal_conv1d_fn, causal_conv1d_varlen_states


def unsupported_shape(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or ``None``."""
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (it takes float32, float16, bfloat16)"
    width = weight.shape[1]
    if not 2 <= width <= 4:
        return f"kernel width {width} (it takes 2..4)"
    if x.shape[1] % 8:
        return f"{x.shape[1]} channels with seq_idx (it needs a multiple of 8)"
    return None


def channel_last(x: torch.Tensor) -> torch.Tensor:
    """``[B, D, T]`` with ``stride(1) == 1`` (a copy unless it already is)."""
    if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def causal_conv1d_kernel(x, weight, bias, seq_idx, initial_states, activation):
    """Run upstream's ``causal_conv1d_fn`` with ``seq_idx`` resets (no final states)."""
    conv_fn, _ = load_upstream()
    x = channel_last(x)
    seq_idx = seq_idx.to(torch.int32).contiguous()
    if initial_states is not None:
        initial_states = initial_states.transpose(1, 2).contiguous().transpose(1, 2)
    return conv_fn(x, weight.contiguous(), None if bias is None else bias.contiguous(), seq_idx=seq_idx,
                   initial_states=initial_states, activation=activation)


def varlen_states_kernel(x: torch.Tensor, cu_seqlens: torch.Tensor, state_len: int):
    """Upstream's ``causal_conv1d_varlen_states`` (forward only), or ``None`` when absent."""
    _, states_fn = load_upstream()
    if states_fn is None:
        return None
    return states_fn(x[0].transpose(0, 1), cu_seqlens.to(torch.int32).contiguous(), state_len)
