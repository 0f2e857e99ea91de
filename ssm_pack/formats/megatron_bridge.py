"""Megatron-Bridge MIMO packing: the real tokens of a padded language shard in one ``[1, T]`` row.

    B = rows of the padded shard, S = padded row length, T = packed tokens

``assemble_packed_sequence`` concatenates the real (unpadded) slice of each row of a group, in
group order, into the Transformer Engine THD layout with int32 ``cu_seqlens`` boundaries;
``pack_language_shard`` packs a whole shard that way and returns the ``PackedSeqParams``
keyword arguments. One gather per tensor: no loop over rows.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import as_index_tensor, check_lengths, describe
from .boundaries import _gather_index, lengths_to_cu_seqlens


def _check_inputs(group, lengths, tensors: dict[str, torch.Tensor | None]):
    position_ids = tensors["position_ids"]
    if position_ids is not None:
        if position_ids.dim() not in (2, 3):
            raise ValueError(f"position_ids must be 2-D [B, S] or 3-D MRoPE [3, B, S], got "
                             f"{position_ids.dim()}-D shape {tuple(position_ids.shape)}")
        if position_ids.dim() == 3 and position_ids.shape[0] != 3:
            raise ValueError(f"3-D position_ids must be MRoPE [3, B, S], got leading dim {position_ids.shape[0]}")
    ref = next((t for t in tensors.values() if isinstance(t, torch.Tensor)), None)
    if ref is None:
        raise ValueError("assemble_packed_sequence needs at least one of tokens / labels / loss_mask / "
                         "position_ids as a tensor (there is no device or shape to pack to)")
    shapes = {k: (tuple(t.shape[1:]) if k == "position_ids" and t.dim() == 3 else tuple(t.shape))
              for k, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"tokens / labels / loss_mask / position_ids must share one [B, S] shape, got {shapes}")
    rows, width = next(iter(shapes.values()))
    group = as_index_tensor("group", group)
    lengths = as_index_tensor("lengths", lengths)
    check_lengths("lengths", lengths)
    if group.numel() and (int(group.min()) < 0 or int(group.max()) >= rows):
        raise ValueError(f"group indices must be rows in [0, {rows}), got {group.tolist()}")
    if group.numel() and int(group.max()) >= lengths.numel():
        raise ValueError(f"lengths has {lengths.numel()} entries but group refers to row {int(group.max())}")
    seglens = lengths[group] if group.numel() else lengths[:0]
    if seglens.numel() and int(seglens.max()) > width:
        raise ValueError(f"a length exceeds the padded row length {width}: {seglens.tolist()}")
    return ref.device, group.to(ref.device), seglens.to(ref.device), width


def assemble_packed_sequence(group, tokens: torch.Tensor | None, lengths, *,
                             labels: torch.Tensor | None = None,
                             loss_mask: torch.Tensor | None = None,
                             position_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """Concatenate one group's real tokens into a single packed sequence (THD layout).

    Args:
        group: row indices of the examples in this pack, in pack order.
        tokens: padded ``[B, S]`` token ids, or ``None`` on a pipeline stage that only packs
            labels / loss mask (``input_ids`` is then ``None`` in the result).
        lengths: real length per row (indexed by row, not by group position).
        labels: padded ``[B, S]`` labels; loss_mask: padded ``[B, S]`` loss mask.
        position_ids: ``[B, S]`` or MRoPE ``[3, B, S]``; each row's real slice is concatenated,
            so packed positions restart at every example.

    Returns:
        ``input_ids`` / ``labels`` / ``loss_mask`` as ``[1, T]`` (``None`` where not given),
        ``position_ids`` as ``[1, T]`` or ``[3, 1, T]``, int32 ``cu_seqlens`` of length
        ``len(group) + 1`` and ``max_seqlen`` (int).

    Raises:
        ValueError: position ids neither ``[B, S]`` nor ``[3, B, S]``; none of the four inputs
            is a tensor; the group's lengths sum to zero (an empty pack cannot be built).
    """
    tensors = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    device, group, seglens, width = _check_inputs(group, lengths, tensors)
    cu_seqlens = lengths_to_cu_seqlens(seglens).to(device)
    total = int(cu_seqlens[-1])
    if total <= 0:
        raise ValueError(f"the group's lengths sum to zero ({seglens.tolist()}); an empty packed "
                         "sequence cannot be built")
    index = _gather_index(seglens, width, rows=group)

    def take(src: torch.Tensor | None) -> torch.Tensor | None:
        if src is None:
            return None
        if src.dim() == 3:  # MRoPE [3, B, S] -> [3, 1, T]
            return src.reshape(3, -1).index_select(1, index).unsqueeze(1)
        return src.reshape(-1).index_select(0, index).unsqueeze(0)

    return {"input_ids": take(tokens), "labels": take(labels), "loss_mask": take(loss_mask),
            "position_ids": take(position_ids), "cu_seqlens": cu_seqlens,
            "max_seqlen": int(seglens.max()) if seglens.numel() else 0}


def pack_language_shard(data_batch: dict[str, Any], *, lengths=None):
    """Pack a per-data-parallel-shard language batch ``[B, S]`` into one packed row ``[1, T]``.

    ``lengths`` (``[B]``, the caller derives them from the attention mask) is the only length
    source; ``loss_mask`` is a supervision mask and never used for length. ``lengths=None``
    returns ``(data_batch, None)`` unchanged. Otherwise returns ``(packed_batch,
    packing_kwargs)``: ``input_ids`` / ``labels`` / ``loss_mask`` / ``position_ids`` replaced
    by their packed form, ``attention_mask`` set to ``None`` (block-diagonal attention comes
    from the boundaries), every other entry (modality inputs, ...) carried through unchanged;
    ``packing_kwargs`` feeds ``PackedSeqParams(qkv_format="thd", **packing_kwargs)``.

    Raises:
        ValueError: ``lengths`` is not ``[B]`` for the batch's ``B``.
    """
    if not isinstance(data_batch, dict):
        raise TypeError(f"data_batch must be a dict, got {describe(data_batch)}")
    if lengths is None:
        return data_batch, None
    input_ids = data_batch.get("input_ids")
    input_ids = input_ids if isinstance(input_ids, torch.Tensor) else None
    position_ids = data_batch.get("position_ids")
    lengths_t = torch.as_tensor(lengths)
    if lengths_t.is_floating_point():
        raise TypeError(f"lengths must be integers, got dtype {lengths_t.dtype}")
    ref = next((t for t in (input_ids, data_batch.get("labels"), data_batch.get("loss_mask"))
                if isinstance(t, torch.Tensor)), None)
    if ref is not None:
        rows = ref.shape[0]
    elif isinstance(position_ids, torch.Tensor) and position_ids.dim() in (2, 3):
        rows = position_ids.shape[1 if position_ids.dim() == 3 else 0]
    else:
        rows = lengths_t.numel()
    if lengths_t.dim() != 1 or lengths_t.shape[0] != rows:
        raise ValueError(f"lengths must be [B] = [{rows}] for this batch, got shape {tuple(lengths_t.shape)}; "
                         "refusing to build a mis-shaped packed sequence")
    pack = assemble_packed_sequence(list(range(rows)), input_ids, lengths_t.to(torch.int64).tolist(),
                                    labels=data_batch.get("labels"), loss_mask=data_batch.get("loss_mask"),
                                    position_ids=position_ids)
    packed = dict(data_batch)
    if input_ids is not None:
        packed["input_ids"] = pack["input_ids"]
    for key in ("labels", "loss_mask", "position_ids"):
        packed[key] = pack[key]
    packed["attention_mask"] = None
    cu, longest = pack["cu_seqlens"], pack["max_seqlen"]
    # The pack is tight (no padding between examples), so the padded boundaries equal the real
    # ones; they are still given because context-parallel partitioning reads them.
    kwargs = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "cu_seqlens_q_padded": cu,
              "cu_seqlens_kv_padded": cu, "max_seqlen_q": longest, "max_seqlen_kv": longest}
    return packed, kwargs
