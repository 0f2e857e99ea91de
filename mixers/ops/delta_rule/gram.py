"""The two decayed Gram matrices of a chunk, computed together.

    N = chunks x heads (batched), L = chunk length, K = key dim, Kg = 1 (scalar gate) or K

    qk[t, s] = sum_c q_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])      (s <= t)
    kk[t, s] = sum_c k_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])      (s <  t)

Only pairs of one segment are kept; all others are exactly 0. ``g`` are the per-token log-decays
(<= 0, floored at :data:`.._chunks.LOG_DECAY_FLOOR`, so a reset ``-inf`` is a large finite value).

Every decay is the exponential of a sum over exactly its interval ``(s, t]``, never of the
difference ``G_t - G_s`` of two cumulative sums: that difference loses ``ulp(|G|)``, i.e. all
precision once one gate of the chunk is large (``|g| ~ 1e3`` in fp32 leaves ~1e-4 absolute error
in the exponent of every later pair). A sum of same-signed terms has a small *relative* error, so
a decay that matters is as exact as the step recurrence's product of ``exp(g)``.

* Scalar gate (GDN): the interval sums are one cumulative sum down the rows of the strictly
  lower-triangular ``[t, s] -> g_t`` matrix; masked before ``exp``, shared by both products.
* Per-channel gate (KDA): ``exp(sum_(s,t])`` differs per channel, so it cannot leave the sum.
  It is split at a reference position ``r`` between ``s`` and ``t``:
  ``exp(sum_(r,t]) * exp(sum_(s,r])``, both factors <= 1 (no overflow, and an underflow only
  where the true value is smaller still), each a local cumulative sum inside its half block.
  Halving the chunk recursively puts every pair ``s < t`` in exactly one (upper half, lower
  half) block whose split point lies between them, and each block is one batched matmul (q and k
  rows stacked, sharing the k factor). A pair from two segments is excluded by zeroing the
  factor rows whose segment differs from the reference's.

The backward is written out for both (the recursion runs again on the output gradients). It
returns the gradient with respect to the cumulative log-decay ``G`` (the interval sums are
``G_t - G_s`` mathematically), which autograd carries on through ``G``'s own cumulative sum.
"""

from __future__ import annotations

import torch

from .._chunks import same_segment_causal


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


def _local_sums(gate, block):
    """Per block: ``sum_(r, t]`` for the upper half's ``t`` and ``sum_(s, r]`` for the lower
    half's ``s`` (``r`` the lower half's last token), ``[N, L/block, half, Kg]`` each."""
    n, length = gate.shape[:2]
    half = block // 2
    blocks = gate.reshape(n, length // block, block, gate.shape[-1])
    up = torch.cumsum(blocks[:, :, half:], dim=2)
    incl = torch.cumsum(blocks[:, :, :half].flip(2), dim=2).flip(2)                  # sum_[s, r]
    lo = torch.cat([incl[:, :, 1:], torch.zeros_like(incl[:, :, :1])], dim=2)
    return up, lo


def _factors(q, k, gate, seg, block):
    """One recursion level: left factors of q and k (upper halves), the right factor of k
    (lower halves), and the two exp factors, ``[N, L/block, half, K]`` each."""
    up, lo = _local_sums(gate, block)
    s_up, s_lo, s_ref = _halves(seg, block)
    keep_up = (s_up == s_ref.unsqueeze(-1)).unsqueeze(-1).to(gate.dtype)
    keep_lo = (s_lo == s_ref.unsqueeze(-1)).unsqueeze(-1).to(gate.dtype)
    e_up = _exp_masked(up, keep_up)
    e_lo = _exp_masked(lo, keep_lo)
    return _halves(q, block)[0] * e_up, _halves(k, block)[0] * e_up, _halves(k, block)[1] * e_lo, e_up, e_lo


class DecayedGrams(torch.autograd.Function):
    """``(q [N,L,K], k [N,L,K], G [N,L,Kg], seg [N,L], gate [N,L,Kg]) -> (qk [N,L,L], kk [N,L,L])``.

    ``gate`` are the per-token log-decays the values are computed from; ``G`` (their segmented
    cumulative sum) only receives the gradient.
    """

    @staticmethod
    def forward(ctx, q, k, G, seg, gate):
        n, length, _ = k.shape
        ctx.scalar = gate.shape[-1] == 1
        if ctx.scalar:
            intervals = torch.cumsum(gate.expand(n, length, length).tril(-1), dim=1)   # sum_(s, t]
            decay = _exp_masked(intervals, same_segment_causal(seg).to(gate.dtype))
            qk = (q @ k.transpose(1, 2)).mul_(decay)
            kk = (k @ k.transpose(1, 2)).mul_(decay)
            kk.diagonal(dim1=1, dim2=2).zero_()
            ctx.save_for_backward(q, k, decay, qk, kk)
            return qk, kk
        qk, kk = k.new_zeros(n, length, length), k.new_zeros(n, length, length)
        block = length
        while block >= 2:
            left_q, left_k, right, _, _ = _factors(q, k, gate, seg, block)
            both = torch.cat([left_q, left_k], dim=2) @ right.transpose(-1, -2)    # [N, L/b, 2*half, half]
            half = block // 2
            _quadrant(qk, block).copy_(both[:, :, :half])
            _quadrant(kk, block).copy_(both[:, :, half:])
            block //= 2
        qk.diagonal(dim1=1, dim2=2).copy_((q * k).sum(-1))
        ctx.save_for_backward(q, k, gate, seg)
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
            return dq, dk, (dd.sum(-1) - dd.sum(-2)).unsqueeze(-1), None, None
        return (*_per_channel_backward(ctx, d_qk, d_kk), None)


def _per_channel_backward(ctx, d_qk, d_kk):
    q, k, gate, seg = ctx.saved_tensors
    dq, dk, dg = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(gate)   # dg: w.r.t. G
    block = k.shape[1]
    while block >= 2:
        left_q, left_k, right, e_up, e_lo = _factors(q, k, gate, seg, block)
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
