"""Varlen attention, one block of queries at a time, without a ``[T, T]`` mask.

    T = packed tokens, Hq = query heads, Hk = key/value heads (dividing Hq), D = head dim,
    Q = queries per block, S = keys a block can see

For each block of queries, only keys from the earliest document start among its queries (or
the window's left edge) up to its last query (or, without causality, the latest document end)
can be attended, so the work and the ``[Q, S]`` mask shrink with the document lengths. Grouped
heads are folded into the query axis, so keys and values are never repeated.

The key range of a block holds other documents' keys, masked out of SDPA; a NaN or inf key or
value would still reach every query of the block (``nan + -inf``, ``0 * nan``). So the inputs
are guarded (:mod:`.._isolation`): non-finite entries are set to 0 before SDPA, and afterwards
each query is set to NaN where its own value is non-finite or where it attends (its mask row) to
a non-finite key or value: one finite ``[Q, S] @ [S, Hk]`` 0/1 matmul of the block's mask with
the bad-key flags, computed only when something is non-finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._isolation import Isolation

BLOCK = 256


def varlen_attention_reference(q, k, v, seg, starts, ends, *, causal, window, scale):
    """``q [T, Hq, D]``, ``k, v [T, Hk, D]``; ``seg [T]`` segment ids; ``starts``/``ends`` ``[T]``
    the first / past-the-end token of each token's segment; ``window = (left, right)`` with -1
    for unbounded. Returns ``[T, Hq, D]``."""
    total, hq, d = q.shape
    hk = k.shape[1]
    groups = hq // hk
    iso = Isolation(seg)
    for t in (q, k, v):
        iso.scan(t, reads=True)
    q_bad = kv_bad = None
    if iso.active:
        q_bad = ~torch.isfinite(q).all(-1)                                          # [T, Hq]
        kv_bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))           # [T, Hk]
        bad = q_bad.clone()
    q, k, v = (iso.clean(t) for t in (q, k, v))
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
        if kv_bad is not None:                       # the queries that attend to a non-finite key or value
            sees = (keep.to(q.dtype) @ kv_bad[lo:hi].to(q.dtype)) > 0                  # [Q, Hk]
            bad[b0:b1] |= sees.repeat_interleave(groups, dim=1)
    out = torch.cat(pieces) if pieces else q.clone()
    return iso.poison_where(out, bad if iso.active else None)
