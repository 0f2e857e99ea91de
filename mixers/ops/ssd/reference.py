"""The torch backend of the SSD scan (Mamba2): chunked, with document resets inside the chunks.
Its specification, the same scan one document at a time, is :mod:`.naive`.

    B = rows, T = tokens, H = heads, P = head dim, G = groups (dividing H), Ns = state size,
    C = chunks, L = chunk length, R = H // G heads per group

The recurrence per head is ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``,
restarted at every segment (document). Chunked as in the SSD paper, with the segment ids
carried into every step:

1. segmented cumulative decay inside each chunk (a masked matmul, so it never sums over
   another document's ``dt``);
2. intra-chunk output: ``(C B^T) * exp(segsum)`` masked to same-segment causal pairs;
3. chunk states: what each chunk's last segment accumulates inside the chunk;
4. state passing over chunks: a chunk keeps the entering state only if its last token still
   belongs to the entering state's segment;
5. inter-chunk output: the entering state read by the tokens of its own segment only.

Every mask is applied before ``exp`` (``-inf``) or with ``torch.where``, so a decay across a
boundary is exactly 0 and no value of another document ever enters a sum. Steps 2-5 run in
one autograd function over blocks of chunks (:mod:`.chunk_scan`).

Those masks multiply exact zeros into the cross-document terms, which is exact for finite values
only (``0 * nan = nan``), so the whole scan is guarded (:mod:`mixers.ops.common.isolation`): non-finite inputs
(``x``, ``dt``, ``B``, ``C``, ``z``, initial states) are sanitized on the way in and their
document's outputs and states re-poisoned on the way out; ``A`` and ``D``, which every document
shares, get NaN gradients when a poisoned value is differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssm_pack.formats.segments import segments_from_seq_idx

from ..common.chunks import compute_dtype, entering_segments, pad_tokens, records_grad, same_segment_causal
from ..common.empty import passed_through
from ..common.isolation import Isolation
from ._validate import SSDCall
from .chunk_scan import SSDChunkScan
from .dt import process_dt
from .varlen_states import LeavingStates, final_states, initial_chunk_states, initial_outputs


def ssd_reference(call: SSDCall):
    """``out`` (and the final / varlen states asked for) of the reference path, in ``x``'s dtype."""
    x, per_doc, varlen, chunk_size = call.x, call.per_doc, call.varlen, call.chunk_size
    batch, length, heads, _ = x.shape
    compute = compute_dtype(x.dtype)
    dtp = process_dt(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit, compute)
    xc, Bc, Cc, Ac = x.to(compute), call.B.to(compute), call.C.to(compute), call.A.to(compute)
    if varlen is not None:
        segs = varlen.segments
    elif call.seq_idx is not None:
        segs = segments_from_seq_idx(call.seq_idx)
    else:
        segs = segments_from_seq_idx(torch.zeros(batch, length, dtype=torch.int32, device=x.device))
    h0 = call.initial_states.to(compute) if call.initial_states is not None else None
    extra = None
    if per_doc:
        extra = lambda a_cs, seg: initial_chunk_states(h0, segs, a_cs, seg, chunk_size)  # noqa: E731
    Dc = None if call.D is None else call.D.to(compute)
    zc = None if call.z is None else call.z.to(compute)
    y, ch = ssd_chunked_reference(xc, dtp, Ac, Bc, Cc, segs.seg_id, chunk_size,
                                  initial_state=None if per_doc else h0, extra_states=extra,
                                  D=None if per_doc else Dc, z=None if per_doc else zc,
                                  keep_enter=call.return_varlen_states)
    a_cs_flat = ch.a_cs.reshape(-1, heads)
    if per_doc:  # the documents' own initial states are read before the skip and the gate
        y = y + initial_outputs(h0, segs, a_cs_flat, Cc[0], chunk_size, heads).unsqueeze(0)
        if Dc is not None:
            y = y + xc * (Dc[:, None] if Dc.dim() == 1 else Dc)
        if zc is not None:
            y = y * F.silu(zc)
    results = [y.to(x.dtype)]
    if call.return_final_states:
        results.append(ch.h_final.to(x.dtype))
    if call.return_varlen_states:
        xdt = (xc * dtp.unsqueeze(-1))[0]
        states = final_states(h0 if per_doc else None, segs, a_cs_flat, xdt, Bc[0], ch.h_enter, ch.enter_seg,
                              chunk_size, varlen.num_docs)
        results.append(states.to(x.dtype))
    return results[0] if len(results) == 1 else tuple(results)


def empty_result(call: SSDCall):
    """No token (:mod:`mixers.ops.common.empty`: no row or no position): an empty output, every state its
    initial state (or zeros)."""
    x, initial_states, per_doc = call.x, call.initial_states, call.per_doc
    batch, _, heads, p = x.shape
    ns = call.B.shape[-1]
    results = [x.new_zeros(x.shape)]
    if call.return_final_states:
        results.append(passed_through(None if per_doc else initial_states, (batch, heads, p, ns), x))
    if call.return_varlen_states:
        results.append(passed_through(initial_states if per_doc else None, (call.varlen.num_docs, heads, p, ns), x))
    return results[0] if len(results) == 1 else tuple(results)


class _SegmentSum(torch.autograd.Function):
    """``keep [b, c, L, L] (bool) @ v [b, c, L, h]``: keeps the bool mask for backward, not a float
    copy of it (autograd through the matmul would keep ``[T, L]`` floats), and converts it a block
    of chunks at a time (the whole sequence's floats would be a fresh ``L`` per token every step)."""

    @staticmethod
    def forward(ctx, keep, v):
        ctx.save_for_backward(keep)
        return _masked_sum(keep, v)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return None, _masked_sum(keep, grad, transpose=True)


_MASK_BLOCK = 1 << 20     # mask elements converted at once (4 MB of fp32)


def _masked_sum(keep: torch.Tensor, v: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``keep @ v`` (``keep^T @ v`` if ``transpose``) over blocks of chunks; ``keep [b, c, L, L]`` bool."""
    b, c, length, _ = keep.shape
    out = torch.empty_like(v)
    step = max(1, _MASK_BLOCK // (b * length * length))
    for c0 in range(0, c, step):
        mask = keep[:, c0:c0 + step].to(v.dtype)
        torch.matmul(mask.transpose(-1, -2) if transpose else mask, v[:, c0:c0 + step], out=out[:, c0:c0 + step])
    return out


@dataclass
class SsdIntermediates:
    """Intermediates kept for per-document states."""

    a_cs: torch.Tensor       # [B, C, L, H] segmented cumulative log-decay
    seg: torch.Tensor        # [B, C, L] segment id
    enter_seg: torch.Tensor  # [B, C] segment of each chunk's entering state
    h_enter: torch.Tensor | None  # [B, C, H, P, Ns] state entering each chunk (NaN where non-finite, see
                                  # reference); None unless asked for (``keep_enter``)
    h_final: torch.Tensor    # [B, H, P, Ns] state after the last chunk (the row's last segment)
    chunk: int


def ssd_chunked_reference(x, dt, A, Bm, Cm, seg_id, chunk_size: int, initial_state=None,
                          extra_states=None, D=None, z=None, keep_enter: bool = False
                          ) -> tuple[torch.Tensor, SsdIntermediates]:
    """Chunked SSD scan: ``out = (y + D x) * silu(z)`` (``D``, ``z`` optional).

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` (already biased, softplus-ed, clamped);
        A: ``[H]``; Bm, Cm: ``[B, T, G, Ns]``; seg_id: ``[B, T]`` segment ids.
        initial_state: ``[B, H, P, Ns]`` state entering chunk 0 (the row's first segment).
        extra_states: optional callable ``(a_cs, seg) -> [B, C, H, P, Ns]`` (or a
            :class:`.varlen_states.LeavingStates` giving it) whose result is added to each
            chunk's state before passing (per-document initial states of documents starting
            inside a chunk, see :mod:`.varlen_states`).
        D: ``[H]`` or ``[H, P]`` skip; z: ``[B, T, H, P]`` gate.
        keep_enter: return every chunk's entering state in :class:`SsdIntermediates` (per-document final
            states read them); otherwise, without gradients, the scan holds one block's at a time.

    Returns ``out`` ``[B, T, H, P]`` and the :class:`SsdIntermediates`.
    """
    iso = Isolation(seg_id)
    for t_ in (x, dt, Bm):
        iso.scan(t_)
    for t_ in (Cm, z):
        iso.scan(t_, reads=True)
    iso.scan_states(initial_state, seg_id[:, 0])
    x, dt, Bm, Cm, z = (iso.clean(t_) for t_ in (x, dt, Bm, Cm, z))
    initial_state = iso.clean_states(initial_state, seg_id[:, 0])
    A, D = iso.shared(A), iso.shared(D)
    b, t, h, p = x.shape
    ns = Bm.shape[3]
    L = chunk_size
    pad = (-t) % L
    # neutral padding: dt = 0 (no decay, no input), same segment as the last token
    x, dt, Bm, Cm = (pad_tokens(t_, pad) for t_ in (x, dt, Bm, Cm))
    z = None if z is None else pad_tokens(z, pad)
    seg = pad_tokens(seg_id, pad, repeat_last=True)
    c = (t + pad) // L
    seg = seg.reshape(b, c, L)
    keep = same_segment_causal(seg)                                              # [b, c, l, s]
    # 1. segmented cumulative log-decay (a masked matmul: never sums over another segment)
    a_cs = _SegmentSum.apply(keep, (dt * A).reshape(b, c, L, h))                 # [b, c, L, h]
    # which tokens feed the chunk state, and which read the entering state
    enter_seg = entering_segments(seg)                                           # [b, c]
    reads = seg == enter_seg.unsqueeze(-1)                                        # [b, c, L]
    keep_state = seg[:, :, -1] == enter_seg                                      # [b, c]
    extra = None if extra_states is None else extra_states(a_cs, seg)
    if isinstance(extra, LeavingStates):         # per-document initial states: guarded like the inputs
        iso.scan_states(extra.h0, extra.owner)
        extra = extra.states(iso)
    h0 = x.new_zeros(b, h, p, ns) if initial_state is None else initial_state.to(x.dtype)
    # 2.-5. intra-chunk output, chunk states, state passing, entering-state read
    args = (x, dt.contiguous(), a_cs.reshape(b, c * L, h), Bm, Cm, keep.reshape(b * c, L, L),
            keep[:, :, -1, :].reshape(b * c, L), reads.reshape(b * c, L), keep_state, h0, extra, D, z)
    out, h_enter, h_final = SSDChunkScan.apply(*args, L, keep_enter or records_grad(*args))   # a backward reads h_enter
    if h_enter is not None:  # a state entering a chunk is non-finite when its segment's state was before the chunk
        chunk_start = torch.arange(c, device=x.device) * L
        before = torch.arange(b, device=x.device).unsqueeze(1) * t + chunk_start - 1   # flat token before each chunk
        bad_enter = iso.state_bad_after(torch.where(chunk_start > 0, before, -1), seg_id[:, :1].expand(b, c))
        h_enter = iso.poison_where(h_enter, bad_enter, enter_seg)
    h_final = iso.poison_states(h_final, seg_id[:, -1])
    return iso.poison_tokens(out[:, :t]), SsdIntermediates(a_cs=a_cs, seg=seg, enter_seg=enter_seg,
                                                           h_enter=h_enter, h_final=h_final, chunk=L)
