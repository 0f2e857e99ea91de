"""Segment-aware masks from ``position_ids`` that restart at every packed sample.

    B = rows, S = tokens per row, C = query rows of one chunk, Sk = keys

With packing (ms-swift ``packing_row``, ``padding_free``) samples are concatenated in one row
and ``position_ids`` restart at 0 at every sample. Masks built by comparing those positions
with the flat key index are wrong across samples, so every mask here is built in the *global*
(flat) index space and ANDed with a same-segment constraint. A segment is a run that starts at
a position 0; tokens before the first 0 of a row (left padding) get segment ``-1``.
"""

from __future__ import annotations

import warnings

import torch

from ..checks import check_int, check_tensor


class PackingAlignmentWarning(UserWarning):
    """Packed samples do not start on the block grid a block-sparse kernel cuts keys on."""


def _rows(position_ids: torch.Tensor) -> torch.Tensor:
    check_tensor("position_ids", position_ids, ndim=2, integer=True)
    return position_ids


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """True when some row restarts its positions (a 0 after column 0), i.e. holds several samples."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    return bool((position_ids[:, 1:] == 0).any())


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64: 0-based segment of every token (all zeros for an unpacked row)."""
    return (_rows(position_ids) == 0).to(torch.int64).cumsum(dim=1) - 1


def segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: global start index of every segment of row 0 (a packed row has ``B == 1``)."""
    return torch.nonzero(_rows(position_ids)[0] == 0).reshape(-1)


def segment_of(position_ids: torch.Tensor, token_indices: torch.Tensor) -> torch.Tensor:
    """Segment of arbitrary global token indices ``[B, ...]`` (clamped to the row)."""
    seg = segment_ids(position_ids)
    check_tensor("token_indices", token_indices, integer=True)
    if token_indices.dim() == 0 or token_indices.shape[0] != seg.shape[0]:
        raise ValueError(f"token_indices must be [B, ...] with B={seg.shape[0]}, got shape "
                         f"{tuple(token_indices.shape)}")
    flat = token_indices.reshape(token_indices.shape[0], -1).to(torch.int64)
    out = seg.gather(1, flat.clamp(min=0, max=seg.shape[1] - 1))
    return out.reshape(token_indices.shape)


def packed_masks(position_ids: torch.Tensor, k_positions: torch.Tensor, q_index: torch.Tensor,
                 local_window: int) -> dict[str, torch.Tensor]:
    """Masks for one chunk of queries, ``[B, 1, C, Sk]`` bool, in global key space.

    Args:
        position_ids: ``[B, S]`` reset positions (prefill: ``S`` is the key length).
        k_positions: ``[Sk]`` global key indices (``arange(Sk)``).
        q_index: ``[C]`` global indices of this chunk's queries.
        local_window: inclusive local window in tokens (``>= 1``).

    Returns ``token_future`` (key strictly after the query), ``local_token`` (key within
    ``[q - local_window + 1, q]``), ``same_seg`` (key and query share a segment) and ``gpos``
    ``[B, C]`` (global query positions).
    """
    seg = segment_ids(position_ids)
    local_window = check_int("local_window", local_window, minimum=1)
    check_tensor("k_positions", k_positions, ndim=1, integer=True)
    check_tensor("q_index", q_index, ndim=1, integer=True)
    batch, sk = seg.shape[0], k_positions.shape[0]
    if sk > seg.shape[1]:
        raise ValueError(f"k_positions has {sk} keys but position_ids only {seg.shape[1]} tokens")
    q_index = q_index.to(device=seg.device, dtype=torch.int64)
    seg_q = seg.index_select(1, q_index)
    gpos = q_index.view(1, -1).expand(batch, -1)
    kp = k_positions.to(seg.device).view(1, 1, 1, -1)
    q = gpos[:, None, :, None]
    lo = (gpos - (local_window - 1)).clamp(min=0)[:, None, :, None]
    return {
        "token_future": kp > q,
        "local_token": (kp >= lo) & (kp <= q),
        "same_seg": seg[:, :sk][:, None, None, :] == seg_q[:, None, :, None],
        "gpos": gpos,
    }


_alignment_warned = False          # one warning per process, like the ``warnings`` "once" action


def check_block_alignment(position_ids: torch.Tensor | None, block_size: int) -> int:
    """Warn once (``PackingAlignmentWarning``) when packed samples are off the block grid.

    A block-sparse kernel cuts key blocks on the flat index, so a sample starting at ``s``
    sees a grid shifted by ``s % block_size`` relative to single-sample inference. Nothing
    leaks (the segment masks still hold), but training and inference group keys differently;
    pack with ``align_to=block_size`` (:func:`ssm_pack.plan_packs`) or ms-swift's
    ``PACKING_ALIGN_SIZE`` to align. Returns the number of misaligned samples.
    """
    global _alignment_warned
    block_size = check_int("block_size", block_size, minimum=1)
    if position_ids is None or block_size <= 1:
        return 0
    starts = segment_starts(position_ids)
    bad = int((starts % block_size != 0).sum())
    if bad and not _alignment_warned:
        _alignment_warned = True
        warnings.warn(f"{bad}/{starts.numel()} packed samples do not start on a {block_size}-token block "
                      "boundary, so the block grid is shifted relative to single-sample inference; "
                      f"pack with align_to={block_size} to align", PackingAlignmentWarning, stacklevel=2)
    return bad


def dense_segment_keep(position_ids: torch.Tensor, device=None) -> torch.Tensor:
    """``[B, 1, S, S]`` bool keep-mask: same segment and causal (True = attend).

    Passed straight to ``scaled_dot_product_attention(attn_mask=...)``. It materialises
    ``B * S * S`` bools (1 GiB at ``S = 32k``); :func:`mixers.ops.segment_attention` gives the
    same result without it.
    """
    seg = segment_ids(position_ids)
    if device is not None:
        seg = seg.to(device)
    pos = torch.arange(seg.shape[1], device=seg.device)
    causal = pos[None, :] <= pos[:, None]
    same = seg[:, :, None] == seg[:, None, :]
    return (same & causal[None])[:, None]
