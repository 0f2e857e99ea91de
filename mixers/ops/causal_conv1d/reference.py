"""Varlen causal depthwise convolution, pure PyTorch.

    B = rows, D = channels, T = tokens per row, N = B * T, W = kernel width, J = W - 1,
    S = segments (documents) over all rows

Only the first J outputs of a segment can reach across its start, so:

1. run one plain depthwise convolution over the whole packed row (fast, channels-last);
2. recompute the first J outputs of every segment from that segment's own window (its J
   initial-state slots, zeros without them, then its first tokens) and *overwrite* them.

Overwriting, not correcting, keeps every output a function of its own document only: a
perturbed neighbour changes none of its bits, and the backward zeroes the overwritten rows
before the plain convolution's gradient, so no gradient crosses either. A segment's final state
is the J inputs before its end, reaching into its initial state when it is shorter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssm_pack.segments import Segments

from ..chunks import compute_dtype
from .depthwise import conv_anticausal, conv_causal, weight_grad


def edge_layout(segs: Segments, state_len: int):
    """Where every segment's first J outputs and their inputs live.

    Returns ``(token_rows [S, J], valid [S, J])``: row of the segment's j-th token (the last
    token repeated past its end, so nothing outside the segment is read) and whether output j
    exists (``j < length``).
    """
    j = torch.arange(state_len, device=segs.starts.device)
    valid = j < segs.lengths.unsqueeze(1)
    rows = segs.starts.unsqueeze(1) + torch.minimum(j, segs.lengths.unsqueeze(1) - 1)
    return rows, valid


def _edge_outputs(tokens, slots, weight, bias):
    """``[S, J, D]`` first J outputs of every segment from its own ``slots`` and ``tokens``.

    Output j reads window rows ``j .. j + J`` of ``[slots ; tokens]`` (``[S, 2J, D]``).
    """
    state_len = tokens.shape[1]
    window = tokens if slots is None else torch.cat([slots, tokens], dim=1)
    shift = state_len if slots is None else 0          # without slots the window starts at the tokens
    out = tokens.new_zeros(tokens.shape) if bias is None else bias.expand_as(tokens).clone()
    taps = weight.t().contiguous()                     # [W, D]: one contiguous row per tap
    for k in range(state_len + 1):
        lo = max(0, shift - k)                         # first output j whose tap k reads an existing row
        if lo < state_len:
            out[:, lo:].addcmul_(window[:, lo + k - shift: state_len + k - shift], taps[k])
    return out


class VarlenConv(torch.autograd.Function):
    """``out [N, D] = act(conv(x_tok))`` with each segment's first J outputs from its own window."""

    @staticmethod
    def forward(ctx, x_tok, weight, bias, slots, rows, valid, pad_rows, silu):
        dim = x_tok.shape[1]
        pre = conv_causal(x_tok, weight, bias)                                   # [N, D]
        tokens = x_tok.index_select(0, rows.reshape(-1)).reshape(*rows.shape, dim)  # [S, J, D]
        edge = _edge_outputs(tokens, slots, weight, bias)
        pre.index_copy_(0, rows[valid], edge[valid])
        need_grad = any(ctx.needs_input_grad[:4])
        out = F.silu(pre, inplace=not need_grad) if silu else pre
        if pad_rows.numel():
            out.index_fill_(0, pad_rows, 0.0)
        ctx.save_for_backward(x_tok, weight, slots, rows, valid, pad_rows, pre if (silu and need_grad) else None,
                              tokens)
        ctx.silu, ctx.has_bias = silu, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x_tok, weight, slots, rows, valid, pad_rows, pre, tokens = ctx.saved_tensors
        dim = x_tok.shape[1]
        state_len = weight.shape[1] - 1
        if ctx.silu:
            sig = torch.sigmoid(pre)
            g_pre = grad * sig * (1 + pre * (1 - sig))
        else:
            g_pre = grad.clone()
        if pad_rows.numel():
            g_pre.index_fill_(0, pad_rows, 0.0)
        g_bias = g_pre.sum(0) if ctx.has_bias else None
        edge_rows = rows[valid]
        g_edge = torch.zeros_like(tokens)
        g_edge[valid] = g_pre.index_select(0, edge_rows)
        g_pre.index_fill_(0, edge_rows, 0.0)     # overwritten outputs: no gradient through the plain conv
        g_x = conv_anticausal(g_pre, weight)                                      # [N, D]
        g_w = weight_grad(g_pre, x_tok, state_len + 1, offset=state_len)
        g_slots = None
        if state_len:
            with torch.enable_grad():      # the small edge computation, differentiated by autograd
                leaves = [t.detach().requires_grad_() for t in (tokens, weight)]
                slot_leaf = None if slots is None else slots.detach().requires_grad_()
                edge = _edge_outputs(leaves[0], slot_leaf, leaves[1], None)
                wanted = leaves + ([slot_leaf] if slot_leaf is not None else [])
                grads = torch.autograd.grad(edge, wanted, g_edge)
            g_x.index_add_(0, rows.reshape(-1), grads[0].reshape(-1, dim))
            g_w += grads[1]
            g_slots = grads[2] if slots is not None else None
        return g_x, g_w, g_bias, g_slots, None, None, None, None


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            segs: Segments, initial_slots: torch.Tensor | None = None,
                            activation: str | None = None, pad_mask: torch.Tensor | None = None):
    """Causal depthwise conv of ``x`` ``[B, D, T]`` that never crosses a segment boundary.

    Args:
        weight: ``[D, W]``; bias: ``[D]`` or ``None``.
        segs: the segments of ``x`` (see :mod:`mixers.ops._segments`).
        initial_slots: ``[S, D, J]`` initial state of every segment (the J inputs before its
            first token, oldest first), or ``None`` for zeros.
        activation: ``None`` or ``"silu"`` / ``"swish"``.
        pad_mask: ``[B, T]`` bool, tokens whose output is zero (negative ``seq_idx``).

    Returns ``out`` ``[B, D, T]`` with channel-last strides (what the CUDA kernel returns for
    channel-last input), in ``x.dtype`` (computed in fp32 for half inputs).
    """
    batch, dim, length = x.shape
    state_len = weight.shape[1] - 1
    compute = compute_dtype(x.dtype)
    x_tok = x.to(compute).transpose(1, 2).reshape(batch * length, dim).contiguous()   # [N, D]
    rows, valid = edge_layout(segs, state_len)
    slots = None
    if initial_slots is not None and state_len:
        slots = initial_slots.to(compute).transpose(1, 2)                        # [S, J, D]
    pad_rows = torch.nonzero(pad_mask.reshape(-1)).reshape(-1) if pad_mask is not None else \
        torch.zeros(0, dtype=torch.long, device=x.device)
    out = VarlenConv.apply(x_tok, weight.to(compute), None if bias is None else bias.to(compute), slots,
                           rows, valid, pad_rows, activation is not None)
    return out.reshape(batch, length, dim).transpose(1, 2).to(x.dtype)


def gather_final_slots(x: torch.Tensor, segs: Segments, state_len: int,
                       initial_slots: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, D, J]`` last J inputs of every segment of ``x`` ``[B, D, T]``.

    Where a segment is shorter than J the slots reach into its initial state (zeros without
    one). Differentiable (gathers only).
    """
    batch, dim, length = x.shape
    x_flat = x.transpose(0, 1).reshape(dim, batch * length)
    offs = torch.arange(state_len, device=x.device)
    pos = segs.ends.unsqueeze(1) - state_len + offs                          # [S, J]
    inside = (pos >= segs.starts.unsqueeze(1)).unsqueeze(0)                  # [1, S, J]
    from_x = x_flat.index_select(1, pos.clamp(min=0).reshape(-1)).reshape(dim, segs.count, state_len)
    if initial_slots is None:
        from_init = torch.zeros_like(from_x)
    else:
        slot = (pos - segs.starts.unsqueeze(1) + state_len).clamp(0, max(state_len - 1, 0))
        from_init = initial_slots.permute(1, 0, 2).gather(2, slot.unsqueeze(0).expand(dim, -1, -1))
    return torch.where(inside, from_x, from_init.to(from_x.dtype)).permute(1, 0, 2)
