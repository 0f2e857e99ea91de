"""``selective_scan_fn`` under context parallelism: state passing with a per-entry decay.

    T_r = this rank's tokens, T1 = tokens of its first segment, E = channels, Ns = state size,
    N = documents

The Mamba-1 recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t`` maps a state entering a run of
tokens to ``exp(A sum dt) * S_in + S_local`` (elementwise, ``[E, Ns]``). Each rank

1. runs the op locally from zero (the documents' own initial states where they start here),
   ``D`` and ``z`` held back, with the row's final state: ``S_local`` of the segment leaving it;
2. sends ``(exp(A sum dt), S_local)`` through :func:`mixers.ops.common.cp_exchange.chain_scan`, which
   composes the ranks a segment crosses and returns ``S_in`` ``[E, Ns]`` for its first segment;
3. adds what ``S_in`` contributes to that segment's outputs,
   ``y_t += C_t . (exp(A cumsum(dt)_t) * S_in)`` (``T1 x E x Ns`` work), and to its final state,
   then applies ``D`` and ``z`` as the op does.

Composed in the op's compute dtype; gradients of ``S_in`` flow back through the exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.chunks import compute_dtype
from ..common.cp_exchange import chain_scan
from ._validate import ScanCall
from .reference import step_sizes


def _replace_row(t: torch.Tensor, i: int, row: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:i], row[None].to(t.dtype), t[i + 1:]])


def selective_scan_cp(call: ScanCall, local_op):
    """The CP version of :func:`mixers.ops.selective_scan_fn` (``call.varlen.cp`` set); ``local_op`` is
    the op itself, run on this rank's pieces without CP."""
    u, A, C = call.u, call.A, call.C
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    n, f = lay.num_docs, lay.first_seg[run.rank]
    channels, state = A.shape
    compute = compute_dtype(u.dtype)
    inits = None
    if call.initial_states is not None:     # + the tail; a continuing document's state was read where it started
        inits = torch.cat([call.initial_states, call.initial_states.new_zeros(1, channels, state)])
        if run.continues_in:
            inits = _replace_row(inits, f, inits.new_zeros(channels, state))
    res = local_op(u, call.delta, A, call.B, C, delta_bias=call.delta_bias, delta_softplus=call.delta_softplus,
                   return_last_state=True, initial_states=inits, cu_seqlens=run.local_cover,
                   return_varlen_states=call.return_varlen_states, chunk_size=call.chunk_size, backend=call.backend)
    y, row_final = res[0].to(compute), res[1][0].to(compute)                      # [1, E, T_r], [E, Ns]
    dt = step_sizes(call.delta, call.delta_bias, call.delta_softplus, compute)[0]  # [E, T_r]
    Ac = A.to(compute)
    closed = lay.last_starts_here
    element = None
    if run.continues_out:
        element = (None if closed[r] else torch.exp(dt.sum(-1)[:, None] * Ac), row_final)
    s_in = chain_scan(run, "selective_scan", element, closed, apply=lambda m, s: m * s,
                      compose=lambda later, early: later * early, s_shape=(channels, state),
                      m_shape=(channels, state), dtype=compute,
                      anchors=(u, call.delta, A, call.B, C, call.delta_bias, call.initial_states))
    decay = None
    if s_in is not None:
        t1 = run.first_len
        cum = dt[:, :t1].cumsum(-1)                                                  # [E, T1]
        carried = torch.exp(cum[:, :, None] * Ac[:, None, :]) * s_in[:, None, :]   # [E, T1, Ns]
        extra = torch.einsum("etn,nt->et", carried, C[0, :, :t1].to(compute))
        y = torch.cat([y[:, :, :t1] + extra[None], y[:, :, t1:]], dim=2)
        decay = torch.exp(cum[:, -1:] * Ac)                                          # [E, Ns]
    if call.D is not None:
        y = y + u.to(compute) * call.D.to(compute)[:, None]
    if call.z is not None:
        y = y * F.silu(call.z.to(compute))
    results = [run.anchor(y.to(u.dtype))]
    if call.return_last_state:         # the row's final state: the last rank's
        if decay is not None and lay.first_seg[r] == lay.last_seg[r]:
            row_final = row_final + decay * s_in
        if r != lay.size - 1:
            row_final = torch.zeros_like(row_final)
        results.append(row_final[None].to(u.dtype))
    if call.return_varlen_states:
        states = res[2].to(compute)
        if decay is not None and f < n:
            states = _replace_row(states, f, states[f] + decay * s_in)
        results.append(run.mask_owned(states[:n]).to(u.dtype))
    return results[0] if len(results) == 1 else tuple(results)
