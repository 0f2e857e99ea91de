"""``rg_lru`` under context parallelism: state passing with a per-channel decay.

    T_r = this rank's tokens, T1 = tokens of its first segment, D = channels, N = documents

The recurrence ``h_t = a_t h_{t-1} + b_t`` maps a state entering a run of tokens (none of them a
reset) to ``(prod a) S_in + S_local``: the transition is one vector ``[D]``. Each rank

1. runs the op locally (:attr:`~ssm_pack.parallel.layout.ContextParallelRun.local_cover`),
   the segment continuing from an earlier rank marked ``continues`` from zero (its first token is
   no sequence start), every other document as the caller asked;
2. sends ``(prod a, S_local)`` of the segment leaving it through
   :func:`mixers.ops.common.cp_exchange.chain_scan`, which returns ``S_in [D]`` for its first
   segment;
3. adds ``(a_1 ... a_t) S_in`` to that segment's outputs and final state.

Composed in the compute dtype (fp32, fp64 for fp64 inputs); gradients of ``S_in`` flow back
through the exchange to the ranks it came from.
"""

from __future__ import annotations

import torch

from ..common.chunks import compute_dtype
from ..common.cp_exchange import chain_scan
from ._validate import RGLRUCall
from .gates import log_decay


def rg_lru_cp(call: RGLRUCall, local_op):
    """The CP version of :func:`mixers.ops.rg_lru.rg_lru` (``call.varlen.cp`` set). ``local_op`` is the
    op itself, run on this rank's pieces without CP."""
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    n, f = lay.num_docs, lay.first_seg[r]
    width = call.x.shape[-1]
    compute = compute_dtype(call.x.dtype)
    continues = torch.zeros(n + 1, dtype=torch.bool, device=call.x.device)      # + the tail
    if call.continues is not None:
        continues[:n] = call.continues
    inits = None
    if call.initial_state is not None:   # a continuing document's own state was read where it started
        inits = torch.cat([call.initial_state, call.initial_state.new_zeros(1, width)])
    if run.continues_in:
        continues[f] = True
        if inits is not None:
            inits = torch.cat([inits[:f], inits.new_zeros(1, width), inits[f + 1:]])
    y, finals = local_op(call.x, call.gate_x, call.gate_a, call.recurrent_param, scale=call.scale,
                         initial_state=inits, continues=continues, output_final_state=True,
                         cu_seqlens=run.local_cover, backend=call.backend)
    y, finals = y.to(compute), finals.to(compute)
    log_a = log_decay(call.gate_a[0].to(compute), call.recurrent_param.to(compute), call.scale)   # [T_r, D]
    closed = lay.last_starts_here
    element = None
    if run.continues_out:
        tail = log_a[log_a.shape[0] - lay.last_len[r]:]
        element = (None if closed[r] else torch.exp(tail.sum(0)), finals[lay.last_seg[r]])
    s_in = chain_scan(run, "rg_lru", element, closed, apply=lambda m, s: m * s,
                      compose=lambda later, early: later * early, s_shape=(width,), m_shape=(width,),
                      dtype=compute, anchors=(call.x, call.gate_x, call.gate_a, call.recurrent_param,
                                              call.initial_state))
    if s_in is not None:
        t1 = run.first_len
        carried = torch.exp(log_a[:t1].cumsum(0)) * s_in                        # [T1, D]
        y = torch.cat([y[:, :t1] + carried[None], y[:, t1:]], dim=1)
        if f < n:
            finals = torch.cat([finals[:f], (finals[f] + carried[-1])[None], finals[f + 1:]])
    out = run.anchor(y.to(call.x.dtype))
    if not call.output_final_state:
        return out, None
    return out, run.mask_owned(finals[:n])
