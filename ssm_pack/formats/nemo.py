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

from ..checks import as_boundaries, check_boundaries, check_int, describe
from ..varlen import VarlenBatch
from .boundaries import max_seqlen_from_cu_seqlens
from .params import PackedSeqParams


def packed_seq_params_from_doc_ids(doc_ids: torch.Tensor) -> PackedSeqParams:
    """Packed metadata for a neat-packing map ``doc_ids`` ``[B, S]`` (0 = padding).

    Returns a :class:`PackedSeqParams` with int32 ``cu_seqlens_q == cu_seqlens_kv`` over the
    flattened batch (``cu_seqlens[-1] == B * S``), ``max_seqlen_q/kv`` the longest segment,
    ``total_tokens = B * S`` and ``doc_ids`` kept unchanged.

    >>> p = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    >>> p.cu_seqlens_q.tolist()
    [0, 2, 5, 6]
    """
    return PackedSeqParams.from_doc_ids(doc_ids)


def _physical_boundaries(params, side: str) -> torch.Tensor | None:
    """The ``side`` (``"q"`` or ``"kv"``) boundaries of the physical layout: the padded ones
    when set; ``None`` when ``params`` has neither."""
    for name in (f"cu_seqlens_{side}_padded", f"cu_seqlens_{side}"):
        value = getattr(params, name, None)
        if value is not None:
            cu = as_boundaries(f"params.{name}", value)
            check_boundaries(f"params.{name}", cu)
            return cu.to(torch.int32)
    return None


def _key_boundaries(params, cu_q: torch.Tensor) -> torch.Tensor:
    """The keys' physical boundaries: ``cu_seqlens_kv_padded`` when set; the queries' layout when
    the key documents are the query documents (or not given); else ``cu_seqlens_kv``."""
    if getattr(params, "cu_seqlens_kv_padded", None) is not None:
        return _physical_boundaries(params, "kv")
    real_q, real_k = getattr(params, "cu_seqlens_q", None), getattr(params, "cu_seqlens_kv", None)
    if real_k is None or real_k is real_q:
        return cu_q
    real_k = as_boundaries("params.cu_seqlens_kv", real_k)
    check_boundaries("params.cu_seqlens_kv", real_k)
    if torch.equal(real_k.to(torch.int64), as_boundaries("params.cu_seqlens_q", real_q).to(torch.int64)):
        return cu_q
    return real_k.to(torch.int32)


def flash_boundaries(params) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cu_q, cu_k, total_tokens)``: int32 physical boundaries covering every token of the row.

    ``params`` is a :class:`~ssm_pack.VarlenBatch` or any object with Megatron-core's
    ``PackedSeqParams`` fields (``cu_seqlens_q``, ``cu_seqlens_q_padded``, ``cu_seqlens_kv``,
    ``cu_seqlens_kv_padded``, ``total_tokens``). A padding tail after the last boundary (when
    ``total_tokens`` says there is one) becomes a document of its own, so a varlen kernel
    computes every token; for self-attention (the key boundaries describe the same documents)
    the key side gets it too.
    """
    if isinstance(params, VarlenBatch):
        cu = params.covering_cu_seqlens if params.total_tokens > int(params.cu_seqlens[-1]) else params.cu_seqlens
        return cu, cu, params.total_tokens
    if not hasattr(params, "cu_seqlens_q"):
        raise TypeError("params must be a PackedSeqParams (or any object with Megatron-core's PackedSeqParams "
                        f"fields: cu_seqlens_q, cu_seqlens_q_padded, ...) or a VarlenBatch, got {describe(params)}")
    if isinstance(params, PackedSeqParams):
        params.check_unmodified()
    cu_q = _physical_boundaries(params, "q")
    if cu_q is None:
        raise ValueError("params.cu_seqlens_q is None; build the params with PackedSeqParams.from_lengths(...) "
                         "or from_cu_seqlens(...)")
    cu_k = _key_boundaries(params, cu_q)
    self_attention = cu_k is cu_q or torch.equal(cu_k, cu_q)
    last = int(cu_q[-1])
    total = getattr(params, "total_tokens", None)
    total = last if total is None else check_int("params.total_tokens", total, minimum=0)
    if total < last:
        raise ValueError(f"params.total_tokens={total} is smaller than the last physical boundary {last}; "
                         "it must count every token of the packed row")
    if total > last:
        cu_q = torch.cat([cu_q, cu_q.new_tensor([total])])   # the padding tail: a document of its own
        cu_k = cu_q if self_attention else cu_k
    return cu_q, cu_k, total


def to_flash_attention_kwargs(params) -> dict[str, torch.Tensor | int]:
    """Hugging Face ``FlashAttentionKwargs`` for a packed batch.

    Args:
        params: a :class:`PackedSeqParams`, any object with Megatron-core's ``PackedSeqParams``
            fields (duck-typed) or a :class:`~ssm_pack.VarlenBatch`.

    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are the int32 boundaries of the **physical** layout
    (``cu_seqlens_*_padded`` when set, so per-document padding stays inside its document's slot),
    with a padding tail after the last boundary as one more document (see
    :func:`flash_boundaries`); ``max_length_q`` / ``max_length_k`` are the longest segments.
    For self-attention q and k entries are equal.
    """
    cu_q, cu_k, _ = flash_boundaries(params)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k,
            "max_length_q": max_seqlen_from_cu_seqlens(cu_q), "max_length_k": max_seqlen_from_cu_seqlens(cu_k)}
