"""The torch backend of ``rg_lru``: per-token gates, then a segmented parallel prefix scan.

    B = rows, T = tokens, D = channels, N = documents

The recurrence ``h_t = a_t h_{t-1} + b_t`` is linear and diagonal, so the pairs ``(a_t, b_t)``
compose associatively: ``(a2, b2) o (a1, b1) = (a2 a1, a2 b1 + b2)``. The scan doubles its
reach ``ceil(log2 T)`` times (Hillis-Steele): after step k every token holds the composition of
the ``2^k`` tokens ending at it, cut at its segment's start. No pair crosses a segment boundary:
the partner from another segment is masked out with ``where`` (never multiplied by zero), so a
NaN or inf in one document stays there, forward and backward. A document's starting state enters
as ``a_t h_0`` added to its first token's ``b`` (continuing documents only; a fresh document's
first token resets, step 3 of :mod:`.naive`). Work ``O(T D log T)``, no Python loop over tokens;
every step is differentiable by autograd.
"""

from __future__ import annotations

import torch

from ..common.chunks import compute_dtype
from ._validate import RGLRUCall
from .gates import log_decay, normalised_input


def segment_layout(call: RGLRUCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg [B, T] int64, start [B, T] bool)``: the segment of each token (row b without
    ``cu_seqlens``; else its document, the padding tail being segment N) and whether it is its
    segment's first token."""
    rows, total = call.x.shape[:2]
    if call.varlen is None:
        seg = torch.arange(rows, device=call.x.device)[:, None].expand(rows, total)
    else:
        seg = call.varlen.seq_idx.to(torch.int64)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return seg, start


def scan_inputs(call: RGLRUCall, compute: torch.dtype):
    """``(log_a, b, seg)``: each token's log-decay and the input it adds ``[B, T, D]`` (the starting
    states of continuing documents folded into their first tokens), and the segment ids ``[B, T]``."""
    x, gate_x = call.x.to(compute), call.gate_x.to(compute)
    log_a = log_decay(call.gate_a.to(compute), call.recurrent_param.to(compute), call.scale)
    seg, start = segment_layout(call)
    goes_on = call.continues_per_segment(seg.device)               # [S] bool, S = N (+1 tail) or B
    first_goes_on = start & goes_on[seg]
    reset = (start & ~first_goes_on).unsqueeze(-1)
    b = normalised_input(x, gate_x, log_a, reset)
    if call.initial_state is not None and bool(first_goes_on.any()):
        h0 = call.states_per_segment(compute)[seg]                  # [B, T, D]
        carried = torch.exp(log_a) * h0
        b = b + torch.where(first_goes_on.unsqueeze(-1), carried, torch.zeros((), dtype=compute, device=b.device))
    return log_a, b, seg


def segmented_scan(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``h [B, T, D]`` with ``h_t = a_t h_{t-1} + b_t`` inside each segment of ``seg [B, T]`` (from 0)."""
    total = a.shape[1]
    zero, one = torch.zeros((), dtype=b.dtype, device=b.device), torch.ones((), dtype=a.dtype, device=a.device)
    step = 1
    while step < total:
        same = (seg[:, step:] == seg[:, :-step]).unsqueeze(-1)                      # [B, T - step, 1]
        b_prev = torch.where(same, b[:, :-step], zero)
        a_prev = torch.where(same, a[:, :-step], one)
        b = torch.cat([b[:, :step], b[:, step:] + a[:, step:] * b_prev], dim=1)
        a = torch.cat([a[:, :step], a[:, step:] * a_prev], dim=1)
        step *= 2
    return b


def starting_states(call: RGLRUCall, compute: torch.dtype, device) -> torch.Tensor:
    """``[B or N, D]``: the state each row / document starts from (its initial state when it
    continues one, else zero): the final state of one without tokens."""
    rows = call.x.shape[0] if call.varlen is None else call.varlen.num_docs
    start = torch.zeros(rows, call.x.shape[-1], dtype=compute, device=device)
    if call.initial_state is None:
        return start
    goes_on = call.continues_per_segment(device)[:rows].unsqueeze(-1)
    return torch.where(goes_on, call.initial_state.to(compute), start)


def final_states(call: RGLRUCall, h: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """``[B or N, D]``: each row's / document's last ``h`` (:func:`starting_states` where it has no token)."""
    start = starting_states(call, compute, h.device)
    if h.shape[1] == 0:
        return start
    if call.varlen is None:
        return h[:, -1]
    cu = call.varlen.cu_seqlens_long
    picked = h[0].index_select(0, (cu[1:] - 1).clamp(min=0))
    return torch.where((cu[1:] > cu[:-1]).unsqueeze(-1), picked, start)


def rg_lru_reference(call: RGLRUCall):
    """``(out [B, T, D] in x's dtype, final [B or N, D] in the compute dtype, or None)``."""
    compute = compute_dtype(call.x.dtype)
    log_a, b, seg = scan_inputs(call, compute)
    h = segmented_scan(torch.exp(log_a), b, seg)
    final = final_states(call, h, compute) if call.output_final_state else None
    return h.to(call.x.dtype), final
