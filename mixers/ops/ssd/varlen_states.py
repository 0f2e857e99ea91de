"""Per-document initial and final states for the chunked SSD scan (``cu_seqlens``, ``B == 1``).

    T = padded tokens, H = heads, P = head dim, G = groups, R = H // G, Ns = state size,
    L = chunk length, N = documents

A document's initial state ``h0`` reaches (a) its own tokens inside its first chunk, decayed by
the segmented cumulative decay ``exp(a_cs)``, and (b) the state leaving that chunk when the
document is the chunk's last segment, from where state passing carries it on. Its final state
is (c) the entering state of its last chunk when it is that state's segment, plus (d) its own
tokens inside that last chunk, plus (e) ``h0`` when it starts in that chunk. Each document only
touches a run of at most ``L`` tokens, batched by length (:mod:`mixers.ops.common.grouped`).

Each piece mixes documents (a NaN ``h0`` times a masked zero reaches its neighbours; times a
decay it reaches the decay's gradient, hence every document of the chunk), so each is guarded
(:mod:`mixers.ops.common.isolation`): (b) by the scan's guard, which learns about ``h0`` through
:class:`LeavingStates`; (a) and (c)-(e) by their own, which also reads the states entering the
chunks (NaN where the scan found them non-finite). An empty document's final state is its
initial state as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssm_pack.formats.segments import Segments

from ..common.grouped import buckets, finish_document_states, initial_states_leaving_chunks
from ..common.isolation import Isolation


@dataclass
class LeavingStates:
    """(b), for the scan to guard: ``h0 [N, H, P, Ns]`` of documents ``owner [N]`` (segments)."""

    h0: torch.Tensor
    segs: Segments
    a_cs: torch.Tensor
    seg_chunked: torch.Tensor
    chunk: int

    @property
    def owner(self) -> torch.Tensor:
        return self.segs.doc_segment

    def states(self, iso: Isolation) -> torch.Tensor:
        """``[1, C, H, P, Ns]`` to add to the chunk states before state passing."""
        decay = torch.exp(self.a_cs[0, :, -1, :])[:, :, None, None]             # [C, H, 1, 1]
        h0 = iso.clean_states(self.h0, self.owner)
        return initial_states_leaving_chunks(h0, self.segs, self.seg_chunked, decay, self.chunk)


def initial_chunk_states(h0, segs: Segments, a_cs, seg_chunked, chunk: int) -> LeavingStates:
    """(b), resolved by the scan (:func:`.reference.ssd_chunked_reference`) under its guard."""
    return LeavingStates(h0, segs, a_cs, seg_chunked, chunk)


def initial_outputs(h0, segs: Segments, a_cs_flat, c_flat, chunk: int, heads: int) -> torch.Tensor:
    """(a): ``[T, H, P]`` read of ``h0`` by each document's tokens inside its first chunk."""
    iso = Isolation(segs.seg_id[0])
    iso.scan(c_flat, reads=True)
    iso.scan_states(h0, segs.doc_segment)
    h0, c_flat = iso.clean_states(h0, segs.doc_segment), iso.clean(c_flat)
    docs, start, end, _ = segs.document_runs()
    count = torch.minimum(end - start, chunk - start % chunk)
    g, ns = c_flat.shape[1:]
    r, p = heads // g, h0.shape[2]
    out = c_flat.new_zeros(c_flat.shape[0], heads, p)
    for bucket in buckets(start, count):
        cg = c_flat[bucket.index].permute(0, 2, 1, 3).unsqueeze(2)                # [k, g, 1, m, Ns]
        hg = h0[docs[bucket.ids]].reshape(-1, g, r, p, ns).transpose(-1, -2)      # [k, g, r, Ns, p]
        y = (cg @ hg).permute(0, 3, 1, 2, 4).reshape(*bucket.index.shape, heads, p)
        w = torch.exp(a_cs_flat[bucket.index]).unsqueeze(-1)                      # [k, m, H, 1]
        y = torch.where(bucket.valid[:, :, None, None], y * w, 0.0)
        out = out.index_add(0, bucket.index.reshape(-1), y.reshape(-1, heads, p))
    return iso.poison_tokens(out)


def final_states(h0, segs: Segments, a_cs_flat, xdt_flat, b_flat, h_enter, enter_seg, chunk: int,
                 num_docs: int) -> torch.Tensor:
    """(c) + (d) + (e): ``[N, H, P, Ns]`` state after every document's last token."""
    raw_h0 = h0
    iso = Isolation(segs.seg_id[0])
    iso.scan(xdt_flat)
    iso.scan(b_flat)
    iso.scan_states(h0, segs.doc_segment)
    iso.scan_states(h_enter[0], enter_seg[0])
    xdt_flat, b_flat = iso.clean(xdt_flat), iso.clean(b_flat)
    h0 = iso.clean_states(h0, segs.doc_segment)
    h_enter = iso.clean_states(h_enter[0], enter_seg[0]).unsqueeze(0)
    docs, start, end, seg = segs.document_runs()
    heads, p = xdt_flat.shape[1:]
    g, ns = b_flat.shape[1:]
    r = heads // g
    last = end - 1
    last_chunk = last // chunk
    run_start = torch.maximum(start, last_chunk * chunk)
    a_end = a_cs_flat[last]                                                      # [k, H]
    own = xdt_flat.new_zeros(docs.numel(), heads, p, ns)
    for bucket in buckets(run_start, end - run_start):
        w = torch.exp(a_end[bucket.ids].unsqueeze(1) - a_cs_flat[bucket.index])  # [k, m, H]
        xw = torch.where(bucket.valid[:, :, None, None], xdt_flat[bucket.index] * w.unsqueeze(-1), 0.0)
        xw = xw.reshape(*bucket.index.shape, g, r, p).permute(0, 2, 3, 4, 1)      # [k, g, r, p, m]
        bg = b_flat[bucket.index].permute(0, 2, 1, 3).unsqueeze(2)                # [k, g, 1, m, Ns]
        own = own.index_copy(0, bucket.ids, (xw @ bg).reshape(-1, heads, p, ns))
    final = finish_document_states(own, torch.exp(a_end)[:, :, None, None], h_enter, enter_seg, seg, start,
                                   last_chunk, chunk, h0, docs, num_docs)
    final = iso.poison_states(final, segs.doc_segment)
    if raw_h0 is not None:                           # an empty document keeps its initial state as given
        final = torch.where((segs.doc_segment < 0).reshape(-1, 1, 1, 1), raw_h0.to(final.dtype), final)
    return final
