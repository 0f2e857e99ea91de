"""The torch backend of ``selective_scan_fn``: a chunked scan with document resets.

    R = rows, T = tokens, E = channels, Ns = state size, L = chunk length, N = documents

The recurrence ``h_t = a_t h_{t-1} + b_t`` with ``a_t = exp(dt_t A)`` and ``b_t = dt_t u_t B_t``
(each ``[E, Ns]``) runs chunk by chunk over the packed row:

1. inside a chunk, ``(a, b)`` pairs are combined by an inclusive scan of ``log2 L`` doubling steps,
   ``(a2, b2) o (a1, b1) = (a2 a1, a2 b1 + b2)``, vectorised over the chunk's tokens, channels and
   state entries; a token that starts a document carries a *reset* flag and is never combined with
   anything before it (``torch.where``, so nothing from an earlier document is multiplied in);
2. the state leaving one chunk enters the next at its first token (dropped where that token starts
   a document); a document's own initial state enters at its first token as ``a_t h0``. The
   segment starts come from ``seq_idx`` on the device: the training forward reads no tensor value
   on the host (``torch.compile`` traces it whole); only per-document final states read the
   boundaries;
3. ``y_t = C_t . h_t`` per channel, then the ``D`` skip and the ``silu(z)`` gate.

No ``exp`` of a positive sum is ever formed, so any step size is safe (no log-space division).
Memory: every chunk's states are ``[R, L, E, Ns]``; under autograd each chunk is recomputed in the
backward (:func:`torch.utils.checkpoint.checkpoint`), so what is kept is the inputs and one state
per chunk, never ``[T, E, Ns]``.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import dispatch
from ..common.chunks import compute_dtype
from ._validate import ScanCall


def step_sizes(delta, delta_bias, delta_softplus, compute) -> torch.Tensor:
    """``delta`` ``[B, E, T]`` as the recurrence reads it: ``softplus(delta + delta_bias)`` (if asked), in
    ``compute``."""
    dt = delta.to(compute)
    if delta_bias is not None:
        dt = dt + delta_bias.to(compute)[:, None]
    return F.softplus(dt) if delta_softplus else dt


def _chunk(u, dt, A, B, C, h_in, reset, h0, picks):
    """One chunk: u, dt ``[R, L, E]``, B, C ``[R, L, Ns]``, h_in ``[R, E, Ns]`` (the state entering it),
    reset ``[R, L]`` (segment starts: nothing before them is combined in), h0 ``[R, L, E, Ns]`` (each
    token's segment's initial state, read at the starts) or ``None``, picks ``(rows, positions)`` of
    states to return or ``None``. Returns ``(y [R, L, E], h_last [R, E, Ns], picked [K, E, Ns] | None)``.

    Every product that meets a state from before a reset multiplies a ``torch.where``-ed zero, never
    the state itself, so a non-finite value of one document reaches no other document's output or
    gradient."""
    length = u.shape[1]
    a = torch.exp(dt[..., None] * A)                                  # [R, L, E, Ns]
    b = (dt * u)[..., None] * B[:, :, None, :]
    starts = reset[..., None, None]
    carry = a[:, 0] * torch.where(starts[:, 0], torch.zeros_like(h_in), h_in)
    b = torch.cat([(b[:, 0] + carry)[:, None], b[:, 1:]], 1)
    if h0 is not None:
        b = b + a * torch.where(starts, h0, torch.zeros_like(h0))
    flag = torch.cat([torch.ones_like(reset[:, :1]), reset[:, 1:]], 1)
    step = 1
    while step < length:
        keep = flag[:, step:, None, None]
        earlier = torch.where(keep, torch.zeros_like(b[:, :-step]), b[:, :-step])
        b = torch.cat([b[:, :step], a[:, step:] * earlier + b[:, step:]], 1)
        if step * 2 < length:
            earlier = torch.where(keep, torch.ones_like(a[:, :-step]), a[:, :-step])
            a = torch.cat([a[:, :step], a[:, step:] * earlier], 1)
        flag = torch.cat([flag[:, :step], flag[:, step:] | flag[:, :-step]], 1)
        step *= 2
    y = torch.einsum("rlen,rln->rle", b, C)
    # a copy, not a view: the next chunk keeps this state for its backward, and a view would keep
    # this chunk's whole [R, L, E, Ns] storage alive with it
    return y, b[:, -1].clone(), None if picks is None else b[picks[0], picks[1]]


def _resets(call: ScanCall, rows: int, total: int, device) -> torch.Tensor:
    """``[R, T]`` bool: the first token of every segment (a document, the padding tail, a row), from
    ``seq_idx`` on the device (nothing read on the host). Unpacked rows: none (a row's initial state
    enters as the state carried into its first token)."""
    if call.varlen is None:
        return torch.zeros(rows, total, dtype=torch.bool, device=device)
    seq = call.varlen.seq_idx[0]
    first = torch.ones(1, dtype=torch.bool, device=device)
    return torch.cat([first, seq[1:] != seq[:-1]])[None]


def _ends(call: ScanCall) -> list[int | None]:
    """The last token of every document (``None``: empty); read on the host, only for
    ``return_varlen_states`` (decoding prefills and context parallelism)."""
    v = call.varlen
    bounds = (v.cu_seqlens if v.host_cu_seqlens is None else v.host_cu_seqlens).tolist()
    return [e - 1 if e > s else None for s, e in zip(bounds[:-1], bounds[1:])]


def selective_scan_reference(call: ScanCall):
    """``selective_scan_fn`` on any device (see the module docstring); returns as the op does."""
    rows, channels, total = call.u.shape
    compute = compute_dtype(call.u.dtype)
    state = call.A.shape[1]
    u = call.u.to(compute).transpose(1, 2)                                      # [R, T, E]
    dt = step_sizes(call.delta, call.delta_bias, call.delta_softplus, compute).transpose(1, 2)
    A = call.A.to(compute)
    B, C = call.B.to(compute).transpose(1, 2), call.C.to(compute).transpose(1, 2)       # [R, T, Ns]
    reset = _resets(call, rows, total, u.device)
    h = u.new_zeros(rows, channels, state)
    h0_tokens = None
    if call.initial_states is not None:
        if call.varlen is None:
            h = call.initial_states.to(compute)
        else:                       # per token, its document's initial state (the tail: zeros)
            h0_all = torch.cat([call.initial_states.to(compute), h.new_zeros(1, channels, state)])
            h0_tokens = (h0_all, call.varlen.seq_idx[0].long())
    ends = _ends(call) if call.return_varlen_states else []
    end_pos = sorted((t, doc) for doc, t in enumerate(ends) if t is not None)
    grad = dispatch.records_grad(u, dt, A, B, C, call.initial_states)
    ys, picked = [], {}
    for s in range(0, total, call.chunk_size):
        e = min(s + call.chunk_size, total)
        h0 = None if h0_tokens is None else h0_tokens[0][h0_tokens[1][s:e]][None]
        picks, docs = None, []
        if end_pos:
            lo, hi = bisect_left(end_pos, (s, -1)), bisect_left(end_pos, (e, -1))
            docs = [doc for _, doc in end_pos[lo:hi]]
            picks = (torch.zeros(len(docs), dtype=torch.long, device=u.device),
                     torch.tensor([t - s for t, _ in end_pos[lo:hi]], dtype=torch.long, device=u.device))
        args = (u[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], h, reset[:, s:e], h0, picks)
        y, h, got = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        ys.append(y)
        picked.update({doc: got[i] for i, doc in enumerate(docs)})
    y = torch.cat(ys, 1).transpose(1, 2)                                         # [R, E, T]
    if call.D is not None:
        y = y + call.u.to(compute) * call.D.to(compute)[:, None]
    if call.z is not None:
        y = y * F.silu(call.z.to(compute))
    results = [y.to(call.u.dtype)]
    if call.return_last_state:      # the state after the row's last token
        results.append(h.to(call.u.dtype))
    if call.return_varlen_states:
        results.append(_document_states(call, ends, picked, channels, state, compute).to(call.u.dtype))
    return results[0] if len(results) == 1 else tuple(results)


def _document_states(call, ends, picked, channels, state, compute) -> torch.Tensor:
    """``[N, E, Ns]``: each document's state after its last token (an empty one: its initial state)."""
    out = []
    for doc, end in enumerate(ends):
        if end is not None:
            out.append(picked[doc])
        elif call.initial_states is not None:
            out.append(call.initial_states[doc].to(compute))
        else:
            out.append(call.u.new_zeros(channels, state, dtype=compute))
    return torch.stack(out) if out else call.u.new_zeros(0, channels, state, dtype=compute)


def empty_result(call: ScanCall):
    """No token (no row or no position): zero outputs on the graph, every final state its initial state
    (or zeros)."""
    from ..common.empty import empty_output, passed_through
    rows, channels, _ = call.u.shape
    state = call.A.shape[1]
    results = [empty_output(call.u, call.u.shape)]
    if call.return_last_state:
        init = call.initial_states if call.varlen is None else None
        results.append(passed_through(init, (rows, channels, state), call.u))
    if call.return_varlen_states:
        results.append(passed_through(call.initial_states, (call.varlen.num_docs, channels, state), call.u))
    return results[0] if len(results) == 1 else tuple(results)
