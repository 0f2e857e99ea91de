"""mamba-ssm's Triton ``selective_state_update`` (the Mamba2 decode step), called as it demands.

Upstream contract (``mamba_ssm.ops.triton.selective_state_update``; ``state_batch_indices``
since 2.2.3): fp32 / fp16 / bf16 inputs on a device, the state updated in place in its own
dtype (computed in fp32), ``state_batch_indices`` ``[N]`` int naming pool rows (a negative
index marks a padding row from 2.2.6.post3; ssm-pack never passes one). It reads
``dt_bias.stride(-1)`` and ``D.stride()`` unconditionally (``*(D.stride(0), D.stride(1)) if D is
not None else 0`` unpacks an int), so a missing ``dt_bias`` or ``D`` is passed as zeros. It has no
``dt_limit``: a clamped ``dt`` takes the reference; nor a backward: a call autograd records too.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ._validate import StateUpdateCall, default_limit

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return selective_state_update


def unsupported(call: StateUpdateCall) -> str | None:
    """Why the kernel cannot take ``call`` (its tensors also count for autograd), or ``None``."""
    if call.x.dtype not in KERNEL_DTYPES:
        return f"dtype {call.x.dtype}"
    if not default_limit(call.dt_limit):
        return f"dt_limit={tuple(call.dt_limit)} (mamba-ssm's decode kernel has no clamp)"
    return dispatch.forward_only("mamba-ssm's selective_state_update", call.x, call.state, call.dt, call.A, call.B,
                                 call.C, call.D, call.z, call.dt_bias)


def selective_state_update_kernel(call: StateUpdateCall) -> torch.Tensor:
    update = load_upstream()
    x, dt, D, dt_bias, indices = call.x, call.dt, call.D, call.dt_bias, call.indices
    if dt_bias is None:
        dt_bias = torch.zeros(x.shape[1], x.shape[2], dtype=dt.dtype, device=dt.device)
    if D is None:
        D = torch.zeros(x.shape[1], x.shape[2], dtype=x.dtype, device=x.device)
    if indices is not None:
        indices = indices.to(torch.int32).contiguous()
    pooled = {} if indices is None else {"state_batch_indices": indices}     # a keyword from 2.2.3
    return update(call.state, x, dt, call.A, call.B, call.C, D=D, z=call.z, dt_bias=dt_bias,
                  dt_softplus=call.dt_softplus, **pooled)
