"""One pack of :func:`ssm_pack.pack_stream` laid out as its ``PackedSeqParams`` describe it.

    T = max_tokens, N = pieces in the pack, R = their real tokens

Each piece sits at the start of a slot of ``ceil(L / align_to) * align_to`` tokens; the slots
are back to back and the rest of the row is a tail (one extra ``seq_idx`` index). Every tensor
is built with a few whole-row operations, whatever N is.
"""

from __future__ import annotations

import torch

from .convert import position_ids_from_cu_seqlens
from .params import PackedSeqParams

IGNORE_INDEX = -100


def assemble_pack(tokens: list[torch.Tensor], offsets: list[int], *, max_tokens: int, align_to: int,
                  pad_token_id: int, next_token: int | None) -> dict:
    """The row of one pack.

    Args:
        tokens: the N pieces' token ids, ``[L_i]`` int64 each.
        offsets: where each piece starts in its document (0 unless it continues one).
        next_token: the token that follows the last piece in its document when it continues in
            the next pack (its target), else ``None``.

    Returns:
        ``input_ids`` ``[1, T]`` (``pad_token_id`` on padding); ``labels`` ``[1, T]`` (the ids,
        ``-100`` on padding and on each piece's first token, the convention of Hugging Face's
        ``DataCollatorWithFlattening``, for models that shift labels themselves);
        ``targets`` ``[1, T]`` (already shifted: the next token of the same document, ``-100``
        at document ends and on padding; for a piece that continues, its last target is the
        next piece's first token); ``position_ids`` ``[1, T]`` (positions in the document, so a
        continuing piece starts at its offset; counting on through a slot's padding and from 0
        over the tail); ``packed_seq_params``.
    """
    lengths = [t.shape[0] for t in tokens]
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=align_to, total_tokens=max_tokens)
    input_ids = torch.full((max_tokens,), pad_token_id, dtype=torch.int64)
    labels = torch.full((max_tokens,), IGNORE_INDEX, dtype=torch.int64)
    targets = torch.full((max_tokens,), IGNORE_INDEX, dtype=torch.int64)
    physical = params.cu_seqlens.to(torch.int64)
    positions = position_ids_from_cu_seqlens(physical, max_tokens)[0]
    if tokens:
        real = torch.cat(tokens)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        if align_to == 1:
            dest = torch.arange(real.shape[0])
        else:
            tight = torch.cumsum(lengths_t, 0) - lengths_t
            shift = torch.repeat_interleave(physical[:-1] - tight, lengths_t)
            dest = torch.arange(real.shape[0]) + shift
        starts, ends = physical[:-1], physical[:-1] + lengths_t - 1
        input_ids[dest] = real
        labels[dest] = real
        labels[starts] = IGNORE_INDEX
        targets[dest[:-1]] = real[1:]
        targets[ends] = IGNORE_INDEX
        if next_token is not None:
            targets[ends[-1]] = next_token
        if any(offsets):
            shift = torch.tensor(list(offsets) + [0], dtype=torch.int64)
            positions = positions + shift[params.seq_idx[0].to(torch.int64)]
    return {"input_ids": input_ids.unsqueeze(0), "labels": labels.unsqueeze(0), "targets": targets.unsqueeze(0),
            "position_ids": positions.unsqueeze(0), "packed_seq_params": params}
