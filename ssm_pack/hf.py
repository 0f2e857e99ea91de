"""Hugging Face ``DataCollatorWithFlattening`` batches <-> :class:`PackedSeqParams`.

    T = packed tokens

The collator concatenates examples into one ``[1, T]`` row and describes the boundaries in up
to three ways: ``position_ids`` restarting at 0 (always), ``cu_seq_lens_q/k`` with
``max_length_q/k`` (``return_flash_attn_kwargs=True``) and a per-token ``seq_idx``
(``return_seq_idx=True``). Explicit boundaries win: ``cu_seq_lens_*`` first, then ``seq_idx``,
then position-id resets (which cannot show an empty document).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .checks import check_tensor, describe
from .convert import (
    as_cu_seqlens,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_seq_idx,
    max_seqlen_from_cu_seqlens,
    position_ids_from_cu_seqlens,
)
from .params import PackedSeqParams
from .seq_idx import get_cu_seqlens, seq_idx_from_cu_seqlens

_TOKEN_KEYS = ("input_ids", "position_ids", "labels", "seq_idx", "inputs_embeds")


def _packed_length(batch: Mapping) -> int | None:
    for key in _TOKEN_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[0] != 1:
                raise ValueError(f"batch[{key!r}] must be one packed row [1, T], got shape "
                                 f"{tuple(value.shape)}; DataCollatorWithFlattening emits batch size 1")
            return value.shape[1]
    return None


def _check_max(name: str, value, cu: torch.Tensor) -> int:
    longest = max_seqlen_from_cu_seqlens(cu)
    if value is None:
        return longest
    value = int(value)
    if value < longest:
        raise ValueError(f"batch[{name!r}]={value} is smaller than the longest document ({longest})")
    return value


def packed_seq_params_from_hf_batch(batch: Mapping) -> PackedSeqParams:
    """:class:`PackedSeqParams` for a ``DataCollatorWithFlattening`` batch.

    Uses ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``max_length_q`` / ``max_length_k`` when
    present, else ``seq_idx`` ``[1, T]``, else the ``position_ids`` resets. ``total_tokens``
    is the packed length ``T``.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping (the collator's dict), got {describe(batch)}")
    total = _packed_length(batch)
    if "cu_seq_lens_q" in batch:
        cu_q = as_cu_seqlens("batch['cu_seq_lens_q']", batch["cu_seq_lens_q"])
        cu_k = as_cu_seqlens("batch['cu_seq_lens_k']", batch.get("cu_seq_lens_k", cu_q))
        max_q = _check_max("max_length_q", batch.get("max_length_q"), cu_q)
        max_k = _check_max("max_length_k", batch.get("max_length_k"), cu_k)
    elif "seq_idx" in batch:
        cu_q = cu_k = cu_seqlens_from_seq_idx(check_tensor("batch['seq_idx']", batch["seq_idx"],
                                                           ndim=(1, 2), integer=True))
        max_q = max_k = _check_max("max_length_q", None, cu_q)
    elif "position_ids" in batch:
        cu_q = cu_k = cu_seqlens_from_position_ids(batch["position_ids"])
        max_q = max_k = _check_max("max_length_q", None, cu_q)
    else:
        raise ValueError("batch has no boundaries: expected 'cu_seq_lens_q', 'seq_idx' or "
                         f"'position_ids', got keys {sorted(batch)}")
    if total is None:
        total = int(cu_q[-1])
    elif int(cu_q[-1]) > total:
        raise ValueError(f"cu_seq_lens_q[-1]={int(cu_q[-1])} is beyond the {total} packed tokens")
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                           max_seqlen_q=max_q, max_seqlen_kv=max_k, total_tokens=total)


def hf_batch_from_packed_seq_params(params: PackedSeqParams) -> dict[str, torch.Tensor | int]:
    """The boundary entries a ``DataCollatorWithFlattening`` batch would carry for ``params``.

    ``position_ids`` ``[1, T]`` (int64), ``seq_idx`` ``[1, T]`` (int32) and the flash
    attention kwargs ``cu_seq_lens_q/k`` (int32), ``max_length_q/k``, all in the physical
    layout.
    """
    if not isinstance(params, PackedSeqParams):
        raise TypeError(f"params must be a PackedSeqParams, got {type(params).__name__}")
    cu = get_cu_seqlens(params).to(torch.int32)
    total = int(cu[-1]) if params.total_tokens is None else params.total_tokens
    if total != int(cu[-1]):
        cu = torch.cat([cu, cu.new_tensor([total])])  # the tail is a document of its own
    longest = max_seqlen_from_cu_seqlens(cu)
    return {"position_ids": position_ids_from_cu_seqlens(cu, total),
            "seq_idx": seq_idx_from_cu_seqlens(cu, total),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
            "max_length_q": longest, "max_length_k": longest}
