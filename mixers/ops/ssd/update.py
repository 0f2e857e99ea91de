"""``selective_state_update``: one Mamba2 decode step on a pool of per-slot SSM states.

    N = documents of this call (one row, one token each), S = slots (rows of the state pool),
    H = heads, P = head dim, G = groups, Ns = state size

Mirrors mamba-ssm's ``selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
state_batch_indices)`` (with heads; the head-less 3-D forms are taken too): ``state [S, H, P,
Ns]`` updated in place at the rows ``state_batch_indices [N]`` names (row i without it), ``x, dt,
z [N, H, P]``, ``A [H, P, Ns]``, ``B, C [N, G, Ns]``, ``D, dt_bias [H, P]`` (stride-0 expansions of
per-head values are what Mamba2 passes):

    dt = softplus(dt + dt_bias);  h <- exp(A dt) h + dt B x;  out = C.h + D x;  out *= silu(z)

Beyond upstream (keyword-only): ``dt_limit`` clamps ``dt`` as the chunked scan does (the kernel
cannot: ``auto`` then takes the reference). The stored state carries no autograd history. The
reference computes in fp32 for half inputs (the kernel's precision) and in fp64 for fp64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import StateUpdateCall, checked_update
from .dt import process_dt
from .update_kernel import selective_state_update_kernel, unsupported

__all__ = ["selective_state_update"]


def _reference(call: StateUpdateCall) -> torch.Tensor:
    """``out [N, H, P]``; the named states updated in place (detached, in their own dtype)."""
    state, x, B, indices = call.state, call.x, call.B, call.indices
    compute = compute_dtype(x.dtype)
    heads, groups = state.shape[1], B.shape[1]
    h = (state if indices is None else state.index_select(0, indices)).to(compute)
    dt = process_dt(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit, compute)
    Bh = B.to(compute).repeat_interleave(heads // groups, dim=1).unsqueeze(2)     # [N, H, 1, Ns]
    Ch = call.C.to(compute).repeat_interleave(heads // groups, dim=1).unsqueeze(2)
    xc = x.to(compute)
    h = h * torch.exp(call.A.to(compute) * dt.unsqueeze(-1)) + (dt * xc).unsqueeze(-1) * Bh
    out = (h * Ch).sum(-1)
    if call.D is not None:
        out = out + xc * call.D.to(compute)
    if call.z is not None:
        out = out * F.silu(call.z.to(compute))
    new = h.detach().to(state.dtype)
    if indices is None:
        state.copy_(new)
    else:
        state.index_copy_(0, indices, new)
    return out.to(x.dtype)


def _run(call: StateUpdateCall) -> torch.Tensor:
    """mamba-ssm's decode kernel or the reference step (one backend choice)."""
    features = ("state_batch_indices",) if call.indices is not None else ()
    choice = dispatch.select_backend("selective_state_update", call.backend, on_cuda=dispatch.is_cuda(call.x),
                                     support_state=lambda: dispatch.cached_support("mamba_decode", features),
                                     missing_feature=unsupported(call))
    return selective_state_update_kernel(call) if choice == "kernel" else _reference(call)


@outside_autocast
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, dt_limit=(0.0, math.inf), backend="auto"):
    """One token per row of the SSD recurrence; ``state`` updated in place (see the module docstring).

    Returns ``out`` ``[N, H, P]`` (``[N, P]`` for the head-less form).
    """
    has_heads = isinstance(state, torch.Tensor) and state.dim() == 4
    out = _run(checked_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                              state_batch_indices=state_batch_indices, dt_limit=dt_limit, backend=backend))
    return out if has_heads else out.squeeze(1)
