"""Backward of :class:`.chunk_scan.SSDChunkScan` (same notation and shapes).

Reverse of the forward, block by block from the last: (1) the entering-state read ``y_off``,
(2) the state passing, backwards over the block's chunks (a state's gradient carried from block
to block along a row), (3) the chunk states and the intra-chunk term, recomputing the ``L x L``
decay instead of storing it. The entering states' gradients live one block at a time unless the
caller asked for the chunk states' (``extra_u``).
"""

from __future__ import annotations

import torch

from .chunk_scan_parts import (
    _blocks,
    _cols_to_heads,
    _decay,
    _floats,
    _group_major,
    _heads_to_cols,
    _largest,
    _pass_factors,
    _span,
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


def _unpass_states(g_h, g_state, h_enter, factor):
    """Backward of ``h_enter[c+1] = factor[c] * h_enter[c] + u[c]`` over one block's chunks
    ``[R, C', ...]`` (:func:`.chunk_scan._pass_states`): ``g_h`` holds the gradients reaching the
    entering states from elsewhere and is overwritten with ``u``'s (chunk c's is read before its
    slot takes ``g_u[c]``); ``g_state [R, H, P, Ns]`` is the gradient of the state leaving the last
    chunk and is updated in place to that of the state entering the first. Returns ``factor``'s
    gradient ``[R, C', H]``."""
    g_factor = g_h.new_empty(g_h.shape[:3])
    cur, nxt = g_state, torch.empty_like(g_state)
    for ci in range(g_h.shape[1] - 1, -1, -1):
        g_factor[:, ci] = (cur * h_enter[:, ci]).sum((-1, -2))
        torch.addcmul(g_h[:, ci], cur, factor[:, ci], out=nxt)
        g_h[:, ci] = cur
        cur, nxt = nxt, cur
    if cur is not g_state:
        g_state.copy_(cur)
    return g_factor


def chunk_scan_backward(ctx, g_out, g_enter, g_final):
    (x, dt, a, Bm, Cm, keep, last, reads, keep_state, h_enter, D, z, pre_gate) = ctx.saved_tensors
    assert h_enter is not None, "the forward ran with keep_enter=False, so it kept no entering states"
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
    factor = _pass_factors(a, keep_state, L)
    g_enterq = None if g_enter is None else g_enter.reshape(q, h, p, ns)
    g_state = x.new_zeros(ctx.final_shape) if g_final is None else g_final.to(x.dtype, copy=True)
    blocks = _blocks(b, c, h * L * L)
    # the chunk states' gradients: all of them when the caller's extra_u wants them, else one block's
    whole = ctx.needs_input_grad[10]
    most = _largest(blocks)
    g_u = x.new_empty(q if whole else most, h, p, ns)
    g_x, g_dt = torch.empty_like(xq), torch.empty_like(dtq)
    Dv = None if D is None else (D.unsqueeze(-1) if D.dim() == 1 else D)        # [H, 1] or [H, P]
    g_Dv = None if D is None else torch.zeros(h, p, dtype=x.dtype, device=x.device)
    bufs = [x.new_empty(most, h, L, L) for _ in range(3)] + [x.new_empty(most, h, L, p)]
    for block in reversed(blocks):
        r0, r1, c0, c1 = block
        q0, q1 = _span(block, c)
        k = q1 - q0
        bg, cg = _group_major(bq[q0:q1]), _group_major(cq[q0:q1])                # [K, G, L, Ns]
        # 1. the entering-state read y_off = w_off * (C . h_enter), with d y_off / d a = y_off (recomputed)
        g_h = g_u[q0:q1] if whole else g_u[:k]
        w_off = read_weights(aq[q0:q1], readf[q0:q1])
        gw = gyq[q0:q1] * w_off.unsqueeze(-1)                                     # [K, L, H, P]
        torch.matmul(_heads_to_cols(gw, g).transpose(-1, -2), cg, out=_state_rows(g_h, g))
        # per head m = gw h_enter [L, Ns]: summed over a group's heads it is g_C's term, dotted
        # with C it is sum_p gy y_off (a's gradient through y_off = w_off C . h_enter): one product
        m = torch.matmul(gw.transpose(1, 2), hq[q0:q1]).view(k, g, h // g, L, ns)  # [K, G, R, L, Ns]
        g_C[q0:q1] += m.sum(2).transpose(1, 2)
        g_a[q0:q1] += (m * cg.unsqueeze(2)).sum(-1).view(k, h, L).transpose(1, 2)
        # 2. the state passing, backwards over the block's chunks (g_h becomes the chunk states')
        if g_enterq is not None:
            g_h += g_enterq[q0:q1]
        rows, cols = r1 - r0, c1 - c0             # g_state's rows: the gradient carried along each row
        g_factor = _unpass_states(g_h.view(rows, cols, h, p, ns), g_state[r0:r1],
                                  hq[q0:q1].view(rows, cols, h, p, ns), factor[q0:q1].view(rows, cols, h, 1, 1))
        g_a[q0:q1, -1] += g_factor.view(k, h) * factor[q0:q1]
        # 3. chunk states and the intra-chunk term
        xdt_hm = torch.mul(xq[q0:q1].transpose(1, 2), dtq[q0:q1].transpose(1, 2).unsqueeze(-1), out=bufs[3][:k])
        w_state = state_weights(aq[q0:q1], lastf[q0:q1])
        dtw = dtq[q0:q1] * w_state                                               # [K, L, H]
        gu_rows = _state_rows(g_h, g)                                            # [K, G, R*P, Ns]
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
    g_extra = g_u.view(b, c, h, p, ns) if whole else None
    return (g_x, g_dt.reshape(b, t, h), g_a.reshape(b, t, h), g_B.reshape(b, t, g, ns), g_C.reshape(b, t, g, ns),
            None, None, None, None, g_state, g_extra, g_D, g_z, None, None)
