"""Varlen attention, one block of queries at a time, without a ``[T, T]`` mask.

    T = packed tokens, Hq = query heads, Hk = key/value heads (dividing Hq), D = head dim,
    Q = queries per block, S = keys a block can see

For each block of queries, only keys from the earliest document start among its queries (or
the window's left edge) up to its last query (or, without causality, the latest document end)
can be attended, so the work and the ``[Q, S]`` mask shrink with the document lengths. Grouped
heads are folded into the query axis, so keys and values are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256


def varlen_attention_reference(q, k, v, seg, starts, ends, *, causal, window, scale):
    """``q [T, Hq, D]``, ``k, v [T, Hk, D]``; ``seg [T]`` segment ids; ``starts``/``ends`` ``[T]``
    the first / past-the-end token of each token's segment; ``window = (left, right)`` with -1
    for unbounded. Returns ``[T, Hq, D]``."""
    total, hq, d = q.shape
    hk = k.shape[1]
    groups = hq // hk
    left, right = window
    pos = torch.arange(total, device=q.device)
    block_starts = list(range(0, total, BLOCK))
    lows = starts[block_starts].tolist() if total else []
    highs = [int(ends[min(b + BLOCK, total) - 1]) for b in block_starts]
    pieces = []
    for b0, lo, hi in zip(block_starts, lows, highs):
        b1 = min(b0 + BLOCK, total)
        hi = b1 if causal else hi
        if left >= 0:
            lo = max(lo, b0 - left)
        if right >= 0 and not causal:
            hi = min(hi, b1 + right)
        qi, kj = pos[b0:b1, None], pos[None, lo:hi]
        keep = seg[b0:b1, None] == seg[None, lo:hi]
        if causal:
            keep &= kj <= qi
        if left >= 0:
            keep &= kj >= qi - left
        if right >= 0 and not causal:
            keep &= kj <= qi + right
        qb = q[b0:b1].reshape(b1 - b0, hk, groups, d).permute(1, 2, 0, 3).reshape(hk, groups * (b1 - b0), d)
        kb, vb = k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1)                   # [Hk, S, D]
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep.repeat(groups, 1), scale=scale)
        pieces.append(out.reshape(hk, groups, b1 - b0, d).permute(2, 0, 1, 3).reshape(b1 - b0, hq, d))
    return torch.cat(pieces) if pieces else q.clone()
