"""``segment_attention``: causal attention inside the segments that ``position_ids`` resets mark.

    B = rows, H / Hk = query / key-value heads, S = tokens per row, D = head dim

The segments come from the positions (ms-swift's packing: a segment starts at every position 0);
the work is the blockwise core of :mod:`.reference` (the torch backend of
:func:`mixers.ops.varlen_attention`), so no ``[B, 1, S, S]`` mask is ever held.
"""

from __future__ import annotations

import torch

from ssm_pack.checks import check_int, check_tensor

from .reference import BLOCK, blockwise_attention

__all__ = ["segment_attention"]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      position_ids: torch.Tensor, *, scale: float | None = None,
                      chunk_size: int = BLOCK, local_window: int | None = None) -> torch.Tensor:
    """Causal attention restricted to each query's segment (position-id resets), blockwise.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, Hk, S, D]`` with ``Hk`` dividing ``H`` (grouped heads).
        position_ids: ``[B, S]`` positions restarting at 0 at every packed sample (tokens before a
            row's first 0 form a segment of their own).
        scale: softmax scale, default ``D ** -0.5``.
        chunk_size: queries per block.
        local_window: optional inclusive sliding window in tokens.

    Returns:
        ``[B, H, S, D]``, equal to SDPA with ``dense_segment_keep(position_ids)`` (and the window),
        without ever holding a ``[B, 1, S, S]`` mask.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    batch, heads, seqlen, _ = q.shape
    if k.shape[0] != batch or k.shape[2] != seqlen or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must be [B, Hk, S, D] matching q {tuple(q.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({k.shape[1]})")
    check_tensor("position_ids", position_ids, integer=True)
    if tuple(position_ids.shape) != (batch, seqlen):
        raise ValueError(f"position_ids must be [B, S] = [{batch}, {seqlen}], got {tuple(position_ids.shape)}")
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    check_int("local_window", local_window, minimum=1, allow_none=True)
    if batch * seqlen == 0:
        return q.clone()
    starts = position_ids.to(q.device) == 0
    starts[:, 0] = True                                        # every row starts a segment
    seg = torch.cumsum(starts.reshape(-1), 0) - 1
    span = int(torch.bincount(seg).max())
    flat = [t.permute(0, 2, 1, 3).reshape(batch * seqlen, t.shape[1], t.shape[3]) for t in (q, k, v)]
    window = (-1, -1) if local_window is None else (local_window - 1, -1)
    out = blockwise_attention(*flat, seg, span, causal=True, window=window, scale=scale, block=chunk_size)
    return out.reshape(batch, seqlen, heads, -1).permute(0, 2, 1, 3)
