"""A stand-in for Megatron-core's ``PackedSeqParams``: exactly its fields, none of ssm-pack's
methods (no ``validate``, ``doc_ids``, ``lengths()``, ``cu_seqlens``, ``replace``...), so a
test passing it proves a code path duck-types on Megatron's fields alone."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

MEGATRON_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                   "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group", "tp_cp_group", "total_tokens",
                   "seq_idx", "tokens_per_sample", "pad_between_seqs", "cp_scatter_cache")


@dataclass
class MegatronPackedSeqParams:
    """megatron.core.packed_seq_params.PackedSeqParams, field for field (all default ``None``)."""

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    tp_cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    tokens_per_sample: int | None = None
    pad_between_seqs: bool | None = None
    cp_scatter_cache: Any = None


assert tuple(f.name for f in fields(MegatronPackedSeqParams)) == MEGATRON_FIELDS


def megatron_copy(params, **changes) -> MegatronPackedSeqParams:
    """The Megatron fields of ``params`` (an ssm-pack ``PackedSeqParams``), ``changes`` applied."""
    values = {name: getattr(params, name) for name in MEGATRON_FIELDS}
    values.update(changes)
    return MegatronPackedSeqParams(**values)
