"""causal-conv1d's CUDA kernel, called with exactly what it demands.

Upstream contract (``causal_conv1d_fwd``): fp32 / fp16 / bf16; width 2..4; with ``seq_idx``
the input must be channel-last (``x.stride(1) == 1``) with ``D % 8 == 0`` and ``x.stride(0)``,
``x.stride(2)`` multiples of 8; ``seq_idx`` int32, contiguous, ``[B, T]`` on ``x``'s device; no
``return_final_states`` together with ``seq_idx`` (ssm-pack gathers final states itself);
``initial_states`` ``[B, D, W-1]`` of ``x``'s dtype with ``stride(1) == 1`` (csrc/causal_conv1d.cpp
checks ``initial_states.scalar_type() == input_type``); ``bias`` of ``weight``'s dtype.

The kernel (csrc/causal_conv1d_fwd.cu) compares ``seq_idx`` by value inside the window: a value
used again by a later segment would join the two (a value that skips, as after an empty document,
is harmless). ssm-pack's semantics are "a boundary at every change of value,
negative = padding", so the kernel gets the normal form (:func:`normal_seq_idx`).

Padding: the forward zeroes the outputs of negative ``seq_idx`` tokens, but the backward
(csrc/causal_conv1d_bwd.cu, causal-conv1d 1.6.1, the ``kHasSeqIdx`` path) only compares values:
the cotangent at padding flows into ``dx`` at padding, ``dweight`` and ``dbias``. So the kernel
never sees a negative ``seq_idx``: in the normal form every padding run is a segment of its own,
and :func:`causal_conv1d_kernel` zeroes the padding outputs after the call (``masked_fill``, whose
backward hands the kernel a zero cotangent there), which gives the reference's gradients.
"""

from __future__ import annotations

import torch

from ssm_pack.formats.seq_idx import renumber_seq_idx

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


def reads_channel_last(x: torch.Tensor) -> bool:
    """Whether the kernel reads ``x [B, D, T]`` (or ``initial_states [B, D, W-1]``) as it is: channel-last as
    csrc/causal_conv1d.cpp defines it (``stride(1) == 1`` and ``stride(2) > 1``, so not broadcast over
    tokens), ``stride(0)`` and ``stride(2)`` multiples of 8 (its TORCH_CHECKs), and the data pointer on a
    16-byte boundary: the channel-last kernels move whole 16-byte vectors of channels and nothing checks
    the pointer (a channel slice starting mid-vector faults on a misaligned address)."""
    return (x.stride(1) == 1 and x.stride(2) > 1 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
            and x.data_ptr() % 16 == 0)


def channel_last(x: torch.Tensor) -> torch.Tensor:
    """``x [B, D, T]`` as the kernel reads it: ``x`` itself when :func:`reads_channel_last`, else a dense
    channel-last copy (differentiable; its gradient flows back to the view)."""
    if reads_channel_last(x):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def normal_seq_idx(seq_idx: torch.Tensor, device) -> torch.Tensor:
    """``[B, T]`` int32 contiguous on ``device``: per row 0 for the first segment, +1 at every change
    of value, a padding (negative) run included: it is a segment of its own, never negative. Torch
    ops only (no value is read on the host)."""
    return renumber_seq_idx(seq_idx.to(device=device))


def causal_conv1d_kernel(x, weight, bias, seq_idx, initial_states, activation, *, pad_mask=None, normal=False):
    """Run upstream's ``causal_conv1d_fn`` with ``seq_idx`` resets (no final states); ``initial_states``
    ``[B, D, W-1]`` are handed over in ``x``'s dtype (the op returns ``x``'s dtype either way).

    ``normal``: ``seq_idx`` is already in the normal form, int32 and contiguous (a
    :class:`ssm_pack.VarlenBatch`'s ``renumbered_seq_idx``, built once per forward); ``pad_mask`` ``[B, T]`` bool: the
    padding outputs, zeroed after the call (see the module docstring)."""
    conv_fn, _ = load_upstream()
    x = channel_last(x)
    seq_idx = seq_idx if normal else normal_seq_idx(seq_idx, x.device)
    if initial_states is not None:
        initial_states = channel_last(initial_states.to(x.dtype))
    weight = weight.contiguous()
    bias = None if bias is None else bias.to(weight.dtype).contiguous()
    out = conv_fn(x, weight, bias, seq_idx=seq_idx, initial_states=initial_states, activation=activation)
    return out if pad_mask is None else out.masked_fill(pad_mask.unsqueeze(1), 0.0)


def varlen_states_kernel(x: torch.Tensor, cu_seqlens: torch.Tensor, state_len: int):
    """Upstream's ``causal_conv1d_varlen_states`` (forward only), or ``None`` when absent."""
    _, states_fn = load_upstream()
    if states_fn is None:
        return None
    return states_fn(x[0].transpose(0, 1), cu_seqlens.to(torch.int32).contiguous(), state_len)
