"""ssm-pack: packing metadata and helpers for hybrid SSM / linear-attention models.

Imports torch only; the optional kernels (causal-conv1d, mamba-ssm, fla, flash-attn) are never
imported here. See docs/packing.md and docs/gpu.md.

The rooms: :mod:`.formats` (``PackedSeqParams`` and every representation of packing),
:mod:`.parallel` (context parallelism), :mod:`.varlen` (``VarlenBatch``: one forward's metadata),
:mod:`.stream` (documents into packs), :mod:`.support` (what runs here), :mod:`.testing` (the
packing checks) and :mod:`.checks` (the argument checks every module shares).
"""

from .formats import (
    PackedSeqParams,
    PackingAlignmentWarning,
    Segments,
    assemble_packed_sequence,
    attention_mask_from_lengths,
    build_packed_seq_idx,
    check_block_alignment,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_seq_idx,
    cu_seqlens_to_lengths,
    dense_segment_keep,
    get_cu_seqlens,
    hf_batch_from_packed_seq_params,
    is_packed,
    lengths_from_attention_mask,
    lengths_to_cu_seqlens,
    max_seqlen_from_cu_seqlens,
    pack_language_shard,
    pack_padded,
    packed_masks,
    packed_seq_params_from_doc_ids,
    packed_seq_params_from_hf_batch,
    position_ids_from_cu_seqlens,
    round_up_lengths,
    segment_ids,
    segment_of,
    segment_starts,
    seq_idx_from_cu_seqlens,
    to_flash_attention_kwargs,
    unpack_to_padded,
)
from .parallel import (
    ContextParallelLayout,
    balanced_bounds,
    resolve_cp_group,
    resolve_tp_cp_group,
    shard_for_context_parallel,
)
from .stream import PackPlan, PackStream, pack_stream, plan_packs
from .support import (
    check_causal_conv1d_support,
    check_fla_conv_support,
    check_fla_sequence_packing_support,
    check_flash_attn_support,
    check_mamba_sequence_packing_support,
    check_mamba_ssd_support,
)
from .varlen import VarlenBatch

__version__ = "0.1.0"

__all__ = [
    "ContextParallelLayout", "PackPlan", "PackStream", "PackedSeqParams", "PackingAlignmentWarning", "Segments",
    "VarlenBatch",
    "assemble_packed_sequence", "balanced_bounds",
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
