"""One pack of :func:`ssm_pack.pack_stream` laid out as its ``PackedSeqParams`` describe it.

    T = max_tokens, N = pieces in the pack, R = their real tokens

Each piece sits at the start of a slot of ``ceil(L / align_to) * align_to`` tokens; the slots
are back to back and the rest of the row is a tail (one extra ``seq_idx`` index). The row is one
``torch.cat`` of the pieces and views of a padding row, and every other tensor a few whole-row
operations, whatever N is: the packer must never be what an accelerator waits for.
"""

from __future__ import annotations

import functools

import torch

from .params import PackedSeqParams

IGNORE_INDEX = -100


def _boundaries(lengths: list[int], align_to: int) -> tuple[list[int], list[int]]:
    """Real and physical (slot) offsets ``[N + 1]`` of pieces of ``lengths``."""
    real, physical = [0], [0]
    for n in lengths:
        real.append(real[-1] + n)
        physical.append(physical[-1] + -(-n // align_to) * align_to)
    return real, physical


def pack_params(lengths: list[int], *, max_tokens: int, align_to: int) -> PackedSeqParams:
    """``PackedSeqParams`` of pieces of ``lengths`` in aligned slots and a row of ``max_tokens``.

    The offsets are built here from lengths (so they are valid by construction) and ``seq_idx``
    with one ``repeat_interleave``; ``max_seqlen`` counts the tail, as a validating
    :class:`ssm_pack.VarlenBatch` measures it.
    """
    real, physical = _boundaries(lengths, align_to)
    tail = max_tokens - physical[-1]
    assert tail >= 0, "the planner fills at most max_tokens"
    slots = [b - a for a, b in zip(physical, physical[1:])]
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths) + 1, dtype=torch.int32),
                                      torch.tensor(slots + [tail]), output_size=max_tokens).unsqueeze(0)
    cu = torch.tensor(real, dtype=torch.int32)
    padded = torch.tensor(physical, dtype=torch.int32) if physical != real else None
    longest = max(slots + [tail])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest,
                           total_tokens=max_tokens, seq_idx=seq_idx, pad_between_seqs=padded is not None,
                           validate=False)


@functools.lru_cache(maxsize=8)
def _rows(max_tokens: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read-only rows every pack copies from: padding ids, -100 and positions ``0..T-1``."""
    return (torch.full((max_tokens,), pad_token_id, dtype=torch.int64),
            torch.full((max_tokens,), IGNORE_INDEX, dtype=torch.int64), torch.arange(max_tokens))


def assemble_pack(tokens: list[torch.Tensor], offsets: list[int], *, max_tokens: int, align_to: int,
                  pad_token_id: int, next_token: int | None, lengths: list[int] | None = None) -> dict:
    """The row of one pack.

    Args:
        tokens: the N pieces' token ids, ``[L_i]`` int64 each (non-negative).
        offsets: where each piece starts in its document (0 unless it continues one).
        next_token: the token that follows the last piece in its document when it continues in
            the next pack (its target), else ``None``.
        lengths: the pieces' lengths when ``tokens`` holds them back to back in fewer tensors
            (``align_to == 1`` only: no slot padding goes between them).

    Returns:
        ``input_ids`` ``[1, T]`` (``pad_token_id`` on padding); ``labels`` ``[1, T]`` (the ids,
        ``-100`` on padding and on each piece's first token, the convention of Hugging Face's
        ``DataCollatorWithFlattening``, for models that shift labels themselves, as
        ``mixers.HybridLM`` does); ``targets`` ``[1, T]`` (already shifted: the next token of the
        same document, ``-100`` at document ends and on padding; for a piece that continues, its
        last target is the next piece's first token); ``position_ids`` ``[1, T]`` (positions in
        the document, so a continuing piece starts at its offset; counting on through a slot's
        padding and from 0 over the tail); ``packed_seq_params``.
    """
    if lengths is None:
        lengths = [t.shape[0] for t in tokens]
    assert align_to == 1 or len(lengths) == len(tokens), "joined pieces need align_to == 1"
    params = pack_params(lengths, max_tokens=max_tokens, align_to=align_to)
    _, physical = _boundaries(lengths, align_to)
    tail = max_tokens - physical[-1]
    pad, ignore, arange = _rows(max_tokens, pad_token_id)             # never written: only copied from
    if align_to == 1:                                                 # no slot padding: two cats
        input_ids = torch.cat(tokens + [pad[:tail]])
        labels = torch.cat(tokens + [ignore[:tail]])
    else:
        ids_parts, label_parts = [], []
        for piece, start, end in zip(tokens, physical, physical[1:]):
            gap = end - start - piece.shape[0]
            ids_parts += [piece, pad[:gap]]
            label_parts += [piece, ignore[:gap]]
        input_ids = torch.cat(ids_parts + [pad[:tail]])
        labels = torch.cat(label_parts + [ignore[:tail]])             # ids, -100 on padding
    starts = torch.tensor(physical, dtype=torch.int64)                # slot starts, then the tail's
    if lengths:
        labels.index_fill_(0, starts[:-1], IGNORE_INDEX)
    targets = torch.cat([labels[1:], ignore[:1]])     # the next label: -100 after a document's last token
    if next_token is not None:
        targets[physical[-2] + lengths[-1] - 1] = next_token
    seq_idx = params.seq_idx[0]                                       # int32: index_select takes it
    positions = arange - starts.index_select(0, seq_idx)
    if any(offsets):
        positions += torch.tensor(list(offsets) + [0], dtype=torch.int64).index_select(0, seq_idx)
    return {"input_ids": input_ids.unsqueeze(0), "labels": labels.unsqueeze(0), "targets": targets.unsqueeze(0),
            "position_ids": positions.unsqueeze(0), "packed_seq_params": params}
