"""``causal_conv1d_update``: decode steps of the short convolution on a pool of per-slot states.

    N = rows of this call, S = rows of the state pool, D = channels, t = new tokens per row,
    W = width, L = state length (>= W - 1; the mixers keep W - 1)

Mirrors causal-conv1d's ``causal_conv1d_update(x, conv_state, weight, bias, activation,
cache_seqlens, conv_state_indices)``: ``x`` ``[N, D]`` or ``[N, D, t]``; ``conv_state`` holds
the last L inputs of each sequence, oldest first, and is updated **in place** (the new tokens
shifted in); ``conv_state_indices`` ``[N]`` names the pool row of each input row (without it,
row i is pool row i). The output of a token reads the last W-1 inputs before it (from the state)
and itself. ``cache_seqlens`` (upstream's circular-buffer mode) is not supported. The stored
state carries no autograd history.

Kernels, in order: causal-conv1d's CUDA ``causal_conv1d_update`` (in place on the pool, by
index), then fla's Triton ``causal_conv1d_update`` (one token per row; the named rows gathered
and written back); ``auto`` takes the reference when neither can run, ``kernel`` raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssm_pack.checks import check_tensor

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ..common.slots import state_rows
from . import update_kernel
from ._validate import ACTIVATIONS

__all__ = ["causal_conv1d_update"]


def _check(x, conv_state, weight, bias, activation, cache_seqlens, indices):
    check_tensor("x", x, ndim=(2, 3))
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    rows, dim = x.shape[:2]
    check_tensor("weight", weight, ndim=2)
    if weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D, W] = [{dim}, W>=1], got {tuple(weight.shape)}")
    if bias is not None and tuple(check_tensor("bias", bias, ndim=1).shape) != (dim,):
        raise ValueError(f"bias must be [D] = [{dim}], got {tuple(bias.shape)}")
    check_tensor("conv_state", conv_state, ndim=3)
    if conv_state.shape[1] != dim or conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"conv_state must be [S, D, L] with D={dim} and L >= W-1 = {weight.shape[1] - 1}, "
                         f"got {tuple(conv_state.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if cache_seqlens is not None:
        raise ValueError("cache_seqlens (causal-conv1d's circular conv_state) is not supported; keep the "
                         "state as the last L inputs (cache_seqlens=None)")
    return state_rows(indices, conv_state, rows, x.device, state_name="conv_state", indices_name="conv_state_indices")


def _reference(x, conv_state, weight, bias, activation, indices):
    """``x [N, D, t]``: the state rows, then the new inputs, convolved; the last L written back."""
    compute = compute_dtype(x.dtype)
    width, state_len, steps = weight.shape[1], conv_state.shape[2], x.shape[2]
    rows = conv_state if indices is None else conv_state.index_select(0, indices)
    full = torch.cat([rows.to(compute), x.to(compute)], dim=2)                 # [N, D, L + t]
    window = full[:, :, full.shape[2] - (width - 1 + steps):]
    out = (window.unfold(2, width, 1) * weight.to(compute).unsqueeze(1)).sum(-1)  # [N, D, t]
    if bias is not None:
        out = out + bias.to(compute).unsqueeze(-1)
    if activation is not None:
        out = F.silu(out)
    new = full[:, :, full.shape[2] - state_len:].detach().to(conv_state.dtype)
    if indices is None:
        conv_state.copy_(new)
    else:
        conv_state.index_copy_(0, indices, new)
    return out.to(x.dtype)


def _choose(x, conv_state, weight, indices, backend, bias=None) -> str:
    features = ("update_indices",)          # the 7-argument call, with or without indices
    candidates = (
        ("causal_conv1d", "causal-conv1d", update_kernel.causal_conv1d_unsupported(x, conv_state, weight, bias),
         lambda: dispatch.cached_support("causal_conv1d", features)),
        ("fla_conv", "fla's Triton conv", update_kernel.fla_unsupported(x, conv_state, weight, bias),
         lambda: dispatch.cached_support("fla_conv", ("update",))),
    )
    return dispatch.choose_kernel("causal_conv1d_update", backend, on_cuda=dispatch.is_cuda(x), candidates=candidates)


@outside_autocast
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, *, backend="auto"):
    """One decode step (or a few tokens) of the short convolution; ``conv_state`` updated in place.

    Args:
        x: ``[N, D]`` (one token per row) or ``[N, D, t]``.
        conv_state: ``[S, D, L]`` pool of states (the last L inputs, oldest first), ``L >= W - 1``.
        weight: ``[D, W]``; bias: ``[D]``; activation: ``None``, ``"silu"`` or ``"swish"``.
        cache_seqlens: must be ``None`` (upstream's circular-buffer mode is not supported).
        conv_state_indices: ``[N]`` int pool row of each input row (``None``: row i).
        backend: ``"auto"``, ``"kernel"`` or ``"reference"``.

    Returns:
        ``[N, D]`` or ``[N, D, t]`` like ``x``.
    """
    indices = _check(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    choice = _choose(x3, conv_state, weight, indices, backend, bias)
    if choice == "causal_conv1d":
        out = update_kernel.causal_conv1d_update_kernel(x3, conv_state, weight, bias, activation, indices)
    elif choice == "fla_conv":
        out = update_kernel.fla_update_kernel(x3, conv_state, weight, bias, activation, indices)
    else:
        out = _reference(x3, conv_state, weight, bias, activation, indices)
    return out.squeeze(-1) if squeeze else out
