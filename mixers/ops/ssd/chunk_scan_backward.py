"""Backward of :class:`.chunk_scan.SSDChunkScan` (same notation and shapes).

Reverse of the forward, in three passes: (1) the entering-state read ``y_off`` per block,
(2) the state passing, backwards over chunks, (3) the chunk states and the intra-chunk term per
block, recomputing the ``L x L`` decay instead of storing it.
"""

from __future__ import annotations

import torch

from .chunk_scan import (
    _blocks,
    _cols_to_heads,
    _decay,
    _floats,
    _group_major,
    _heads_to_cols,
    _state_rows,
    read_weights,
    state_weights,
)


def _gate(g_out, z, pre_gate):
    """Gradients through ``out = pre_gate * silu(z)``: returns ``(g_pre_gate, g_z)``."""
    if z is None:
        return g_out.contiguous(), None
    sig = torch.sigmoid(z)
    g_z = g_out * pre_gate * sig * (1 + z * (1 - sig))
    return (g_out * (z * sig)).contiguous(), g_z


def _unpass_states(g_enter, g_final, h_enter, decay, keep_state):
    """Backward of ``h_enter[c+1] = keep * decay * h_enter[c] + u[c]``: ``(g_u, g_decay, g_h0)``.

    ``g_u`` is written over ``g_enter`` (the caller's own buffer; chunk c's ``g_enter`` is read
    before its slot takes ``g_u[c]``)."""
    b, c = h_enter.shape[:2]
    factor = (decay * keep_state.unsqueeze(-1)).reshape(b, c, -1, 1, 1)
    g_factor = torch.empty_like(decay)
    g, nxt = g_final.to(h_enter.dtype, copy=True), torch.empty_like(h_enter[:, 0])
    for ci in range(c - 1, -1, -1):
        g_factor[:, ci] = (g * h_enter[:, ci]).sum((-1, -2))
        torch.addcmul(g_enter[:, ci], g, factor[:, ci], out=nxt)
        g_enter[:, ci] = g
        g, nxt = nxt, g
    return g_enter, g_factor * keep_state.unsqueeze(-1), g


def chunk_scan_backward(ctx, g_out, g_enter, g_final):
    (x, dt, a, Bm, Cm, keep, last, reads, keep_state, h_enter, D, z, pre_gate) = ctx.saved_tensors
    b, t, h, p = x.shape
    g, ns = Bm.shape[2:]
    L = ctx.chunk
    c = t // L
    q = b * c
    if g_out is None:
        g_out = torch.zeros_like(x)
    g_y, g_z = _gate(g_out, z, pre_gate)          # g_y: gradient of y + D x
    xq, dtq, aq = x.reshape(q, L, h, p), dt.reshape(q, L, h), a.reshape(q, L, h)
    bq, cq, gyq = Bm.reshape(q, L, g, ns), Cm.reshape(q, L, g, ns), g_y.reshape(q, L, h, p)
    lastf, readf = last.to(x.dtype).unsqueeze(-1), reads.to(x.dtype).unsqueeze(-1)
    hq = h_enter.reshape(q, h, p, ns)
    g_a = torch.zeros(q, L, h, dtype=x.dtype, device=x.device)
    g_B, g_C = torch.zeros_like(bq), torch.zeros_like(cq)
    g_h = torch.empty_like(hq)
    # 1. the entering-state read y_off = w_off * (C . h_enter), with d y_off / d a = y_off (recomputed)
    for q0, q1 in _blocks(q, h * L * L):
        k = q1 - q0
        cg = _group_major(cq[q0:q1])                                             # [K, G, L, Ns]
        w_off = read_weights(aq[q0:q1], readf[q0:q1])
        gw = gyq[q0:q1] * w_off.unsqueeze(-1)                                     # [K, L, H, P]
        torch.matmul(_heads_to_cols(gw, g).transpose(-1, -2), cg, out=_state_rows(g_h[q0:q1], g))
        # per head m = gw h_enter [L, Ns]: summed over a group's heads it is g_C's term, dotted
        # with C it is sum_p gy y_off (a's gradient through y_off = w_off C . h_enter): one product
        m = torch.matmul(gw.transpose(1, 2), hq[q0:q1]).view(k, g, h // g, L, ns)  # [K, G, R, L, Ns]
        g_C[q0:q1] += m.sum(2).transpose(1, 2)
        g_a[q0:q1] += (m * cg.unsqueeze(2)).sum(-1).view(k, h, L).transpose(1, 2)
    # 2. the state passing, backwards over chunks
    g_h = g_h.reshape(b, c, h, p, ns)
    if g_enter is not None:
        g_h += g_enter
    decay = torch.exp(a.reshape(b, c, L, h)[:, :, -1])
    g_final = x.new_zeros(ctx.final_shape) if g_final is None else g_final
    g_u, g_decay, g_h0 = _unpass_states(g_h, g_final, h_enter, decay, keep_state)
    del g_h
    g_a.reshape(b, c, L, h)[:, :, -1] += g_decay * decay
    g_uq = g_u.reshape(q, h, p, ns)
    # 3. chunk states and the intra-chunk term
    g_x, g_dt = torch.empty_like(xq), torch.empty_like(dtq)
    Dv = None if D is None else (D.unsqueeze(-1) if D.dim() == 1 else D)        # [H, 1] or [H, P]
    g_Dv = None if D is None else torch.zeros(h, p, dtype=x.dtype, device=x.device)
    bufs = None
    for q0, q1 in _blocks(q, h * L * L):
        k = q1 - q0
        if bufs is None:
            bufs = [x.new_empty(k, h, L, L) for _ in range(3)] + [x.new_empty(k, h, L, p)]
        xdt_hm = torch.mul(xq[q0:q1].transpose(1, 2), dtq[q0:q1].transpose(1, 2).unsqueeze(-1), out=bufs[3][:k])
        bg, cg = _group_major(bq[q0:q1]), _group_major(cq[q0:q1])
        w_state = state_weights(aq[q0:q1], lastf[q0:q1])
        dtw = dtq[q0:q1] * w_state                                               # [K, L, H]
        gu_rows = _state_rows(g_uq[q0:q1], g)                                    # [K, G, R*P, Ns]
        g_xw = _cols_to_heads(bg @ gu_rows.transpose(-1, -2), h)                 # [K, L, H, P]
        g_B[q0:q1] += (_heads_to_cols(xq[q0:q1] * dtw.unsqueeze(-1), g) @ gu_rows).transpose(1, 2)
        g_xdt = g_xw * w_state.unsqueeze(-1)
        gw = (g_xw * xq[q0:q1]).sum(-1) * dtw                                    # [K, L, H]
        g_a[q0:q1, -1] += gw.sum(1)
        g_a[q0:q1] -= gw
        decay_blk = _decay(aq[q0:q1].transpose(1, 2), _floats(keep[q0:q1], x.dtype), bufs[0][:k])
        cb = (cg @ bg.transpose(-1, -2)).unsqueeze(2)                            # [K, G, 1, L, L]
        scores = torch.mul(decay_blk.view(k, g, h // g, L, L), cb, out=bufs[1][:k].view(k, g, h // g, L, L))
        gy_hm = gyq[q0:q1].transpose(1, 2).contiguous()
        g_xdt += (scores.view(k, h, L, L).transpose(-1, -2) @ gy_hm).transpose(1, 2)
        dsd = torch.matmul(gy_hm, xdt_hm.transpose(-1, -2), out=bufs[2][:k]).mul_(decay_blk)
        dcb = dsd.view(k, g, h // g, L, L).sum(2)                                # [K, G, L, L]
        dsd.view(k, g, h // g, L, L).mul_(cb)
        g_a[q0:q1] += (dsd.sum(-1) - dsd.sum(-2)).transpose(1, 2)
        g_C[q0:q1] += (dcb @ bg).transpose(1, 2)
        g_B[q0:q1] += (dcb.transpose(-1, -2) @ cg).transpose(1, 2)
        g_dt[q0:q1] = (g_xdt * xq[q0:q1]).sum(-1)
        g_xb = torch.mul(g_xdt, dtq[q0:q1].unsqueeze(-1), out=g_x[q0:q1])
        if D is not None:                        # the skip: out = y + D x
            g_xb.addcmul_(gyq[q0:q1], Dv)
            g_Dv += (gyq[q0:q1] * xq[q0:q1]).sum((0, 1))
    g_x = g_x.reshape(b, t, h, p)
    g_D = None if D is None else (g_Dv.sum(-1) if D.dim() == 1 else g_Dv)
    g_extra = g_u if ctx.needs_input_grad[10] else None
    return (g_x, g_dt.reshape(b, t, h), g_a.reshape(b, t, h), g_B.reshape(b, t, g, ns), g_C.reshape(b, t, g, ns),
            None, None, None, None, g_h0, g_extra, g_D, g_z, None)
