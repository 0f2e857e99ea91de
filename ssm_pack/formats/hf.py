"""Hugging Face ``DataCollatorWithFlattening`` batches <-> :class:`PackedSeqParams`.

    T = packed tokens

The collator concatenates examples into one ``[1, T]`` row and describes the boundaries in up
to three ways: ``position_ids`` restarting at ``position_ids_start`` (0 by default) at every
example (always), ``cu_seq_lens_q/k`` with ``max_length_q/k`` (``return_flash_attn_kwargs=True``)
and a per-token ``seq_idx`` (``return_seq_idx=True``). Explicit boundaries win: ``cu_seq_lens_*``
first, then ``seq_idx``, then position-id resets (which cannot show an empty document). The
collator's ``return_tensors="np"`` arrays are taken as tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .boundaries import position_ids_from_cu_seqlens
from .hf_batch import cu_seqlens_from_position_resets
from .nemo import flash_boundaries, to_flash_attention_kwargs
from .params import PackedSeqParams
from .seq_idx import seq_idx_from_cu_seqlens


def packed_seq_params_from_hf_batch(batch: Mapping) -> PackedSeqParams:
    """:class:`PackedSeqParams` for a ``DataCollatorWithFlattening`` batch.

    Uses ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``max_length_q`` / ``max_length_k`` when
    present, else ``seq_idx`` ``[1, T]``, else the ``position_ids`` resets (whatever the
    collator's ``position_ids_start``, see :func:`cu_seqlens_from_position_resets`).
    ``total_tokens`` is the packed length ``T``.
    """
    return PackedSeqParams.from_hf_batch(batch)


def hf_batch_from_packed_seq_params(params) -> dict[str, torch.Tensor | int]:
    """The boundary entries a ``DataCollatorWithFlattening`` batch would carry for ``params``.

    Args:
        params: a :class:`PackedSeqParams`, any object with Megatron-core's ``PackedSeqParams``
            fields (duck-typed) or a :class:`~ssm_pack.VarlenBatch`.

    Returns ``position_ids`` ``[1, T]`` (int64, restarting at 0), ``seq_idx`` ``[1, T]``
    (int32) and the flash attention kwargs ``cu_seq_lens_q/k`` (int32), ``max_length_q/k`` of
    :func:`~ssm_pack.to_flash_attention_kwargs`, all in the physical layout, a padding tail
    being one more document.
    """
    cu, _, total = flash_boundaries(params)
    return {"position_ids": position_ids_from_cu_seqlens(cu, total),
            "seq_idx": seq_idx_from_cu_seqlens(cu, total), **to_flash_attention_kwargs(params)}


__all__ = ["cu_seqlens_from_position_resets", "hf_batch_from_packed_seq_params", "packed_seq_params_from_hf_batch"]
