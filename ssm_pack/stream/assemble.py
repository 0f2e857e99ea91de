"""One pack of :func:`ssm_pack.pack_stream` laid out as its ``PackedSeqParams`` describe it.

    T = max_tokens, N = pieces in the pack, R = their real tokens

Each piece sits at the start of a slot of ``ceil(L / align_to) * align_to`` tokens; the slots
are back to back and the rest of the row is a tail (one extra ``seq_idx`` index). The row is one
``torch.cat`` of the pieces and views of a padding row, and every other tensor a few whole-row
operations, whatever N is: the packer must never be what an accelerator waits for. With numpy
installed, the index math (``seq_idx``, positions, label and target edits) runs on numpy views
of the same memory (a numpy call costs a fraction of a small torch op); without it, torch ops
compute the same values.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch

from ..formats.params import PackedSeqParams

try:  # optional: the faster path for small index math
    import numpy as _np
except ImportError:  # pragma: no cover - numpy-less installs
    _np = None

IGNORE_INDEX = -100


def _boundaries(lengths: list[int], align_to: int) -> tuple[list[int], list[int]]:
    """Real and physical (slot) offsets ``[N + 1]`` of pieces of ``lengths``."""
    real = [0, *accumulate(lengths)]
    if align_to == 1:
        return real, real
    return real, [0, *accumulate(-(-n // align_to) * align_to for n in lengths)]


def pack_params(lengths: list[int], *, max_tokens: int, align_to: int) -> PackedSeqParams:
    """``PackedSeqParams`` of pieces of ``lengths`` in aligned slots and a row of ``max_tokens``.

    The offsets are built here from lengths (so they are valid by construction) and ``seq_idx``
    with one ``repeat_interleave``; ``max_seqlen`` counts the tail, as a validating
    :class:`ssm_pack.VarlenBatch` measures it.
    """
    return _params(*_boundaries(lengths, align_to), max_tokens)


def _params(real: list[int], physical: list[int], max_tokens: int) -> PackedSeqParams:
    tail = max_tokens - physical[-1]
    assert tail >= 0, "the planner fills at most max_tokens"
    slots = [b - a for a, b in zip(physical, physical[1:])] + [tail]
    if _np is not None:
        seq_idx = torch.from_numpy(_np.repeat(_np.arange(len(slots), dtype=_np.int32), slots).reshape(1, -1))
    else:
        seq_idx = torch.repeat_interleave(torch.arange(len(slots), dtype=torch.int32), torch.tensor(slots),
                                          output_size=max_tokens).unsqueeze(0)
    cu = torch.tensor(real, dtype=torch.int32)
    padded = torch.tensor(physical, dtype=torch.int32) if physical is not real and physical != real else None
    longest = max(slots)
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
    real, physical = _boundaries(lengths, align_to)
    params = _params(real, physical, max_tokens)
    tail = max_tokens - physical[-1]
    pad, ignore, _ = _rows(max_tokens, pad_token_id)                  # never written: only copied from
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
    last = physical[-2] + lengths[-1] - 1 if next_token is not None else None
    if _np is not None:
        targets, positions = _edit_numpy(labels, physical, offsets, max_tokens, last, next_token)
    else:
        targets, positions = _edit_torch(labels, physical, offsets, params.seq_idx[0], last, next_token)
        targets, positions = targets.unsqueeze(0), positions.unsqueeze(0)
    return {"input_ids": input_ids.unsqueeze(0), "labels": labels.unsqueeze(0), "targets": targets,
            "position_ids": positions, "packed_seq_params": params}


def _edit_torch(labels: torch.Tensor, physical: list[int], offsets: list[int], seq_idx: torch.Tensor,
                last: int | None, next_token: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each piece's first label set to -100 (in place), then ``(targets, positions)`` ``[T]``;
    ``last``: where the last piece's last token sits when it continues (its target is ``next_token``)."""
    _, ignore, arange = _rows(labels.shape[0], 0)
    starts = torch.tensor(physical, dtype=torch.int64)                # slot starts, then the tail's
    if len(physical) > 1:
        labels.index_fill_(0, starts[:-1], IGNORE_INDEX)
    targets = torch.cat([labels[1:], ignore[:1]])     # the next label: -100 after a document's last token
    if last is not None:
        targets[last] = next_token
    positions = arange - starts.index_select(0, seq_idx)
    if any(offsets):
        positions += torch.tensor(list(offsets) + [0], dtype=torch.int64).index_select(0, seq_idx)
    return targets, positions

def _edit_numpy(labels: torch.Tensor, physical: list[int], offsets: list[int], max_tokens: int,
                last: int | None, next_token: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_edit_torch` on numpy views of the same memory: the same values, as ``[1, T]``."""
    lab = labels.numpy()
    lab[physical[:-1]] = IGNORE_INDEX
    targets = _np.empty_like(lab)
    targets[:-1] = lab[1:]
    targets[-1] = IGNORE_INDEX
    if last is not None:
        targets[last] = next_token
    ends = physical[1:] + [max_tokens]
    counts = [b - a for a, b in zip(physical, ends)]
    shift = [a - o for a, o in zip(physical, offsets)] + [physical[-1]]       # position = t - start + offset
    positions = _arange_np(max_tokens) - _np.repeat(_np.asarray(shift, dtype=_np.int64), counts)
    return torch.from_numpy(targets.reshape(1, -1)), torch.from_numpy(positions.reshape(1, -1))


@functools.lru_cache(maxsize=8)
def _arange_np(n: int):
    out = _np.arange(n, dtype=_np.int64)
    out.flags.writeable = False
    return out


def byte_pieces(pieces: list, *, split: bool) -> tuple[list[torch.Tensor], int | None]:
    """Byte-level documents: every piece of a pack converted at once (one join, one copy to int64);
    one tensor holding them back to back unless ``split``. ``pieces``: the planner's pieces (``doc``,
    ``offset``, ``length``, ``continued``)."""
    joined = b"".join(piece.doc if piece.offset == 0 and piece.length == len(piece.doc)
                      else piece.doc[piece.offset:piece.offset + piece.length] for piece in pieces)
    row = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(torch.int64)
    last = pieces[-1]
    next_token = last.doc[last.offset + last.length] if last.continued else None
    return (list(row.split([piece.length for piece in pieces])) if split else [row]), next_token
