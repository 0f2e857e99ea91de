"""NeMo AutoModel "neat packing": a ``[B, S]`` document map to varlen flash-attention metadata.

    B = rows, S = row length

Each position of ``doc_ids`` holds the 1-based document it belongs to, 0 for padding. The
varlen path flattens ``[B, S]`` to ``[B * S]`` without unpadding, so the boundaries cover the
whole flattened batch: a segment is a maximal run of one value inside a row, every row start is
a forced boundary (a document filling one row never merges with the next row's first one), and
padding runs are segments of their own (they attend only among themselves; their labels are
ignored by the loss).
"""

from __future__ import annotations

import torch

from .checks import check_tensor
from .convert import max_seqlen_from_cu_seqlens
from .params import PackedSeqParams
from .seq_idx import get_cu_seqlens


def packed_seq_params_from_doc_ids(doc_ids: torch.Tensor) -> PackedSeqParams:
    """Packed metadata for a neat-packing map ``doc_ids`` ``[B, S]`` (0 = padding).

    Returns a :class:`PackedSeqParams` with int32 ``cu_seqlens_q == cu_seqlens_kv`` over the
    flattened batch (``cu_seqlens[-1] == B * S``), ``max_seqlen_q/kv`` the longest segment,
    ``total_tokens = B * S`` and ``doc_ids`` kept unchanged.

    >>> p = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    >>> p.cu_seqlens_q.tolist()
    [0, 2, 5, 6]
    """
    check_tensor("doc_ids", doc_ids, ndim=2, integer=True)
    rows, cols = doc_ids.shape
    if rows * cols == 0:
        raise ValueError(f"doc_ids must hold at least one token, got shape {tuple(doc_ids.shape)}")
    if int(doc_ids.min()) < 0:
        raise ValueError(f"doc_ids must be >= 0 (1-based documents, 0 = padding), got {int(doc_ids.min())}")
    total = rows * cols
    flat = doc_ids.reshape(-1)
    starts = torch.empty(total, dtype=torch.int32, device=doc_ids.device)
    torch.ne(flat[1:], flat[:-1], out=starts[1:])
    starts[::cols] = 1  # forced boundary at every row start (token 0 included)
    seq_idx = starts.cumsum_(0).sub_(1)  # segment of every token, [T]
    probes = torch.arange(int(seq_idx[-1]) + 2, dtype=torch.int32, device=doc_ids.device)
    cu = torch.searchsorted(seq_idx, probes).to(torch.int32)
    longest = max_seqlen_from_cu_seqlens(cu)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest, total_tokens=total,
                           seq_idx=seq_idx.unsqueeze(0), doc_ids=doc_ids)


def to_flash_attention_kwargs(params: PackedSeqParams) -> dict[str, torch.Tensor | int]:
    """Hugging Face ``FlashAttentionKwargs`` for a packed batch.

    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are the int32 physical boundaries, ``max_length_q`` /
    ``max_length_k`` the longest segment; for self-attention q and k entries are equal.
    """
    if not isinstance(params, PackedSeqParams):
        raise TypeError(f"params must be a PackedSeqParams, got {type(params).__name__}")
    cu_q = get_cu_seqlens(params).to(torch.int32)
    cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    cu_k = cu_q if cu_k is None else cu_k.to(torch.int32)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k,
            "max_length_q": max_seqlen_from_cu_seqlens(cu_q), "max_length_k": max_seqlen_from_cu_seqlens(cu_k)}
