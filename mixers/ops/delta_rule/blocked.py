"""The chunked delta rule over blocks of chunks, with block checkpointing (the fast path).

    B = rows, C = chunks, H = heads, L = chunk length, K, V = head dims, Kg = 1 or K

Autograd through all chunks at once keeps many ``[B, C, H, L, L]`` / ``[B, C, H, K, V]`` tensors
alive; on a CPU, allocating those costs more than the arithmetic. Here the chunks are processed
block by block: :func:`.prep.chunk_prep` for the block, then the state recurrence chunk by chunk
inside it, then the block's outputs. Only the state entering each block is kept. The backward
walks the blocks in reverse: it recomputes the block's preparation under autograd, replays the
recurrence from the block's checkpoint, runs the recurrence backwards by hand, and hands the
gradients of the preparation's outputs to autograd.

Like every mixing step of the references, the masks here multiply exact zeros into the
cross-document terms; every value is finite (the caller sanitizes non-finite inputs and output
gradients, see :mod:`.._isolation`), so that is exact.
"""

from __future__ import annotations

import torch

from .prep import chunk_prep

_BLOCK_ELEMENTS = 1 << 20


def _block_size(rows: int, heads: int, length: int) -> int:
    return max(1, _BLOCK_ELEMENTS // (rows * heads * length * length))


def _bmm(a, b):
    """Batched matmul over all leading dims of ``a [.., M, N]`` and ``b [.., N, P]``."""
    return torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])).reshape(*a.shape[:-1], b.shape[-1])


def recurrence(U, w_read, k_out, kappa, state):
    """Run a block of chunks ``[B, k, ...]`` from ``state``: ``delta = U - w_read S``,
    ``S' = kappa S + k_out^T delta``. Returns (states entering each chunk, deltas, leaving state).

    Three fused ops per chunk, written into preallocated buffers (no allocation in the loop).
    """
    b, k, h, L, vd = U.shape
    kd = state.shape[-2]
    entering = torch.empty(k + 1, b, h, kd, vd, dtype=state.dtype, device=state.device)   # chunk-major:
    delta = torch.empty(k, b, h, L, vd, dtype=U.dtype, device=U.device)                 # contiguous slices
    entering[0] = state
    flat = (b * h,)
    for j in range(k):
        current, following = entering[j], entering[j + 1]
        d = torch.baddbmm(U[:, j].reshape(*flat, L, vd), w_read[:, j].reshape(*flat, L, kd),
                          current.view(*flat, kd, vd), alpha=-1, out=delta[j].view(*flat, L, vd))
        torch.mul(current, kappa[:, j], out=following)
        following.view(*flat, kd, vd).baddbmm_(k_out[:, j].reshape(*flat, L, kd).transpose(1, 2), d)
    return entering[:k].transpose(0, 1), delta.transpose(0, 1), entering[k]


class DeltaRuleBlocked(torch.autograd.Function):
    """``(qc, kc [B,C,H,L,K], vc [B,C,H,L,V], gc [B,C,H,L,Kg], bc [B,C,H,L], seg [B,C,L],
    enter_seg [B,C], h0 [B,H,K,V]) -> (o [B,C,H,L,V], S_final [B,H,K,V])``."""

    @staticmethod
    def forward(ctx, qc, kc, vc, gc, bc, seg, enter_seg, h0):
        b, c, h, L = kc.shape[:4]
        out = vc.new_empty(vc.shape)
        step = _block_size(b, h, L)
        state, checkpoints = h0, []
        for c0 in range(0, c, step):
            c1 = min(c0 + step, c)
            p = chunk_prep(qc[:, c0:c1], kc[:, c0:c1], vc[:, c0:c1], gc[:, c0:c1], bc[:, c0:c1], seg[:, c0:c1],
                           enter_seg[:, c0:c1])
            checkpoints.append(state)
            entering, delta, state = recurrence(p.U, p.w_read, p.k_out, p.kappa, state)
            out[:, c0:c1] = _bmm(p.q_read, entering) + _bmm(p.qk, delta)
        ctx.save_for_backward(qc, kc, vc, gc, bc, seg, enter_seg, torch.stack(checkpoints))
        ctx.step = step
        return out, state.clone()      # not a view of the recurrence's buffer: callers may modify it in place

    @staticmethod
    def backward(ctx, d_out, d_final):
        qc, kc, vc, gc, bc, seg, enter_seg, checkpoints = ctx.saved_tensors
        c = kc.shape[1]
        grads = [torch.zeros_like(t) for t in (qc, kc, vc, gc, bc)]
        d_state = torch.zeros_like(checkpoints[0]) if d_final is None else d_final.clone()
        d_out = torch.zeros_like(vc) if d_out is None else d_out.contiguous()
        starts = list(range(0, c, ctx.step))
        for index in range(len(starts) - 1, -1, -1):
            c0, c1 = starts[index], min(starts[index] + ctx.step, c)
            leaves = [t[:, c0:c1].detach().requires_grad_() for t in (qc, kc, vc, gc, bc)]
            with torch.enable_grad():
                p = chunk_prep(*leaves, seg[:, c0:c1], enter_seg[:, c0:c1])
            outputs = (p.q_read, p.w_read, p.U, p.qk, p.k_out, p.kappa)
            with torch.no_grad():
                d_state, d_outputs = _block_backward([t.detach() for t in outputs], checkpoints[index],
                                                     d_out[:, c0:c1], d_state)
            block_grads = torch.autograd.grad(outputs, leaves, d_outputs, allow_unused=True)
            for full, part in zip(grads, block_grads):
                if part is not None:
                    full[:, c0:c1] = part
        return (*grads, None, None, d_state)


def _block_backward(outputs, checkpoint, d_out, d_state):
    """The recurrence of one block, backwards: returns (gradient of the block's entering state,
    gradients of ``(q_read, w_read, U, qk, k_out, kappa)``)."""
    q_read, w_read, U, qk, k_out, kappa = outputs
    entering, delta, _ = recurrence(U, w_read, k_out, kappa, checkpoint)
    from_out = _bmm(qk.transpose(-1, -2), d_out)                                   # d delta from o = qk delta
    from_read = _bmm(q_read.transpose(-1, -2), d_out)                              # d S from o = q_read S
    k = U.shape[1]
    d_delta = torch.empty_like(delta)
    d_k_out = torch.empty_like(k_out)
    d_kappa = torch.empty_like(kappa)
    for j in range(k - 1, -1, -1):
        dd = from_out[:, j] + _bmm(k_out[:, j], d_state)
        d_delta[:, j] = dd
        d_k_out[:, j] = _bmm(delta[:, j], d_state.transpose(-1, -2))
        dk = (d_state * entering[:, j]).sum(-1, keepdim=True)                     # [B, H, K, 1]
        d_kappa[:, j] = dk if kappa.shape[-2] > 1 else dk.sum(-2, keepdim=True)
        d_state = kappa[:, j] * d_state + from_read[:, j] - _bmm(w_read[:, j].transpose(-1, -2), dd)
    d_w_read = -_bmm(d_delta, entering.transpose(-1, -2))
    d_q_read = _bmm(d_out, entering.transpose(-1, -2))
    d_qk = _bmm(d_out, delta.transpose(-1, -2))
    return d_state, (d_q_read, d_w_read, d_delta, d_qk, d_k_out, d_kappa)
