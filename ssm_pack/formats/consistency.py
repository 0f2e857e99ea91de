"""Packing metadata checked against the input it describes: the one check every entry point runs.

    T = tokens of the packed row, N = documents

Each entry point (``HybridLM``, every layer, ``enable_packing``'s patched models, context-parallel
shards) resolves its metadata once per forward through :meth:`ssm_pack.VarlenBatch.build`, which
calls :func:`check_metadata`; Hugging Face style batches that carry several boundary sources
(``cu_seq_lens_q``, ``seq_idx``, ``position_ids``) are checked by :func:`check_boundary_sources`
when their params are built. What is refused, before any layer runs:

* metadata for another number of tokens than the input has (``total_tokens``);
* boundary sources that disagree with each other (``position_ids`` restarting where no document
  starts, ``seq_idx`` naming other documents) or that cover fewer tokens than the input;
* offsets and token counts past int32, the dtype kernels index with (they would wrap).

:func:`check_metadata` reads no tensor value (no host synchronisation); the boundary-source
check reads the values the boundaries are built from anyway.
"""

from __future__ import annotations

import torch

from .seq_idx import seq_idx_from_cu_seqlens

INT32_MAX = (1 << 31) - 1


def check_within_int32(name: str, value: int, what: str = "tokens") -> None:
    """``value`` (a count or an offset, already read) must fit int32: kernels index with it."""
    if value > INT32_MAX:
        raise ValueError(f"{name} reaches {value} {what}, past int32 ({INT32_MAX}), the dtype packed boundaries "
                         "and kernels index with; split the batch into rows of fewer tokens")


def check_metadata(params, total_tokens: int, *, name: str = "the input") -> None:
    """``params`` (any object with Megatron's fields) describes a row of ``total_tokens`` tokens.

    A ``total_tokens`` the params carry must equal the input's (a row with more tokens would run
    its extra tokens as a padding tail, one with fewer would cut documents). Reads no value.
    """
    check_within_int32(f"{name} ({total_tokens} tokens)", total_tokens)
    given = getattr(params, "total_tokens", None)
    if isinstance(given, int) and not isinstance(given, bool) and given != total_tokens:
        raise ValueError(f"packed_seq_params.total_tokens={given} but {name} has {total_tokens} tokens; build the "
                         f"params for this row (e.g. PackedSeqParams.from_lengths(lengths, total_tokens="
                         f"{total_tokens}))")


def check_boundary_sources(total_tokens: int, cu_seqlens: torch.Tensor, *, source: str,
                           position_ids: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                           mrope: bool = False) -> None:
    """Every boundary source of a batch describes the documents of ``cu_seqlens`` over ``total_tokens``.

    Args:
        cu_seqlens: ``[N+1]`` the boundaries in use (validated), read from ``source``.
        position_ids: ``[1, T]`` (``mrope``: the temporal plane of MRoPE): must cover the ``T``
            tokens and hold the row's first position (0, or the collator's ``position_ids_start``)
            at the first token of every non-empty document and, unless ``mrope`` (whose temporal
            plane repeats positions inside a document), nowhere else.
        seq_idx: ``[1, T]`` or ``[T]``: must cover the ``T`` tokens and give each token its document.

    Tokens after ``cu_seqlens[-1]`` (a tail) are one more segment, as the mixers run them: a
    ``seq_idx`` or ``position_ids`` that carries the last document on into the tail describes
    other documents and is refused too.
    """
    cu = cu_seqlens.to(torch.int64)
    if int(cu[-1]) < total_tokens:                                       # the tail: one more segment
        cu = torch.cat([cu, cu.new_tensor([total_tokens])])
    last = int(cu[-1])
    for name, value in (("position_ids", position_ids), ("seq_idx", seq_idx)):
        if value is not None and value.shape[-1] != total_tokens:
            raise ValueError(f"batch['{name}'] covers {value.shape[-1]} tokens but the row has {total_tokens}; "
                             f"give {name} for every token of the row")
    if position_ids is not None and source != "position_ids":
        starts = torch.zeros(last, dtype=torch.bool, device=cu.device)
        nonempty = cu[:-1][cu[1:] > cu[:-1]]
        starts[nonempty] = True
        flat = position_ids.reshape(-1)[:last].to(cu.device)
        zeros = flat == flat[:1] if last else starts
        wrong = (zeros != starts) & (starts | (not mrope))
        if bool(wrong.any()):
            bad = int(torch.nonzero(wrong)[0, 0])
            raise ValueError(f"batch['position_ids'] and batch['{source}'] describe different documents: at token "
                             f"{bad} position_ids is {int(position_ids.reshape(-1)[bad])} but {source} "
                             f"{'starts' if bool(starts[bad]) else 'does not start'} a document there; give "
                             "boundaries and positions from the same collator call")
    if seq_idx is not None and source != "seq_idx":
        want = seq_idx_from_cu_seqlens(cu_seqlens, total_tokens)[0].to(seq_idx.device)
        got = seq_idx.reshape(-1).to(torch.int64)
        covered = got != want.to(torch.int64)
        if bool(covered.any()):
            bad = int(torch.nonzero(covered)[0, 0])
            raise ValueError(f"batch['seq_idx'] and batch['{source}'] describe different documents: token {bad} "
                             f"is in document {int(got[bad])} by seq_idx but {int(want[bad])} by {source}; give "
                             "one boundary source or sources from the same collator call")


__all__ = ["INT32_MAX", "check_boundary_sources", "check_metadata", "check_within_int32"]
