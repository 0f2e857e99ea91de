"""The boundaries a Hugging Face ``DataCollatorWithFlattening`` batch describes.

    T = packed tokens

Read from ``cu_seq_lens_q/k`` with ``max_length_q/k`` first, then ``seq_idx``, then the
``position_ids`` resets (see :mod:`ssm_pack.formats.hf`); :func:`hf_batch_fields` gives the fields
:meth:`ssm_pack.PackedSeqParams.from_hf_batch` is built from.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checks import check_tensor, describe, is_numpy_array
from .boundaries import (
    as_cu_seqlens,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_seq_idx,
    max_seqlen_from_cu_seqlens,
)
from .consistency import check_boundary_sources

_TOKEN_KEYS = ("input_ids", "position_ids", "labels", "seq_idx", "inputs_embeds")
_ARRAY_KEYS = _TOKEN_KEYS + ("cu_seq_lens_q", "cu_seq_lens_k")


def _as_tensors(batch: Mapping) -> dict:
    """``batch`` with the collator's numpy arrays (``return_tensors="np"``) as tensors."""
    out = dict(batch)
    for key in _ARRAY_KEYS:
        value = out.get(key)
        if is_numpy_array(value):
            if value.dtype.kind not in "iufb":
                raise TypeError(f"batch[{key!r}] must be a numeric array, got a numpy array of dtype {value.dtype}")
            out[key] = torch.as_tensor(value)
    return out


def cu_seqlens_from_position_resets(position_ids: torch.Tensor) -> torch.Tensor:
    """Boundaries of one flattened row from its ``position_ids`` ``[1, T]`` (or ``[T]``).

    A document starts at token 0 and at every **reset**, a token whose position does not
    increase by one over the previous token's, whatever the start value
    (``DataCollatorWithFlattening(position_ids_start=s)`` restarts every example at ``s``).
    Every document must start at the row's first position (the collator's start value, which
    Hugging Face's own flash attention also takes as the start of each sequence); a reset to
    another value (``[2, 3, 4, 0, 1]``, ``[0, 1, 5, 6]``) is ambiguous and raises ``ValueError``.
    MRoPE ``[3, 1, T]`` positions (whose temporal plane repeats values inside a document) use the
    temporal plane's restarts at 0, see :func:`ssm_pack.cu_seqlens_from_position_ids`.
    """
    check_tensor("batch['position_ids']", position_ids, ndim=(1, 2, 3), integer=True)
    if position_ids.dim() == 3:
        first = int(position_ids.reshape(3, -1)[0, 0]) if position_ids.numel() else 0
        if first != 0:
            raise ValueError(f"batch['position_ids'] is MRoPE [3, B, S] starting at {first}: its temporal plane "
                             "repeats positions inside a document, so only restarts at 0 can be found; pass the "
                             "boundaries (DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds "
                             "cu_seq_lens_q)")
        return cu_seqlens_from_position_ids(position_ids)
    flat = position_ids.reshape(-1).to(torch.int64)
    if position_ids.dim() == 2 and position_ids.shape[0] != 1:
        raise ValueError(f"batch['position_ids'] must be one flattened row [1, T], got shape "
                         f"{tuple(position_ids.shape)}; DataCollatorWithFlattening emits batch size 1")
    if flat.numel() == 0:
        raise ValueError("batch['position_ids'] must hold at least one token, got an empty tensor")
    resets = torch.nonzero(flat[1:] != flat[:-1] + 1).reshape(-1) + 1
    start = flat[0]
    wrong = resets[flat[resets] != start]
    if wrong.numel():
        t = int(wrong[0])
        raise ValueError(f"batch['position_ids'] restarts at {int(flat[t])} at token {t} (after "
                         f"{int(flat[t - 1])}) but the row starts at {int(start)}: documents must all start at the "
                         "same position, so the boundaries cannot be told from the positions; pass them "
                         "(DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds cu_seq_lens_q, "
                         "return_seq_idx=True adds seq_idx)")
    end = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=flat.device), resets.to(torch.int32), end])


def _packed_length(batch: Mapping) -> int | None:
    """T of the batch's ``[1, T]`` tensors; every one of them must cover the same T tokens."""
    found: dict[str, int] = {}
    for key in _TOKEN_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            row = value[0] if key == "position_ids" and value.dim() == 3 else value     # MRoPE [3, 1, T]
            if row.shape[0] != 1:
                raise ValueError(f"batch[{key!r}] must be one packed row [1, T], got shape "
                                 f"{tuple(value.shape)}; DataCollatorWithFlattening emits batch size 1")
            found[key] = row.shape[1]
    if len(set(found.values())) > 1:
        raise ValueError(f"the batch's rows cover different numbers of tokens ({found}); every [1, T] field must "
                         "cover the same packed row")
    return next(iter(found.values()), None)


def _check_max(name: str, value, cu: torch.Tensor) -> int:
    longest = max_seqlen_from_cu_seqlens(cu)
    if value is None:
        return longest
    value = int(value)
    if value < longest:
        raise ValueError(f"batch[{name!r}]={value} is smaller than the longest document ({longest})")
    return value


def hf_batch_fields(batch: Mapping) -> dict:
    """``PackedSeqParams`` fields for a collator ``batch``: ``cu_seqlens_q/kv`` ``[N+1]`` int32,
    ``max_seqlen_q/kv`` and ``total_tokens`` (the packed length ``T``)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping (the collator's dict), got {describe(batch)}")
    batch = _as_tensors(batch)
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
        cu_q = cu_k = cu_seqlens_from_position_resets(batch["position_ids"])
        max_q = max_k = _check_max("max_length_q", None, cu_q)
    else:
        raise ValueError("batch has no boundaries: expected 'cu_seq_lens_q', 'seq_idx' or "
                         f"'position_ids', got keys {sorted(batch)}")
    if total is None:
        total = int(cu_q[-1])
    elif int(cu_q[-1]) > total:
        raise ValueError(f"cu_seq_lens_q[-1]={int(cu_q[-1])} is beyond the {total} packed tokens")
    positions = batch.get("position_ids")
    mrope = isinstance(positions, torch.Tensor) and positions.dim() == 3
    if mrope:
        positions = positions[0]                                       # MRoPE: the temporal plane
    source = next(k for k in ("cu_seq_lens_q", "seq_idx", "position_ids") if k in batch)
    seq_idx = batch.get("seq_idx")
    check_boundary_sources(total, cu_q, source=source,
                           position_ids=positions if isinstance(positions, torch.Tensor) else None,
                           seq_idx=seq_idx if isinstance(seq_idx, torch.Tensor) else None, mrope=mrope)
    return dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                total_tokens=total)


__all__ = ["cu_seqlens_from_position_resets", "hf_batch_fields"]
