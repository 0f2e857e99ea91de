"""The two upstream decode kernels of the short convolution, called with what each demands.

causal-conv1d's ``causal_conv1d_update`` (CUDA C++; ``conv_state_indices`` since 1.5.0):
``x [N, D, t]`` fp32 / fp16 / bf16, ``conv_state [S, D, L]`` of ``x``'s dtype with
``L >= W - 1`` (the last L inputs, oldest first; the kernel shifts them and appends ``x``),
``weight [D, W]`` with ``2 <= W <= 4``, ``bias`` contiguous, ``conv_state_indices [N]`` int32
with stride 1 naming the rows of the pool it reads and writes in place.

flash-linear-attention's Triton ``causal_conv1d_update`` (0.6.0): one token per sequence
(``x [N, D]``), a contiguous ``cache [N, D, W]`` (fla's state: the last W inputs, the oldest
unread), updated in place, no indices. Neither has a backward: a call autograd records takes the reference.
ssm-pack gathers the named rows into that layout (a zero
column in front of our ``[.., W-1]`` state), and writes the last W-1 columns back.
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed

from .. import dispatch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_causal_conv1d():
    from causal_conv1d import causal_conv1d_update
    return causal_conv1d_update


def load_fla():
    installed.pin_fla_triton()
    from fla.modules.causal_conv1d import causal_conv1d_update
    return causal_conv1d_update


def causal_conv1d_unsupported(x, conv_state, weight, *inputs) -> str | None:
    """Why causal-conv1d's update cannot take these inputs (``inputs``: bias, for autograd), or ``None``."""
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (it takes float32, float16, bfloat16)"
    if conv_state.dtype != x.dtype:
        return f"a {conv_state.dtype} conv_state with {x.dtype} inputs (it needs one dtype)"
    if not 2 <= weight.shape[1] <= 4:
        return f"kernel width {weight.shape[1]} (it takes 2..4)"
    return dispatch.forward_only("causal-conv1d's causal_conv1d_update", x, conv_state, weight, *inputs)


def fla_unsupported(x, conv_state, weight, *inputs) -> str | None:
    """Why fla's update cannot take these inputs (``inputs``: bias, for autograd), or ``None``."""
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (fla's Triton conv takes float32, float16, bfloat16)"
    if x.shape[-1] != 1:
        return f"{x.shape[-1]} tokens per row (fla's update takes one)"
    if conv_state.shape[-1] != weight.shape[1] - 1:
        return f"a state of {conv_state.shape[-1]} inputs for width {weight.shape[1]} (it keeps W-1)"
    return dispatch.forward_only("fla's causal_conv1d_update", x, conv_state, weight, *inputs)


def causal_conv1d_update_kernel(x, conv_state, weight, bias, activation, indices):
    """causal-conv1d in place on the pool: ``x [N, D, t]`` -> ``[N, D, t]``."""
    update = load_causal_conv1d()
    if indices is not None:
        indices = indices.to(torch.int32).contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.to(weight.dtype).contiguous()     # csrc: bias dtype == weight dtype
    return update(x, conv_state, weight, bias, activation, None, indices)


def fla_update_kernel(x, conv_state, weight, bias, activation, indices):
    """fla's update on the gathered rows, written back: ``x [N, D, 1]`` -> ``[N, D, 1]``."""
    update = load_fla()
    rows = conv_state if indices is None else conv_state.index_select(0, indices)
    cache = torch.cat([rows.new_zeros(*rows.shape[:2], 1), rows], dim=2).contiguous()
    out, cache = update(x[..., 0], cache, weight=weight.contiguous(),
                        bias=None if bias is None else bias.contiguous(), activation=activation)
    new = cache[..., 1:].to(conv_state.dtype)
    if indices is None:
        conv_state.copy_(new)
    else:
        conv_state.index_copy_(0, indices, new)
    return out.unsqueeze(-1)
