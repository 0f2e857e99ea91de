"""Argument checks shared by the ops (each op's own shapes are checked in its ``_validate``)."""

from __future__ import annotations

import torch

from ssm_pack._checks import check_boundaries, check_int
from ssm_pack.seq_idx import seq_idx_from_cu_seqlens


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int, seq_idx: torch.Tensor | None = None) -> int:
    """Validate varlen boundaries of one packed row of ``length`` tokens; return the document count.

    Values are read only on CPU (on a GPU that would synchronise every call). A ``seq_idx``
    given alongside must describe the same documents.
    """
    on_cpu = cu_seqlens.device.type == "cpu"
    check_boundaries("cu_seqlens", cu_seqlens, values=on_cpu)
    if batch != 1:
        raise ValueError(f"cu_seqlens needs one packed row (B == 1), got B={batch}; flatten the batch first")
    if on_cpu and int(cu_seqlens[-1]) > length:
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} is beyond the {length} tokens of x")
    if seq_idx is not None and seq_idx.device.type == "cpu" and on_cpu:
        if not torch.equal(seq_idx.to(torch.int32), seq_idx_from_cu_seqlens(cu_seqlens, length)):
            raise ValueError("seq_idx and cu_seqlens describe different documents; pass only cu_seqlens")
    return cu_seqlens.numel() - 1


def check_chunk_size(chunk_size) -> int:
    """The delta-rule chunk length: an int, a power of two, at least 2 (the Gram recursion halves it)."""
    chunk_size = check_int("chunk_size", chunk_size, minimum=2)
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return chunk_size
