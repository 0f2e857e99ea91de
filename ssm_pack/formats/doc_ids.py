"""Segment boundaries of a NeMo AutoModel neat-packing map ``doc_ids`` ``[B, S]``.

    B = rows, S = row length, N = segments

Each position holds the 1-based document it belongs to, 0 for padding. A segment is a maximal
run of one value inside a row; every row start is a forced boundary and padding runs are
segments of their own (see :mod:`ssm_pack.formats.nemo`). :func:`doc_ids_fields` gives the fields
:meth:`ssm_pack.PackedSeqParams.from_doc_ids` is built from.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from .boundaries import _cu_seqlens_from_starts, max_seqlen_from_cu_seqlens
from .seq_idx import _np


def doc_ids_fields(doc_ids: torch.Tensor) -> dict:
    """``PackedSeqParams`` fields for ``doc_ids`` ``[B, S]``: int32 ``cu_seqlens_q == cu_seqlens_kv``
    ``[N+1]`` over the flattened batch (last offset ``B * S``), the longest segment,
    ``total_tokens = B * S`` and ``doc_ids`` itself."""
    check_tensor("doc_ids", doc_ids, ndim=2, integer=True)
    rows, cols = doc_ids.shape
    if rows * cols == 0:
        raise ValueError(f"doc_ids must hold at least one token, got shape {tuple(doc_ids.shape)}")
    cu = _cu_seqlens_from_starts(_segment_starts(doc_ids))
    lowest = int(doc_ids.reshape(-1).index_select(0, cu[:-1]).min())  # one value per segment, not every token
    if lowest < 0:
        raise ValueError(f"doc_ids must be >= 0 (1-based documents, 0 = padding), got {lowest}")
    longest = max_seqlen_from_cu_seqlens(cu)
    return dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                total_tokens=rows * cols, doc_ids=doc_ids)


def _segment_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: True where a segment starts (every row start, every change of value)."""
    starts = torch.empty(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts[:, 0] = True
    if doc_ids.device.type == "cpu" and _np is not None:  # numpy's compare into bool is the faster on CPU
        _np.not_equal(doc_ids[:, 1:].numpy(), doc_ids[:, :-1].numpy(), out=starts[:, 1:].numpy())
    else:
        torch.ne(doc_ids[:, 1:], doc_ids[:, :-1], out=starts[:, 1:])
    return starts


__all__ = ["doc_ids_fields"]
