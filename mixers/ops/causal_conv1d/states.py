"""The states of a ``causal_conv1d_fn`` call: every segment's initial slot, and the final states.

    B = rows, D = channels, T = tokens, J = W - 1, S = segments, N = documents

Each backend but causal-conv1d's kernel works on segments (:class:`ssm_pack.Segments`): a
segment's initial slot is its document's initial state (per document) or its row's (the row's
first segment); the final states are the segments' last ``J`` inputs, picked per document or per
row. causal-conv1d's kernel returns no final states: they are gathered here afterwards
(``causal_conv1d_varlen_states`` where upstream has it).
"""

from __future__ import annotations

import torch

from ssm_pack.formats.segments import Segments, segments_from_seq_idx

from ..common.empty import empty_output, passed_through
from ._validate import ConvCall
from .kernel import varlen_states_kernel
from .reference import gather_final_slots


def zeros_seq_idx(x) -> torch.Tensor:
    return torch.zeros(x.shape[0], x.shape[2], dtype=torch.int32, device=x.device)


def segments(call: ConvCall) -> Segments:
    """The call's segments: the forward's (built once), or runs of ``seq_idx`` values."""
    if call.varlen is not None:
        return call.varlen.segments
    return segments_from_seq_idx(call.seq_idx if call.seq_idx is not None else zeros_seq_idx(call.x))


def initial_slots(call: ConvCall, segs: Segments) -> torch.Tensor | None:
    """Initial state of every segment: per document, or the row's state for its first segment."""
    initial_states = call.initial_states
    if initial_states is None:
        return None
    zeros = initial_states.new_zeros(segs.count, *initial_states.shape[1:])
    if call.per_doc:
        docs = torch.nonzero(segs.doc_segment >= 0).reshape(-1)
        return zeros.index_copy(0, segs.doc_segment[docs], initial_states[docs])
    rows = segs.starts // max(segs.seg_id.shape[1], 1)
    first = torch.nonzero(segs.first_in_row).reshape(-1)
    return zeros.index_copy(0, first, initial_states[rows[first]])


def final_states(call: ConvCall, final_slots, segs: Segments):
    """Final slots of the segments -> per-document ``[N, D, J]`` or per-row ``[B, D, J]``."""
    if call.varlen is not None:
        has = segs.doc_segment >= 0
        if segs.count == 0:  # no token at all: every document keeps its initial state
            picked = final_slots.new_zeros(has.numel(), *final_slots.shape[1:])
        else:
            picked = final_slots.index_select(0, segs.doc_segment.clamp(min=0))
        initial = call.initial_states if call.per_doc else None
        empty = initial if initial is not None else torch.zeros_like(picked)
        return torch.where(has[:, None, None], picked, empty.to(picked.dtype))
    last = segs.last_in_row(call.x.shape[0], call.x.shape[2])
    return final_slots.index_select(0, last)


def gather_final_states(call: ConvCall, segs: Segments | None, kernel: bool):
    """The final states of a call whose backend returned none (``kernel``: causal-conv1d's ran)."""
    x, varlen = call.x, call.varlen
    if kernel and varlen is not None and call.initial_states is None and not (torch.is_grad_enabled()
                                                                               and x.requires_grad):
        states = varlen_states_kernel(x, varlen.cu_seqlens, call.state_len)
        if states is not None:
            return states
    segs = segs if segs is not None else segments(call)
    final_slots = gather_final_slots(x, segs, call.state_len, initial_slots(call, segs))
    return final_states(call, final_slots, segs)


def empty_result(call: ConvCall):
    """No token (:mod:`mixers.ops.common.empty`: no row or no position): an empty output, every final
    state its initial state (per document with ``cu_seqlens``, else per row) or zeros."""
    x = call.x
    batch, dim, _ = x.shape
    out = empty_output(x, x.shape)
    if not call.return_final_states:
        return out
    if call.varlen is not None:
        final = passed_through(call.initial_states if call.per_doc else None,
                               (call.varlen.num_docs, dim, call.state_len), x)
    else:
        final = passed_through(call.initial_states, (batch, dim, call.state_len), x)
    if call.final_states_out is not None:
        call.final_states_out.copy_(final)
        final = call.final_states_out
    return out, final
