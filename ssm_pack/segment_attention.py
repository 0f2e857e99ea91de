"""Segment-aware attention over chunks of queries, without the dense ``[B, 1, S, S]`` mask.

    B = batch, H = heads, S = tokens, D = head dim, C = query chunk, K = keys a chunk can see

Gives the result of ``scaled_dot_product_attention(q, k, v, attn_mask=dense_segment_keep(p))``
while holding at most a ``[B, 1, C, K]`` mask: each chunk of queries only looks at keys from the
start of its earliest query's segment up to its last query (nothing before a query's segment
start can be attended), so memory is ``O(C * S)`` at worst and the work shrinks with the
segment lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_int, check_tensor
from .segments import segment_ids


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      position_ids: torch.Tensor, *, scale: float | None = None,
                      chunk_size: int = 1024, local_window: int | None = None) -> torch.Tensor:
    """Causal attention restricted to each query's segment, computed chunk by chunk.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, Hk, S, D]`` with ``Hk`` dividing ``H`` (grouped heads).
        position_ids: ``[B, S]`` positions restarting at 0 at every packed sample.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_size: queries per chunk (memory is ``O(chunk_size * S)``).
        local_window: optional inclusive sliding window in tokens.

    Returns:
        ``[B, H, S, D]``, equal to SDPA with ``dense_segment_keep(position_ids)`` (and the window).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    batch, heads, seqlen, _ = q.shape
    if k.shape[0] != batch or k.shape[2] != seqlen or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must be [B, Hk, S, D] matching q {tuple(q.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({k.shape[1]})")
    if position_ids.shape != (batch, seqlen):
        raise ValueError(f"position_ids must be [B, S] = [{batch}, {seqlen}], got {tuple(position_ids.shape)}")
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    check_int("local_window", local_window, minimum=1, allow_none=True)
    groups = heads // k.shape[1]
    seg = segment_ids(position_ids).to(q.device)
    idx = torch.arange(seqlen, device=q.device)
    start = torch.cummax(torch.where(position_ids.to(q.device) == 0, idx, 0), dim=1).values
    chunk_starts = list(range(0, seqlen, chunk_size))
    lows = start[:, chunk_starts].min(0).values.tolist() if seqlen else []
    pieces = []
    for c0, lo in zip(chunk_starts, lows):
        c1 = min(c0 + chunk_size, seqlen)
        if local_window is not None:
            lo = max(lo, c0 - local_window + 1)
        qi, kp = idx[c0:c1], idx[lo:c1]
        keep = (seg[:, None, c0:c1, None] == seg[:, None, None, lo:c1]) & (kp[None, :] <= qi[:, None])
        if local_window is not None:
            keep = keep & (kp[None, :] > qi[:, None] - local_window)
        kc, vc = k[:, :, lo:c1], v[:, :, lo:c1]
        if groups > 1:
            kc, vc = kc.repeat_interleave(groups, dim=1), vc.repeat_interleave(groups, dim=1)
        pieces.append(F.scaled_dot_product_attention(q[:, :, c0:c1], kc, vc, attn_mask=keep, scale=scale))
    return torch.cat(pieces, dim=2) if pieces else q.clone()
