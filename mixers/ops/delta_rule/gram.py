"""The two decayed Gram matrices of a chunk, computed together.

    N = chunks x heads (batched), L = chunk length, K = key dim, Kg = 1 (scalar gate) or K

    qk[t, s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])      (s <= t)
    kk[t, s] = sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])      (s <  t)

Only pairs of one segment are kept; all others are exactly 0. ``G`` is the segmented cumulative
log-decay (non-increasing inside a segment: log-decays are <= 0).

* Scalar gate (GDN): ``(q k^T) * exp(G_t - G_s)``, the exponent masked before ``exp``; the
  decay matrix is shared by both products.
* Per-channel gate (KDA): ``exp(G_t - G_s)`` differs per channel, so it cannot leave the sum.
  It is split at a reference position ``r`` between ``s`` and ``t``:
  ``exp(G_t - G_r) * exp(G_r - G_s)``, both factors <= 1 (no overflow, and an underflow only
  where the true value is smaller still). Halving the chunk recursively puts every pair
  ``s < t`` in exactly one (upper half, lower half) block whose split point lies between them,
  and each block is one batched matmul (q and k rows stacked, sharing the k factor). A pair
  from two segments is excluded by zeroing the factor rows whose segment differs from the
  reference's.

The backward is written out for both (the recursion runs again on the output gradients).
"""

from __future__ import annotations

import torch

from ..chunks import same_segment_causal


def _exp_masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``keep``, exactly 0 elsewhere (no ``-inf`` or overflow reaches ``exp``)."""
    return torch.exp(x * keep).mul_(keep)


def _quadrant(m: torch.Tensor, block: int) -> torch.Tensor:
    """View of the lower-left quadrant of every diagonal ``block x block`` block of ``[N, L, L]``."""
    n, length, _ = m.shape
    half = block // 2
    return m.as_strided((n, length // block, half, half), (length * length, block * length + block, length, 1),
                        m.storage_offset() + half * length)


def _halves(t: torch.Tensor, block: int):
    """``[N, L, X]`` -> (upper halves, lower halves, last row of each lower half) per block."""
    n, length = t.shape[:2]
    half = block // 2
    blocks = t.reshape(n, length // block, block, *t.shape[2:])
    return blocks[:, :, half:], blocks[:, :, :half], blocks[:, :, half - 1]


def _factors(q, k, g, seg, block):
    """One recursion level: left factors of q and k (upper halves), the right factor of k
    (lower halves), and the two exp factors, ``[N, L/block, half, K]`` each."""
    g_up, g_lo, g_ref = _halves(g, block)
    s_up, s_lo, s_ref = _halves(seg, block)
    keep_up = (s_up == s_ref.unsqueeze(-1)).unsqueeze(-1).to(g.dtype)
    keep_lo = (s_lo == s_ref.unsqueeze(-1)).unsqueeze(-1).to(g.dtype)
    e_up = _exp_masked(g_up - g_ref.unsqueeze(2), keep_up)
    e_lo = _exp_masked(g_ref.unsqueeze(2) - g_lo, keep_lo)
    return _halves(q, block)[0] * e_up, _halves(k, block)[0] * e_up, _halves(k, block)[1] * e_lo, e_up, e_lo


class DecayedGrams(torch.autograd.Function):
    """``(q [N,L,K], k [N,L,K], G [N,L,Kg], seg [N,L]) -> (qk [N,L,L], kk [N,L,L])``."""

    @staticmethod
    def forward(ctx, q, k, g, seg):
        n, length, _ = k.shape
        ctx.scalar = g.shape[-1] == 1
        if ctx.scalar:
            decay = _exp_masked(g - g.transpose(1, 2), same_segment_causal(seg).to(g.dtype))
            qk = (q @ k.transpose(1, 2)).mul_(decay)
            kk = (k @ k.transpose(1, 2)).mul_(decay)
            kk.diagonal(dim1=1, dim2=2).zero_()
            ctx.save_for_backward(q, k, decay, qk, kk)
            return qk, kk
        qk, kk = k.new_zeros(n, length, length), k.new_zeros(n, length, length)
        block = length
        while block >= 2:
            left_q, left_k, right, _, _ = _factors(q, k, g, seg, block)
            both = torch.cat([left_q, left_k], dim=2) @ right.transpose(-1, -2)    # [N, L/b, 2*half, half]
            half = block // 2
            _quadrant(qk, block).copy_(both[:, :, :half])
            _quadrant(kk, block).copy_(both[:, :, half:])
            block //= 2
        qk.diagonal(dim1=1, dim2=2).copy_((q * k).sum(-1))
        ctx.save_for_backward(q, k, g, seg)
        return qk, kk

    @staticmethod
    def backward(ctx, d_qk, d_kk):
        k = ctx.saved_tensors[1]
        square = (k.shape[0], k.shape[1], k.shape[1])
        d_qk = k.new_zeros(square) if d_qk is None else d_qk.contiguous()
        d_kk = k.new_zeros(square) if d_kk is None else d_kk.contiguous()
        if ctx.scalar:
            q, k, decay, qk, kk = ctx.saved_tensors
            s_q, s_k = d_qk * decay, d_kk * decay
            s_k.diagonal(dim1=1, dim2=2).zero_()                         # kk has no diagonal
            dd = d_qk * qk + d_kk * kk                                   # d/d(G_t - G_s) on kept pairs
            dq = s_q @ k
            dk = s_q.transpose(1, 2) @ q + s_k @ k + s_k.transpose(1, 2) @ k
            return dq, dk, (dd.sum(-1) - dd.sum(-2)).unsqueeze(-1), None
        return _per_channel_backward(ctx, d_qk, d_kk)


def _per_channel_backward(ctx, d_qk, d_kk):
    q, k, g, seg = ctx.saved_tensors
    dq, dk, dg = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(g)
    block = k.shape[1]
    while block >= 2:
        left_q, left_k, right, e_up, e_lo = _factors(q, k, g, seg, block)
        b_qk, b_kk = _quadrant(d_qk, block), _quadrant(d_kk, block)             # [N, L/b, half, half]
        d_left_q, d_left_k = b_qk @ right, b_kk @ right
        d_right = b_qk.transpose(-1, -2) @ left_q + b_kk.transpose(-1, -2) @ left_k
        _halves(dq, block)[0].add_(d_left_q * e_up)
        _halves(dk, block)[0].add_(d_left_k * e_up)
        _halves(dk, block)[1].add_(d_right * e_lo)
        dg_up, dg_lo, dg_ref = _halves(dg, block)
        up = d_left_q * left_q + d_left_k * left_k
        lo = d_right * right
        dg_up += up
        dg_lo -= lo
        dg_ref += lo.sum(2) - up.sum(2)
        block //= 2
    dd = d_qk.diagonal(dim1=1, dim2=2).unsqueeze(-1)
    dq += dd * k
    dk += dd * q
    return dq, dk, dg, None
