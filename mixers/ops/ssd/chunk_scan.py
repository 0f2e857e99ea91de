"""The SSD chunk scan as one autograd function with a hand-written backward.

    Q = B * C chunks (rows x chunks, flattened), L = chunk length, H = heads, P = head dim,
    G = groups, R = H // G, Ns = state size, K = chunks in one block

Math (per chunk, tokens l, s; masks from the segment ids, see :mod:`.reference`):

    xdt[s]   = x[s] * dt[s]
    y[l]     = sum_s keep[l,s] exp(a[l] - a[s]) (C_l . B_s) xdt[s]          (intra-chunk)
             + reads[l] exp(a[l]) C_l . h_enter                             (entering state)
    u        = sum_s last[s] exp(a[L-1] - a[s]) xdt[s] B_s^T (+ extra_u)    (chunk state)
    h_enter[c+1] = keep_state[c] exp(a[L-1]) h_enter[c] + u[c]
    out      = (y + D x) * silu(z)

Autograd through these steps allocates many ``[Q, H, L, L]`` and ``[T, H, P]`` tensors; on a
CPU the page faults of those allocations cost more than the arithmetic. Here all steps run
block by block, K chunks at a time in buffers that stay in cache, the state carried from block to
block along each row and passed in place; nothing ``L x L`` is kept for backward (it is
recomputed), and the entering states are kept whole only when the backward or the caller reads
them (else one block's at a time: ``H P Ns / L`` numbers per token fewer, 2 KB at H = 16,
P = Ns = 64, L = 128). Masks multiply exact zeros into every
cross-document term, so documents stay bitwise independent: exact because every value here is
finite (the caller sanitizes non-finite inputs and output gradients, see :mod:`mixers.ops.common.isolation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk_scan_backward import chunk_scan_backward
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


class SSDChunkScan(torch.autograd.Function):
    """``(out [B,T,H,P], h_enter [B,C,H,P,Ns], h_final [B,H,P,Ns])``; inputs padded to ``C * L``;
    ``h_enter`` is None unless ``keep_enter`` (which a forward that records gradients needs).

    Args (forward): x ``[B,T,H,P]``, dt ``[B,T,H]``, a ``[B,T,H]`` (segmented cumulative
    log-decay), Bm / Cm ``[B,T,G,Ns]``, keep ``[Q,L,L]`` bool, last / reads ``[Q,L]`` bool,
    keep_state ``[B,C]`` bool, h0 ``[B,H,P,Ns]``, extra_u ``[B,C,H,P,Ns]`` or None, D ``[H]`` /
    ``[H,P]`` or None, z ``[B,T,H,P]`` or None, chunk (int), keep_enter (bool).
    """

    @staticmethod
    def forward(ctx, x, dt, a, Bm, Cm, keep, last, reads, keep_state, h0, extra_u, D, z, chunk, keep_enter):
        b, t, h, p = x.shape
        g, ns = Bm.shape[2:]
        c, L = t // chunk, chunk
        q = b * c
        xq, dtq, aq = x.reshape(q, L, h, p), dt.reshape(q, L, h), a.reshape(q, L, h)
        bq, cq = Bm.reshape(q, L, g, ns), Cm.reshape(q, L, g, ns)
        lastf, readf = last.to(x.dtype).unsqueeze(-1), reads.to(x.dtype).unsqueeze(-1)
        out = torch.empty(q, L, h, p, dtype=x.dtype, device=x.device)
        blocks = _blocks(b, c, h * L * L)
        # the states entering the chunks: all of them when the backward or the caller reads them
        # (the caller says so: ``needs_input_grad`` cannot tell a forward under no_grad), else one
        # block's at a time (a sequence-sized buffer costs a page fault per 4 KB)
        whole = keep_enter
        most = _largest(blocks)
        h_enter = x.new_empty(q if whole else most, h, p, ns)
        extra = None if extra_u is None else extra_u.reshape(q, h, p, ns)
        factor = _pass_factors(a, keep_state, L).view(q, h, 1, 1)
        h_final = h0.to(x.dtype, copy=True)                 # carried over each row's blocks
        buf, xdt_hm = x.new_empty(most, h, L, L), x.new_empty(most, h, L, p)
        for block in blocks:
            r0, r1, c0, c1 = block
            q0, q1 = _span(block, c)
            k = q1 - q0
            # 2. intra-chunk output and 3. chunk states
            x_hm = xq[q0:q1].transpose(1, 2)
            xdt = torch.mul(x_hm, dtq[q0:q1].transpose(1, 2).unsqueeze(-1), out=xdt_hm[:k])  # [K, H, L, P]
            bg, cg = _group_major(bq[q0:q1]), _group_major(cq[q0:q1])
            scores = _decay(aq[q0:q1].transpose(1, 2), _floats(keep[q0:q1], x.dtype), buf[:k])
            scores.view(k, g, h // g, L, L).mul_((cg @ bg.transpose(-1, -2)).unsqueeze(2))
            out[q0:q1] = (scores @ xdt).transpose(1, 2)
            w_state = state_weights(aq[q0:q1], lastf[q0:q1])
            xw = xq[q0:q1] * (dtq[q0:q1] * w_state).unsqueeze(-1)                  # [K, L, H, P]
            u = h_enter[q0:q1] if whole else h_enter[:k]
            torch.matmul(_heads_to_cols(xw, g).transpose(-1, -2), bg, out=_state_rows(u, g))
            if extra is not None:
                u += extra[q0:q1]
            # 4. state passing over the block's chunks (u becomes the entering states)
            _pass_states(u.view(r1 - r0, c1 - c0, h, p, ns), factor[q0:q1].view(r1 - r0, c1 - c0, h, 1, 1),
                         h_final[r0:r1])
            # 5. the entering-state read
            w_off = read_weights(aq[q0:q1], readf[q0:q1])
            read = cg @ _state_rows(u, g).transpose(-1, -2)                            # [K, G, L, R*P]
            out[q0:q1] += _cols_to_heads(read, h).mul_(w_off.unsqueeze(-1))
        h_enter = h_enter.view(b, c, h, p, ns) if whole else None
        out = out.reshape(b, t, h, p)
        if D is not None:
            out.addcmul_(x, D.unsqueeze(-1) if D.dim() == 1 else D)
        pre_gate = None
        if z is not None:
            pre_gate = out
            out = out * F.silu(z)
        # h_final is returned to the caller, who may modify it in place: keep only its shape
        ctx.final_shape = h_final.shape
        ctx.save_for_backward(x, dt, a, Bm, Cm, keep, last, reads, keep_state, h_enter, D, z, pre_gate)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)      # an unused output's gradient arrives as None, not zeros
        return out, h_enter, h_final

    @staticmethod
    def backward(ctx, g_out, g_enter, g_final):
        return chunk_scan_backward(ctx, g_out, g_enter, g_final)


def _pass_states(u: torch.Tensor, factor: torch.Tensor, state: torch.Tensor) -> None:
    """``h_enter[c+1] = factor[c] * h_enter[c] + u[c]`` over ``u [R, C', H, P, Ns]``, written over
    ``u`` (chunk c's ``u`` is read before its slot takes ``h_enter[c]``): no second buffer.
    ``factor [R, C', H, 1, 1]``; ``state [R, H, P, Ns]`` enters the first chunk and is updated in
    place to the state leaving the last."""
    cur, nxt = state, torch.empty_like(state)
    for ci in range(u.shape[1]):
        torch.addcmul(u[:, ci], cur, factor[:, ci], out=nxt)
        u[:, ci] = cur
        cur, nxt = nxt, cur
    if cur is not state:
        state.copy_(cur)
