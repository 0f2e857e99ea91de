"""Argument checks shared by the ops (each op's own shapes are checked in its ``_validate``)."""

from __future__ import annotations

import torch

from ssm_pack.checks import check_int
from ssm_pack.varlen import VarlenBatch


def varlen_of(cu_seqlens, batch: int, length: int, device, seq_idx: torch.Tensor | None = None) -> VarlenBatch:
    """An op's ``cu_seqlens`` (offsets, or a prebuilt :class:`ssm_pack.VarlenBatch`) for one packed
    row of ``length`` tokens.

    Offsets are validated where that reads nothing remote (on CPU); a ``VarlenBatch`` was
    validated when it was built and is only checked to describe ``length`` tokens. A ``seq_idx``
    given alongside must describe the same documents.
    """
    if batch != 1:
        raise ValueError(f"cu_seqlens needs one packed row (B == 1), got B={batch}; flatten the batch first")
    varlen = VarlenBatch.build(cu_seqlens, length, device=device)
    if seq_idx is not None and seq_idx.device.type == "cpu" and varlen.device.type == "cpu":
        if not torch.equal(seq_idx.to(torch.int32), varlen.seq_idx):
            raise ValueError("seq_idx and cu_seqlens describe different documents; pass only cu_seqlens")
    return varlen


def check_chunk_size(chunk_size) -> int:
    """The delta-rule chunk length: an int, a power of two, at least 2 (the Gram recursion halves it)."""
    chunk_size = check_int("chunk_size", chunk_size, minimum=2)
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return chunk_size
