"""``mamba_chunk_scan_combined`` under context parallelism: state passing with a scalar decay.

    T_r = this rank's tokens, T1 = tokens of its first segment, H = heads, P = head dim,
    G = groups, Ns = state size, N = documents

The SSD recurrence per head, ``h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T``, maps a state
entering a segment's run of tokens to ``exp(A sum dt) S_in + S_local``: the transition is one
scalar per head. Each rank

1. runs the op locally from zero (the documents' own initial states where they start here),
   ``D`` and ``z`` held back, with the row's final state: ``S_local`` of the segment leaving it;
2. sends ``(exp(A sum dt), S_local)`` through :func:`mixers.ops.common.cp_exchange.chain_scan`, which
   composes the ranks a segment crosses and returns ``S_in`` ``[H, P, Ns]`` for its first
   segment;
3. adds what ``S_in`` contributes to that segment's outputs,
   ``y_t += exp(A cumsum(dt)_t) C_t S_in`` (``T1 x H x P x Ns`` work), and to its final
   state, then applies ``D`` and ``z`` as the op does.

Everything is composed in the op's compute dtype (fp32, fp64 for fp64 inputs); gradients of
``S_in`` flow back through the exchange to the ranks it came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.chunks import compute_dtype
from ..common.cp_exchange import chain_scan
from ._validate import SSDCall
from .dt import process_dt


def _replace_row(t: torch.Tensor, i: int, row: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:i], row[None].to(t.dtype), t[i + 1:]])


def ssd_cp(call: SSDCall, local_op):
    """The CP version of :func:`mixers.ops.mamba_chunk_scan_combined` (``call.varlen.cp`` set).
    ``local_op`` is the op itself, run on this rank's pieces without CP (passed in, so this module
    does not import its package)."""
    x, dt, A, B, C, D, z, dt_bias = call.x, call.dt, call.A, call.B, call.C, call.D, call.z, call.dt_bias
    initial_states, dt_softplus, dt_limit = call.initial_states, call.dt_softplus, call.dt_limit
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    n, f = lay.num_docs, lay.first_seg[run.rank]
    if call.seq_idx is not None:
        raise ValueError("mamba_chunk_scan_combined: seq_idx cannot be combined with a context-parallel cu_seqlens; "
                         "pass only cu_seqlens")
    if initial_states is not None and not call.per_doc:
        raise ValueError(f"mamba_chunk_scan_combined: under context parallelism initial_states must be per "
                         f"document [N, H, P, N_state] with N={n}, got {tuple(initial_states.shape)}")
    _, _, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    compute = compute_dtype(x.dtype)
    inits = None
    if initial_states is not None:     # + the tail; a continuing document's own state was read where it started
        inits = torch.cat([initial_states, initial_states.new_zeros(1, heads, head_dim, state)])
        if run.continues_in:
            inits = _replace_row(inits, f, inits.new_zeros(heads, head_dim, state))
    res = local_op(x, dt, A, B, C, call.chunk_size, dt_bias=dt_bias, initial_states=inits,
                   cu_seqlens=run.local_cover, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   return_final_states=True, return_varlen_states=call.return_varlen_states, backend=call.backend)
    y, row_final = res[0].to(compute), res[1][0].to(compute)
    log_decay = process_dt(dt, dt_bias, dt_softplus, dt_limit, compute)[0] * A.to(compute)     # [T_r, H]
    closed = lay.last_starts_here
    element = None
    if run.continues_out:
        element = (None if closed[r] else torch.exp(log_decay.sum(0)), row_final)
    s_in = chain_scan(run, "ssd", element, closed, apply=lambda m, s: m[:, None, None] * s,
                      compose=lambda later, early: later * early, s_shape=(heads, head_dim, state),
                      m_shape=(heads,), dtype=compute, anchors=(x, dt, A, B, C, dt_bias, initial_states))
    decay = None
    if s_in is not None:
        t1 = run.first_len
        cum = log_decay[:t1].cumsum(0)                                                     # [T1, H]
        c1 = C[0, :t1].to(compute).repeat_interleave(heads // groups, dim=1)               # [T1, H, Ns]
        extra = torch.exp(cum)[..., None] * torch.einsum("thn,hpn->thp", c1, s_in)
        y = torch.cat([y[:, :t1] + extra[None], y[:, t1:]], dim=1)
        decay = torch.exp(cum[-1])[:, None, None]                                          # [H, 1, 1]
    if D is not None:
        y = y + x.to(compute) * (D[:, None] if D.dim() == 1 else D).to(compute)
    if z is not None:
        y = y * F.silu(z.to(compute))
    results = [run.anchor(y.to(x.dtype))]
    if call.return_final_states:       # the row's final state: the last rank's
        if decay is not None and lay.first_seg[r] == lay.last_seg[r]:
            row_final = row_final + decay * s_in
        if r != lay.size - 1:
            row_final = torch.zeros_like(row_final)
        results.append(row_final[None].to(x.dtype))
    if call.return_varlen_states:
        states = res[2].to(compute)
        if decay is not None and f < n:
            states = _replace_row(states, f, states[f] + decay * s_in)
        results.append(run.mask_owned(states[:n]).to(x.dtype))
    return results[0] if len(results) == 1 else tuple(results)
