"""The two decayed Gram matrices of a chunk, computed together.

    N = chunks x heads (batched), L = chunk length, K = key dim, Kg = 1 (scalar gate) or K

    qk[t, s] = sum_c q_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])      (s <= t)
    kk[t, s] = sum_c k_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])      (s <  t)

Only pairs of one segment are kept; all others are exactly 0. ``g`` are the per-token log-decays
(<= 0; a reset ``g = -inf``, floored at :data:`..chunks.LOG_DECAY_FLOOR`, has ``exp(g) = 0``).

Every decay is the product of the per-token decays ``exp(g_u)`` over exactly its interval
``(s, t]``, never the exponential of the difference ``G_t - G_s`` of two cumulative sums: that
difference loses ``ulp(|G|)``, i.e. all precision once one gate of the chunk is large
(``|g| ~ 1e3`` in fp32 leaves ~1e-4 absolute error in the exponent of every later pair). A product
of factors <= 1 has a small *relative* error, like the step recurrence's.

* Scalar gate (GDN): the decay matrix, shared by both products, is built by the halving below:
  each (upper half, lower half) quadrant is the outer product of its two factors.
* Per-channel gate (KDA): ``exp(sum_(s,t])`` differs per channel, so it cannot leave the sum.
  It is split at a reference position ``r`` between ``s`` and ``t``:
  ``exp(sum_(r,t]) * exp(sum_(s,r])``, both factors <= 1 (no overflow, and an underflow only
  where the true value is smaller still), each a product inside its half block.
  Halving the chunk recursively puts every pair ``s < t`` in exactly one (upper half, lower
  half) block whose split point lies between them, and each block is one batched matmul (q and k
  rows stacked, sharing the k factor). A pair from two segments is excluded by zeroing the
  factor rows whose segment differs from the reference's. The factors of all levels come from
  one doubling pass (:class:`_Levels`), and so does the decay from each token to the chunk's
  end (the state leaving the chunk needs it).

The backward is written out for both (the recursion runs again on the output gradients). It
returns the gradient with respect to the cumulative log-decay ``G`` (the interval sums are
``G_t - G_s`` mathematically), which autograd carries on through ``G``'s own cumulative sum.
"""

from __future__ import annotations

import torch


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


class _Levels:
    """For ``block = 2, 4, ..., L``: ``(block, up, lo)``, ``[N, L/block, half, Kg]`` each, with
    ``up = exp(sum_(r, t] g)`` for the upper half's ``t`` and ``lo = exp(sum_(s, r] g)`` for the
    lower half's ``s`` (``r`` the lower half's last token); once iterated, :attr:`suffix`
    ``[N, L, Kg]`` holds ``exp(sum_(t, L) g)``.

    Built by doubling on the per-token decays ``exp(g)`` (one ``exp`` per token): a block's
    factors are its halves' factors times one value, so a level costs one in-place product over
    half the tokens (a cumulative sum along a middle dim, or an ``exp`` per level, costs several
    times more), and every factor is a tree of at most ``L`` factors <= 1: relative error
    <= log2(L) ulp, whatever the magnitudes elsewhere; an underflow only where the true value is
    smaller still. The views are updated in place for the next level: use them before asking for
    it.
    """

    def __init__(self, gate: torch.Tensor):
        self.decay = torch.exp(gate)
        self.suffix: torch.Tensor | None = None

    def __iter__(self):
        n, length, kg = self.decay.shape
        fwd = self.decay.clone()                # from the start of each half-size block through t
        rev = torch.ones_like(self.decay)       # after t to the end of each half-size block
        half = 1
        while half < length:
            block = 2 * half
            f = fwd.view(n, length // block, 2, half, kg)
            r = rev.view(n, length // block, 2, half, kg)
            yield block, f[:, :, 1], r[:, :, 0]
            r[:, :, 0] *= f[:, :, 1, -1:]            # * the whole upper half
            f[:, :, 1] *= f[:, :, 0, -1:]            # * the whole lower half
            half = block
        self.suffix = rev


def _masked_factors(up, lo, seg, block):
    """``up``, ``lo`` with the rows whose segment is not the reference's set to 0."""
    s_up, s_lo, s_ref = _halves(seg, block)
    keep_up = (s_up == s_ref.unsqueeze(-1)).unsqueeze(-1).to(up.dtype)
    keep_lo = (s_lo == s_ref.unsqueeze(-1)).unsqueeze(-1).to(up.dtype)
    return up * keep_up, lo * keep_lo


def _factors(q, k, up, lo, seg, block):
    """One recursion level: left factors of q and k (upper halves), the right factor of k
    (lower halves), and the two decay factors, ``[N, L/block, half, K]`` each."""
    e_up, e_lo = _masked_factors(up, lo, seg, block)
    return _halves(q, block)[0] * e_up, _halves(k, block)[0] * e_up, _halves(k, block)[1] * e_lo, e_up, e_lo


def _scalar_decay(levels: _Levels, seg):
    """``[N, L, L]`` ``exp(sum_(s, t] g)`` on same-segment pairs ``s <= t``, exactly 0 elsewhere:
    each level's quadrant is the outer product of its two factors."""
    n, length, _ = levels.decay.shape
    decay = levels.decay.new_zeros(n, length, length)
    for block, up, lo in levels:
        e_up, e_lo = _masked_factors(up, lo, seg, block)
        torch.mul(e_up, e_lo.transpose(-1, -2), out=_quadrant(decay, block))
    decay.diagonal(dim1=1, dim2=2).fill_(1.0)
    return decay


class DecayedGrams(torch.autograd.Function):
    """``(q [N,L,K], k [N,L,K], G [N,L,Kg], seg [N,L], gate [N,L,Kg]) -> (qk [N,L,L], kk [N,L,L],
    tail [N,L,Kg])``; ``tail = exp(sum_(t, L) g)``, the decay to the chunk's end, a by-product of
    the doubling, is meant for the tokens of the chunk's last segment only: elsewhere it is not
    masked, and its gradient is not propagated.

    ``gate`` are the per-token log-decays the values are computed from; ``G`` (their segmented
    cumulative sum) only receives the gradient (``tail_t = exp(G_last - G_t)`` mathematically).
    """

    @staticmethod
    def forward(ctx, q, k, G, seg, gate):
        n, length, _ = k.shape
        ctx.scalar = gate.shape[-1] == 1
        levels = _Levels(gate)
        if ctx.scalar:
            decay = _scalar_decay(levels, seg)
            qk = (q @ k.transpose(1, 2)).mul_(decay)
            kk = (k @ k.transpose(1, 2)).mul_(decay)
            kk.diagonal(dim1=1, dim2=2).zero_()
            ctx.save_for_backward(q, k, decay, qk, kk, seg, levels.suffix)
            return qk, kk, levels.suffix
        qk, kk = k.new_zeros(n, length, length), k.new_zeros(n, length, length)
        for block, up, lo in levels:
            left_q, left_k, right, _, _ = _factors(q, k, up, lo, seg, block)
            both = torch.cat([left_q, left_k], dim=2) @ right.transpose(-1, -2)    # [N, L/b, 2*half, half]
            half = block // 2
            _quadrant(qk, block).copy_(both[:, :, :half])
            _quadrant(kk, block).copy_(both[:, :, half:])
        qk.diagonal(dim1=1, dim2=2).copy_((q * k).sum(-1))
        ctx.save_for_backward(q, k, gate, seg, levels.suffix)
        return qk, kk, levels.suffix

    @staticmethod
    def backward(ctx, d_qk, d_kk, d_tail):
        k, seg, tail = ctx.saved_tensors[1], ctx.saved_tensors[-2], ctx.saved_tensors[-1]
        square = (k.shape[0], k.shape[1], k.shape[1])
        d_qk = k.new_zeros(square) if d_qk is None else d_qk.contiguous()
        d_kk = k.new_zeros(square) if d_kk is None else d_kk.contiguous()
        if ctx.scalar:
            q, k, decay, qk, kk = ctx.saved_tensors[:5]
            s_q, s_k = d_qk * decay, d_kk * decay
            s_k.diagonal(dim1=1, dim2=2).zero_()                         # kk has no diagonal
            dd = d_qk * qk + d_kk * kk                                   # d/d(G_t - G_s) on kept pairs
            dq = s_q @ k
            dk = s_q.transpose(1, 2) @ q + s_k @ k + s_k.transpose(1, 2) @ k
            dG = (dd.sum(-1) - dd.sum(-2)).unsqueeze(-1)
        else:
            dq, dk, dG = _per_channel_backward(ctx, d_qk, d_kk)
        if d_tail is not None:                                           # tail_t = exp(G_last - G_t)
            d_exp = torch.where((seg == seg[:, -1:]).unsqueeze(-1), d_tail * tail, 0.0)
            dG = dG - d_exp
            dG[:, -1] += d_exp.sum(1)
        return dq, dk, dG, None, None


def _per_channel_backward(ctx, d_qk, d_kk):
    q, k, gate, seg = ctx.saved_tensors[:4]
    dq, dk, dg = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(gate)   # dg: w.r.t. G
    for block, up_f, lo_f in _Levels(gate):
        left_q, left_k, right, e_up, e_lo = _factors(q, k, up_f, lo_f, seg, block)
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
    dd = d_qk.diagonal(dim1=1, dim2=2).unsqueeze(-1)
    dq += dd * k
    dk += dd * q
    return dq, dk, dg
