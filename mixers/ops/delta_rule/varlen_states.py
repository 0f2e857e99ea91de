"""Per-document initial and final states of the chunked delta rule (``cu_seqlens``, ``B == 1``).

    T = padded tokens, C = chunks, L = chunk length, H = heads, K, V = key / value dims,
    D = documents

A document's initial state ``S0`` acts on its own tokens inside its first chunk (the chunk
where it starts): it corrects their values (``delta -= W S0``), is read by their queries
(``o += (exp(G) q) S0``), and, when the document is still running at the chunk's end, enters
the leaving state as ``exp(G_L) S0``. A document's final state is the entering state of its
last chunk (when it is that state's document) decayed to its last token, plus its own tokens
in that chunk, plus ``S0`` when it also started there. Each document only touches a run of at
most ``L`` tokens; runs are batched by length (:mod:`mixers.ops.common.grouped`).

Non-finite initial states go through the chunked call's guard (:mod:`mixers.ops.common.isolation`): sanitized
before any mixing op (a NaN ``S0`` times a masked zero would reach its neighbours, and times a
decay it would reach the decay's gradient), and the document's outputs and final state
re-poisoned. An empty document's final state is its initial state as given.
"""

from __future__ import annotations

import torch

from ssm_pack.formats.segments import Segments

from ..common.chunks import suffix_sums
from ..common.grouped import buckets, finish_document_states, initial_states_leaving_chunks


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``[1, C, H, L, X]`` -> ``[C*L, H, X]``."""
    _, c, h, L, x = t.shape
    return t[0].transpose(1, 2).reshape(c * L, h, x)


def _chunk_major(t: torch.Tensor, c: int) -> torch.Tensor:
    """``[C*L, H, X]`` -> ``[1, C, H, L, X]``."""
    return t.reshape(c, -1, *t.shape[1:]).transpose(1, 2).unsqueeze(0)


class DocInitialStates:
    """The hooks :func:`.chunk.delta_rule_chunked` calls for per-document initial states."""

    def __init__(self, s0: torch.Tensor, segs: Segments, chunk: int):
        self.s0, self.segs, self.chunk = s0, segs, chunk
        self.owner = segs.doc_segment                                       # [D] segment of each document
        docs, start, end, _ = segs.document_runs()
        self.docs, self.start = docs, start
        self.count = torch.minimum(end - start, chunk - start % chunk)    # the first-chunk run

    def isolate(self, iso) -> None:
        """Use the initial states sanitized by the chunked call's guard (cleaned once: the final
        states use the same tensor, see :attr:`.chunk.DeltaIntermediates.s0`)."""
        self.s0 = iso.clean_states(self.s0, self.owner)

    def _apply(self, rows_tm: torch.Tensor) -> torch.Tensor:
        """``out[t] = rows[t] @ S0[doc(t)]`` on every first-chunk run (``[T, H, K]`` -> ``[T, H, V]``)."""
        out = rows_tm.new_zeros(rows_tm.shape[0], rows_tm.shape[1], self.s0.shape[-1])
        for bucket in buckets(self.start, self.count):
            rows = rows_tm[bucket.index].transpose(1, 2)                           # [k, H, n, K]
            y = (rows @ self.s0[self.docs[bucket.ids]]).transpose(1, 2)           # [k, n, H, V]
            y = torch.where(bucket.valid[:, :, None, None], y, 0.0)
            out = out.index_add(0, bucket.index.reshape(-1), y.reshape(-1, *y.shape[2:]))
        return out

    def corrections(self, G, W):
        return _chunk_major(self._apply(_token_major(W)), W.shape[1])

    def reads(self, G, q_in):
        return _chunk_major(self._apply(_token_major(q_in)), q_in.shape[1])

    def chunk_states(self, G, seg):
        decay = torch.exp(G[0, :, :, -1, :]).unsqueeze(-1)                        # [C, H, Kg, 1]
        return initial_states_leaving_chunks(self.s0, self.segs, seg, decay, self.chunk)


def doc_final_states(ch, segs: Segments, s0, num_docs: int) -> torch.Tensor:
    """``[D, H, K, V]`` state after every document's last token (see the module docstring)."""
    L = ch.chunk
    raw_s0 = s0
    if s0 is not None:
        s0 = ch.s0                                     # sanitized by the guard (see DocInitialStates)
    docs, start, end, seg = segs.document_runs()
    G_tm, k_tm, d_tm = _token_major(ch.G), _token_major(ch.keys), _token_major(ch.delta)
    gate_tm = _token_major(ch.gate)
    h, kd, vd = k_tm.shape[1], k_tm.shape[2], d_tm.shape[2]
    last = end - 1
    last_chunk = last // L
    run_start = torch.maximum(start, last_chunk * L)
    g_end = G_tm[last]                                                             # [k, H, Kg]
    own = d_tm.new_zeros(docs.numel(), h, kd, vd)
    for bucket in buckets(run_start, end - run_start):
        valid = bucket.valid[:, :, None, None]
        w = torch.exp(suffix_sums(torch.where(valid, gate_tm[bucket.index], 0.0), 1))  # [k, n, H, Kg]: sum_(t, end)
        keys = torch.where(valid, k_tm[bucket.index] * w, 0.0)
        outer = keys.permute(0, 2, 3, 1) @ d_tm[bucket.index].transpose(1, 2)      # [k, H, K, V]
        own = own.index_copy(0, bucket.ids, outer)
    final = finish_document_states(own, torch.exp(g_end).unsqueeze(-1), ch.s_enter, ch.enter_seg, seg, start,
                                   last_chunk, L, s0, docs, num_docs)
    final = ch.iso.poison_states(final, segs.doc_segment)
    if raw_s0 is not None:                           # an empty document keeps its initial state as given
        empty = (segs.doc_segment < 0).reshape(-1, 1, 1, 1)
        final = torch.where(empty, raw_s0.to(final.dtype), final)
    return final
