"""The torch backend of ``causal_conv1d_fn``: varlen causal depthwise convolution. Its
specification, a direct convolution of each document alone, is :mod:`.naive`.

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

from ssm_pack.formats.segments import Segments

from ..common.chunks import compute_dtype, row_blocks
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


def _window(tokens, slots):
    """``[S, J + J, D]`` rows ``[slots ; tokens]`` and the offset of output 0's first tap in it
    (without slots the window is the tokens alone and starts J rows later)."""
    if slots is None:
        return tokens, tokens.shape[1]
    return torch.cat([slots, tokens], dim=1), 0


def _taps(state_len: int, shift: int):
    """``(k, first output j, window rows)`` of every tap that reads an existing row."""
    for k in range(state_len + 1):
        lo = max(0, shift - k)                         # first output j whose tap k reads an existing row
        if lo < state_len:
            yield k, lo, slice(lo + k - shift, state_len + k - shift)


def _edge_outputs(tokens, slots, weight, bias):
    """``[S, J, D]`` first J outputs of every segment from its own ``slots`` and ``tokens``.

    Output j reads window rows ``j .. j + J`` of ``[slots ; tokens]`` (``[S, 2J, D]``).
    """
    window, shift = _window(tokens, slots)
    out = tokens.new_zeros(tokens.shape) if bias is None else bias.expand_as(tokens).clone()
    taps = weight.t()                                  # [W, D]: one row per tap
    for k, lo, rows in _taps(tokens.shape[1], shift):
        out[:, lo:].addcmul_(window[:, rows], taps[k])
    return out


def _edge_backward(g_edge, tokens, slots, weight):
    """Gradients of :func:`_edge_outputs` (a sum of products) w.r.t. tokens, weight and slots."""
    window, shift = _window(tokens, slots)
    g_window = torch.zeros_like(window)
    g_taps = weight.new_zeros(weight.shape[1], weight.shape[0])                  # [W, D]
    taps = weight.t()
    for k, lo, rows in _taps(tokens.shape[1], shift):
        g_window[:, rows].addcmul_(g_edge[:, lo:], taps[k])
        g_taps[k] = (g_edge[:, lo:] * window[:, rows]).sum((0, 1))
    state_len = tokens.shape[1]
    if slots is None:
        return g_window, g_taps.t(), None
    return g_window[:, state_len:], g_taps.t(), g_window[:, :state_len]


def _pre_activation(x_tok, weight, bias, slots, rows, valid):
    """``([N + 1, D] conv output with every segment's first J rows overwritten (row N: spare),
    [S, J, D] the tokens those rows read)``."""
    n, dim = x_tok.shape
    pre_ext = conv_causal(x_tok, weight, bias, spare=min(1, weight.shape[1] - 1))   # [N + 1, D] (J > 0)
    tokens = x_tok.index_select(0, rows.reshape(-1)).reshape(*rows.shape, dim)  # [S, J, D]
    edge = _edge_outputs(tokens, slots, weight, bias)
    target = torch.where(valid, rows, n).reshape(-1)                          # invalid -> spare row N
    pre_ext.index_copy_(0, target, edge.reshape(-1, dim))
    return pre_ext, tokens


class VarlenConv(torch.autograd.Function):
    """``out [N, D] = act(conv(x_tok))`` with each segment's first J outputs from its own window.

    The first J outputs of every segment are written over the plain convolution's with one
    ``index_copy_``: rows of outputs that do not exist (a segment shorter than J) are sent to
    the spare row N of the convolution's output, so no index depends on the values (no
    data-dependent shape: the function traces under ``torch.compile``).

    Backward keeps only the input (``x_tok`` as given, a strided view included: no copy of it
    is made) and recomputes the pre-activation, one more depthwise convolution, instead of
    keeping a second ``[N, D]`` tensor per convolution. It runs over blocks of rows
    (:func:`mixers.ops.common.chunks.row_blocks`, small enough to stay in cache): each block recomputes its
    pre-activation from its rows and the J before them, takes the gradient at its rows and the J
    after them, and writes its rows of the input gradient, the one ``[N, D]`` tensor it allocates
    (at T = 65,536 a whole-size pre-activation was one more fresh 32-64 MB mapping per
    convolution, faulted in page by page).
    The first J outputs of every segment get their gradient from their recomputed edge outputs.
    """

    @staticmethod
    def forward(ctx, x_tok, weight, bias, slots, rows, valid, pad_mask, silu):
        n = x_tok.shape[0]
        pre_ext, tokens = _pre_activation(x_tok, weight, bias, slots, rows, valid)
        out = pre_ext[:n]
        if silu:
            F.silu(out, inplace=True)
        if pad_mask is not None:
            out = out.masked_fill(pad_mask.unsqueeze(1), 0.0)
        ctx.save_for_backward(x_tok, weight, bias, slots, rows, valid, pad_mask, tokens)
        ctx.silu, ctx.has_bias = silu, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):   # computed like the forward: in x_tok's dtype
            return VarlenConv._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        x_tok, weight, bias, slots, rows, valid, pad_mask, tokens = ctx.saved_tensors
        n, dim = x_tok.shape
        state_len = weight.shape[1] - 1
        # rows whose plain-convolution output reaches no loss: the overwritten first J of every
        # segment (their gradient goes through the edge outputs below) and the padding
        drop = torch.zeros(n + 1, dtype=torch.bool, device=x_tok.device)
        drop.index_fill_(0, torch.where(valid, rows, n).reshape(-1), True)
        drop = drop[:n] if pad_mask is None else drop[:n] | pad_mask
        g_x = torch.empty_like(x_tok, memory_format=torch.contiguous_format)
        g_w = weight.new_zeros(weight.shape)
        g_bias = weight.new_zeros(dim) if ctx.has_bias else None
        for r0, r1 in row_blocks(n, dim):
            g_pre = _plain_grad(x_tok, grad, weight, bias, drop, r0, min(r1 + state_len, n), ctx.silu)
            g_x[r0:r1] = conv_anticausal(g_pre, weight)[: r1 - r0]
            g_pre = g_pre[: r1 - r0]
            a = max(r0 - state_len, 0)                         # x_tok[a:r1]: the rows the block's taps read
            g_w += weight_grad(g_pre, x_tok[a:r1], state_len + 1, offset=state_len - (r0 - a))
            if g_bias is not None:
                g_bias += g_pre.sum(0)
        g_slots = None
        if state_len:
            g_edge = grad.index_select(0, rows.reshape(-1)).reshape(*rows.shape, dim)
            if ctx.silu:                       # the edge outputs' pre-activation recomputed
                g_edge = torch.ops.aten.silu_backward(g_edge, _edge_outputs(tokens, slots, weight, bias))
            keep = valid if pad_mask is None else valid & ~pad_mask[rows]
            g_edge = torch.where(keep.unsqueeze(-1), g_edge, 0.0)
            g_tokens, g_w_edge, g_slots = _edge_backward(g_edge, tokens, slots, weight)
            g_x.index_add_(0, rows.reshape(-1), g_tokens.reshape(-1, dim))
            g_w += g_w_edge
            if g_bias is not None:
                g_bias += g_edge.sum((0, 1))
        return g_x, g_w, g_bias, g_slots, None, None, None, None


def _plain_grad(x_tok, grad, weight, bias, drop, r0, r1, silu):
    """``[r1 - r0, D]``: the gradient at the plain convolution's outputs ``r0 .. r1 - 1``, zero at
    the ``drop`` rows; with SiLU, the pre-activation recomputed from input rows ``r0 - J .. r1 - 1``."""
    if silu:                                   # grad * sig (1 + p (1 - sig)), one fused kernel
        a = max(r0 - (weight.shape[1] - 1), 0)
        pre = conv_causal(x_tok[a:r1], weight, bias)[r0 - a:]
        g_pre = torch.ops.aten.silu_backward.grad_input(grad[r0:r1], pre, grad_input=pre)
    else:
        g_pre = grad[r0:r1].clone()
    return g_pre.masked_fill_(drop[r0:r1].unsqueeze(1), 0.0)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            segs: Segments, initial_slots: torch.Tensor | None = None,
                            activation: str | None = None, pad_mask: torch.Tensor | None = None):
    """Causal depthwise conv of ``x`` ``[B, D, T]`` that never crosses a segment boundary.

    Args:
        weight: ``[D, W]``; bias: ``[D]`` or ``None``.
        segs: the segments of ``x`` (:class:`ssm_pack.Segments`).
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
    x_tok = x.to(compute).transpose(1, 2).reshape(batch * length, dim)     # [N, D] (a view when channel-last)
    rows, valid = edge_layout(segs, state_len)
    slots = None
    if initial_slots is not None and state_len:
        slots = initial_slots.to(compute).transpose(1, 2)                        # [S, J, D]
    out = VarlenConv.apply(x_tok, weight.to(compute), None if bias is None else bias.to(compute), slots,
                           rows, valid, None if pad_mask is None else pad_mask.reshape(-1), activation is not None)
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
