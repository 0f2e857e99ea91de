"""Segments of a packed batch: the unit inside which state may flow.

    B = rows, T = tokens per row, S = non-empty segments over all rows, N = documents

A segment is a maximal run of tokens sharing one ``seq_idx`` value inside a row (upstream's
"boundaries are changes of value"), or, with ``cu_seqlens`` (``B == 1``), one non-empty document
(the tokens after ``cu_seqlens[-1]`` form one more segment). Segments are numbered over the
flattened ``[B * T]`` tokens, so comparing segment ids is all a chunked op needs to keep
documents apart, even across rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """Where every segment starts and which segment every token belongs to.

    Attributes:
        seg_id: ``[B, T]`` int64 segment of each token, non-decreasing in flat order.
        starts: ``[S]`` int64 flat start (``b * T + t``) of each segment.
        lengths: ``[S]`` int64 tokens of each segment (all >= 1).
        first_in_row: ``[S]`` bool, the segment starts at ``t == 0`` of its row.
        doc_segment: ``[N]`` int64 segment of each document (-1 for an empty one), or ``None``
            without ``cu_seqlens``.
    """

    seg_id: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    first_in_row: torch.Tensor
    doc_segment: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.starts.numel()

    @property
    def ends(self) -> torch.Tensor:
        """``[S]`` flat end (exclusive) of each segment."""
        return self.starts + self.lengths

    def document_runs(self):
        """``(docs, start, end, seg)`` ``[k]`` each: the non-empty documents, where they start and
        end (exclusive, flat) and their segments. Needs ``doc_segment`` (``cu_seqlens``)."""
        docs = torch.nonzero(self.doc_segment >= 0).reshape(-1)
        seg = self.doc_segment[docs]
        return docs, self.starts[seg], self.ends[seg], seg

    def expanded(self, factor: int) -> Segments:
        """The segments of the same row with every token repeated ``factor`` times in place
        (Gated DeltaProduct's ``num_householder`` sub-steps per token); no value is read."""
        if factor == 1:
            return self
        return Segments(seg_id=self.seg_id.repeat_interleave(factor, dim=1), starts=self.starts * factor,
                        lengths=self.lengths * factor, first_in_row=self.first_in_row, doc_segment=self.doc_segment)

    def last_in_row(self, batch: int, length: int) -> torch.Tensor:
        """``[B]`` index of the last segment of every row."""
        return self.seg_id[:, length - 1] if length else torch.full((batch,), -1, dtype=torch.int64)


def segments_from_seq_idx(seq_idx: torch.Tensor) -> Segments:
    """Segments of ``seq_idx`` ``[B, T]``: a new one wherever the value changes, and at each row start."""
    batch, length = seq_idx.shape
    change = torch.ones(batch, length, dtype=torch.bool, device=seq_idx.device)
    change[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    flat = change.reshape(-1)
    starts = torch.nonzero(flat).reshape(-1)
    seg_id = torch.cumsum(flat, 0).reshape(batch, length) - 1
    ends = torch.cat([starts[1:], starts.new_tensor([batch * length])])
    return Segments(seg_id=seg_id, starts=starts, lengths=ends - starts,
                    first_in_row=starts % max(length, 1) == 0)


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> Segments:
    """Segments of one packed row of ``length`` tokens: non-empty documents, then the tail."""
    cu = cu_seqlens.to(torch.int64)
    doc_len = cu[1:] - cu[:-1]
    nonempty = doc_len > 0
    doc_segment = torch.where(nonempty, torch.cumsum(nonempty, 0) - 1, -1)
    last = int(cu[-1])
    tail = length - last
    starts = cu[:-1][nonempty]
    lengths = doc_len[nonempty]
    if tail > 0:
        starts = torch.cat([starts, cu.new_tensor([last])])
        lengths = torch.cat([lengths, cu.new_tensor([tail])])
    counts = torch.zeros(length + 1, dtype=torch.int64, device=cu.device)
    counts.index_add_(0, starts, torch.ones_like(starts))
    seg_id = (torch.cumsum(counts[:length], 0) - 1).unsqueeze(0)
    return Segments(seg_id=seg_id, starts=starts, lengths=lengths, first_in_row=starts == 0,
                    doc_segment=doc_segment)
