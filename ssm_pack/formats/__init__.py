"""Packing metadata and its representations: ``PackedSeqParams`` and every form it is built from
or converted to.

* :mod:`.params`: :class:`PackedSeqParams`, the one metadata type;
* :mod:`.boundaries`: lengths, ``cu_seqlens``, position ids and attention masks into one another,
  and padded rows into one packed row and back;
* :mod:`.seq_idx`, :mod:`.segments`: the per-token document index and the segments a kernel keeps apart;
* :mod:`.doc_ids`, :mod:`.nemo`: NeMo AutoModel's neat-packing document map and its API;
* :mod:`.hf_batch`, :mod:`.hf`: Hugging Face ``DataCollatorWithFlattening`` batches;
* :mod:`.megatron_bridge`: Megatron-Bridge's MIMO packing of a padded language shard;
* :mod:`.masks`: ms-swift's segment-aware masks from ``position_ids``.
"""

from .boundaries import (
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
from .megatron_bridge import assemble_packed_sequence, pack_language_shard
from .nemo import packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from .params import PackedSeqParams, build_packed_seq_idx
from .segments import Segments
from .seq_idx import get_cu_seqlens, seq_idx_from_cu_seqlens

__all__ = [
    "PackedSeqParams", "PackingAlignmentWarning", "Segments", "assemble_packed_sequence", "attention_mask_from_lengths",
    "build_packed_seq_idx", "check_block_alignment", "cu_seqlens_from_position_ids", "cu_seqlens_from_seq_idx",
    "cu_seqlens_to_lengths", "dense_segment_keep", "get_cu_seqlens", "hf_batch_from_packed_seq_params", "is_packed",
    "lengths_from_attention_mask", "lengths_to_cu_seqlens", "max_seqlen_from_cu_seqlens", "pack_language_shard",
    "pack_padded", "packed_masks", "packed_seq_params_from_doc_ids", "packed_seq_params_from_hf_batch",
    "position_ids_from_cu_seqlens", "round_up_lengths", "segment_ids", "segment_of", "segment_starts",
    "seq_idx_from_cu_seqlens", "to_flash_attention_kwargs", "unpack_to_padded",
]
