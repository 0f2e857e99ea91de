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

from ssm_pack.checks import check_tensor

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ..common.slots import state_rows
from .dt import process_dt
from .state_update_kernel import selective_state_update_kernel, unsupported

__all__ = ["selective_state_update"]


def _shape(name, t, want):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be {list(want)}, got {list(t.shape)}")


def _with_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Upstream's head-less forms (``state [S, P, Ns]`` ...) as one head."""
    check_tensor("state", state, ndim=(3, 4))
    if state.dim() == 4:
        return state, x, dt, A, B, C, D, z, dt_bias
    one = lambda t, dim: None if t is None else t.unsqueeze(dim)  # noqa: E731
    return (state.unsqueeze(1), one(x, 1), one(dt, 1), one(A, 0), one(B, 1), one(C, 1), one(D, 0), one(z, 1),
            one(dt_bias, 0))


def _check(state, x, dt, A, B, C, D, z, dt_bias, indices, dt_limit):
    _, heads, p, ns = state.shape
    check_tensor("x", x, ndim=3)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    rows = x.shape[0]
    _shape("x", x, (rows, heads, p))
    _shape("dt", dt, (rows, heads, p))
    _shape("A", A, (heads, p, ns))
    check_tensor("B", B, ndim=3)
    groups = B.shape[1]
    if groups == 0 or heads % groups:
        raise ValueError(f"the groups of B (G={groups}) must divide the heads of state (H={heads})")
    _shape("B", B, (rows, groups, ns))
    _shape("C", C, (rows, groups, ns))
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _shape(name, t, (heads, p))
    if z is not None:
        _shape("z", z, (rows, heads, p))
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2 or dt_limit[0] > dt_limit[1]):
        raise ValueError(f"dt_limit must be a (low, high) pair with low <= high, got {dt_limit!r}")
    return state_rows(indices, state, rows, x.device, state_name="state", indices_name="state_batch_indices")


def _reference(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices, dt_limit):
    compute = compute_dtype(x.dtype)
    heads, groups = state.shape[1], B.shape[1]
    h = (state if indices is None else state.index_select(0, indices)).to(compute)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, compute)
    Bh = B.to(compute).repeat_interleave(heads // groups, dim=1).unsqueeze(2)     # [N, H, 1, Ns]
    Ch = C.to(compute).repeat_interleave(heads // groups, dim=1).unsqueeze(2)
    xc = x.to(compute)
    h = h * torch.exp(A.to(compute) * dt.unsqueeze(-1)) + (dt * xc).unsqueeze(-1) * Bh
    out = (h * Ch).sum(-1)
    if D is not None:
        out = out + xc * D.to(compute)
    if z is not None:
        out = out * F.silu(z.to(compute))
    new = h.detach().to(state.dtype)
    if indices is None:
        state.copy_(new)
    else:
        state.index_copy_(0, indices, new)
    return out.to(x.dtype)


@outside_autocast
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, dt_limit=(0.0, math.inf), backend="auto"):
    """One token per row of the SSD recurrence; ``state`` updated in place (see the module docstring).

    Returns ``out`` ``[N, H, P]`` (``[N, P]`` for the head-less form).
    """
    has_heads = isinstance(state, torch.Tensor) and state.dim() == 4
    state4, x, dt, A, B, C, D, z, dt_bias = _with_heads(state, x, dt, A, B, C, D, z, dt_bias)
    try:
        indices = _check(state4, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_limit)
    except ValueError as err:
        if has_heads:
            raise
        raise ValueError(f"{err} (a 3-D state is upstream's head-less form: shapes are shown with its one head)") \
            from None
    missing = unsupported(x, dt_limit, state4, dt, A, B, C, D, z, dt_bias)
    choice = dispatch.select_backend("selective_state_update", backend, on_cuda=dispatch.is_cuda(x),
                                     support_state=lambda: dispatch.cached_support(
                                         "mamba_decode", ("state_batch_indices",) if indices is not None else ()),
                                     missing_feature=missing)
    if choice == "kernel":
        out = selective_state_update_kernel(state4, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices)
    else:
        out = _reference(state4, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices, dt_limit)
    return out if has_heads else out.squeeze(1)
