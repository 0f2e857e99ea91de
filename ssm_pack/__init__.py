"""ssm-pack: packing metadata and helpers for hybrid SSM / linear-attention models.

Imports torch only; the optional kernels (causal-conv1d, mamba-ssm, fla, flash-attn) are never
imported here. See docs/packing.md and docs/gpu.md.
"""

from .context_parallel import ContextParallelLayout, shard_for_context_parallel
from .convert import (
    attention_mask_from_lengths,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_seq_idx,
    cu_seqlens_to_lengths,
    lengths_from_attention_mask,
    lengths_to_cu_seqlens,
    max_seqlen_from_cu_seqlens,
    pack_padded,
    position_ids_from_cu_seqlens,
    round_up_lengths,
    unpack_to_padded,
)
from .hf import hf_batch_from_packed_seq_params, packed_seq_params_from_hf_batch
from .kernels import (
    check_causal_conv1d_support,
    check_fla_conv_support,
    check_fla_sequence_packing_support,
    check_flash_attn_support,
    check_mamba_sequence_packing_support,
    check_mamba_ssd_support,
)
from .masks import (
    PackingAlignmentWarning,
    check_block_alignment,
    dense_segment_keep,
    is_packed,
    packed_masks,
    segment_ids,
    segment_of,
    segment_starts,
)
from .mimo import assemble_packed_sequence, pack_language_shard
from .neat import packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from .parallel import resolve_cp_group, resolve_tp_cp_group
from .params import PackedSeqParams, build_packed_seq_idx
from .planner import PackPlan, plan_packs
from .segments import Segments
from .seq_idx import get_cu_seqlens, seq_idx_from_cu_seqlens
from .stream import PackStream, pack_stream
from .varlen import VarlenBatch

__version__ = "0.1.0"

__all__ = [
    "ContextParallelLayout", "PackPlan", "PackStream", "PackedSeqParams", "PackingAlignmentWarning", "Segments",
    "VarlenBatch",
    "assemble_packed_sequence",
    "attention_mask_from_lengths", "build_packed_seq_idx", "check_block_alignment",
    "check_causal_conv1d_support", "check_fla_conv_support", "check_fla_sequence_packing_support",
    "check_flash_attn_support", "check_mamba_sequence_packing_support", "check_mamba_ssd_support",
    "cu_seqlens_from_position_ids", "cu_seqlens_from_seq_idx",
    "cu_seqlens_to_lengths", "dense_segment_keep", "get_cu_seqlens", "hf_batch_from_packed_seq_params",
    "is_packed", "lengths_from_attention_mask", "lengths_to_cu_seqlens", "max_seqlen_from_cu_seqlens",
    "pack_language_shard", "pack_padded", "pack_stream", "packed_masks", "packed_seq_params_from_doc_ids",
    "packed_seq_params_from_hf_batch",
    "plan_packs", "position_ids_from_cu_seqlens", "resolve_cp_group", "resolve_tp_cp_group",
    "round_up_lengths", "segment_ids", "segment_of", "segment_starts",
    "seq_idx_from_cu_seqlens", "shard_for_context_parallel", "to_flash_attention_kwargs", "unpack_to_padded",
]
