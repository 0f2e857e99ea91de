"""Per-document work on short token runs, batched by length.

    K = runs, n = tokens of one run (1 <= n <= chunk)

Per-document initial and final states touch, for every document, only the run of its tokens
inside one chunk. Those runs have very different lengths, so they are grouped into buckets of
similar length (the next power of two) and each bucket is one padded batched op: no loop over
documents, at most ``log2(chunk) + 1`` buckets, and at most 2x padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    """Runs of one length class.

    Attributes:
        ids: ``[k]`` which runs (indices into the caller's run list).
        index: ``[k, n]`` token positions; padding repeats the run's last token.
        valid: ``[k, n]`` True on real tokens.
    """

    ids: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


def buckets(starts: torch.Tensor, counts: torch.Tensor) -> Iterator[Bucket]:
    """Buckets of the runs ``[starts[i], starts[i] + counts[i])`` with ``counts >= 1``.

    Runs with ``counts == 0`` are skipped.
    """
    if starts.numel() == 0:
        return
    width = torch.zeros_like(counts)
    nonzero = counts > 0
    width[nonzero] = 2 ** torch.ceil(torch.log2(counts[nonzero].to(torch.float64))).to(counts.dtype)
    for size in torch.unique(width[nonzero]).tolist():
        ids = torch.nonzero(width == size).reshape(-1)
        offs = torch.arange(size, device=starts.device)
        n = counts[ids].unsqueeze(1)
        valid = offs < n
        index = starts[ids].unsqueeze(1) + torch.minimum(offs, n - 1)
        yield Bucket(ids=ids, index=index, valid=valid)


def initial_states_leaving_chunks(s0, segs, seg, decay_last, chunk: int) -> torch.Tensor:
    """``[1, C, ...]``: the per-document initial state ``s0 [D, ...]`` of the document that starts
    inside chunk ``c`` and is still running at its end, decayed by ``decay_last [C, ...]`` (from
    the document start to the chunk end); zero for every other chunk. State passing carries it on.

    ``seg [1, C, L]`` are the chunked segment ids of the packed row, ``segs`` its segments.
    """
    c = seg.shape[1]
    doc_of_seg = torch.full((segs.count,), -1, dtype=torch.int64, device=seg.device)
    has = segs.doc_segment >= 0
    doc_of_seg[segs.doc_segment[has]] = torch.nonzero(has).reshape(-1)
    last_seg = seg[0, :, -1]                                                      # [C]
    doc = doc_of_seg[last_seg]
    starts_here = (doc >= 0) & (segs.starts[last_seg] >= torch.arange(c, device=seg.device) * chunk)
    picked = s0.index_select(0, doc.clamp(min=0)) * decay_last
    return torch.where(starts_here.reshape(-1, *([1] * (picked.dim() - 1))), picked, 0.0).unsqueeze(0)


def finish_document_states(own, decay_end, s_enter, enter_seg, seg, start, last_chunk, chunk, s0, docs, num_docs):
    """Assemble every document's final state ``[D, ...]`` from its parts.

    ``own [k, ...]``: the document's own tokens inside its last chunk; ``decay_end`` its decay
    from that chunk's start (broadcastable to a state); the entering state ``s_enter [1, C, ...]``
    of that chunk joins when the document is that state's segment (``enter_seg [1, C]``); its
    initial state ``s0`` joins when it also started in that chunk. Documents without a token
    (``docs`` lists the others) keep ``s0`` (or zeros).
    """
    carried = s_enter[0].index_select(0, last_chunk) * decay_end
    is_entering = (enter_seg[0, last_chunk] == seg).reshape(-1, *([1] * (own.dim() - 1)))
    state = own + torch.where(is_entering, carried, 0.0)
    if s0 is not None:
        starts_here = (start >= last_chunk * chunk).reshape(-1, *([1] * (own.dim() - 1)))
        state = state + torch.where(starts_here, s0[docs] * decay_end, 0.0)
    empty = s0 if s0 is not None else state.new_zeros(num_docs, *state.shape[1:])
    return empty.to(state.dtype).index_copy(0, docs, state)
