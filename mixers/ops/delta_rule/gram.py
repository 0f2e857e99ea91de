"""The two decayed Gram matrices of a chunk, forward and backward (plain functions: the caller's
autograd function, or the hand-written backward of :mod:`.prep`, calls them).

    N = chunks x heads (batched), L = chunk length, K = key dim, Kg = 1 (scalar gate) or K

    qk[t, s]  = sum_c q_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])             (s <= t)
    Akk[t, s] = beta_t sum_c k_t[c] k_s[c] exp(sum_{s < u <= t} g_u[c])      (s <  t)

stacked as ``S2 [N, 2, L, L]`` (``S2[:, 0] = qk``, ``S2[:, 1] = Akk``; the diagonal of ``Akk``
is not meaningful: the WY solve treats it as unit). Only pairs of one segment are kept; all
others are exactly 0. ``g`` are the per-token log-decays (<= 0; a reset ``g = -inf``, floored at
:data:`mixers.ops.common.chunks.LOG_DECAY_FLOOR`, has ``exp(g) = 0``).

Every decay is the product of the per-token decays ``exp(g_u)`` over exactly its interval
``(s, t]``, never the exponential of the difference ``G_t - G_s`` of two cumulative sums: that
difference loses ``ulp(|G|)``, i.e. all precision once one gate of the chunk is large
(``|g| ~ 1e3`` in fp32 leaves ~1e-4 absolute error in the exponent of every later pair). A product
of factors <= 1 has a small *relative* error, like the step recurrence's.

* Scalar gate (GDN): the decay matrix ``D``, shared by both products, is a running product down
  each column (``D[t, s] = D[t-1, s] * exp(g_t)``, one ``cumprod``: the step recurrence's own
  products, relative error <= L ulp); then ``S2 = ([q; beta k] @ k^T) * D``, one batched matmul.
* Per-channel gate (KDA): ``exp(sum_(s,t])`` differs per channel, so it cannot leave the sum.
  It is split at a reference position ``r`` between ``s`` and ``t``:
  ``exp(sum_(r,t]) * exp(sum_(s,r])``, both factors <= 1 (no overflow, and an underflow only
  where the true value is smaller still), each a product inside its half block.
  Halving the chunk recursively puts every pair ``s < t`` in exactly one (upper half, lower
  half) block whose split point lies between them, and each block is one batched matmul (q and
  beta k rows stacked, sharing the k factor). A pair from two segments is zeroed at the end by the
  same-segment mask (its product is finite: factors <= 1 times finite inputs).

The per-channel factors of all levels come from one doubling pass (:class:`_Levels`); one more
step of it leaves the chunk-wide running products ``exp(G)`` and ``exp(suf)`` that the
preparation reads (:mod:`.prep`; the chunk's prefix and suffix of ``exp(g)``, segments ignored).
The backward returns the gradient with respect to the cumulative log-decay ``G`` (the interval
sums are ``G_t - G_s`` mathematically); the caller carries it on through ``G``'s own segmented sum.

Quadrants are views built from ``view`` and ``torch.diagonal`` (no ``as_strided``), so
``torch.compile`` traces all of it.
"""

from __future__ import annotations

import torch

from ..common.inplace import into


def quadrant(m: torch.Tensor, block: int, row: int = 1, col: int = 0) -> torch.Tensor:
    """View ``[N, L/block, half, half]`` of the ``(row, col)`` quadrant of every diagonal
    ``block x block`` block of ``m [N, L, L]`` (default: lower left)."""
    n, length = m.shape[0], m.shape[-1]
    half, nb = block // 2, length // block
    six = m.view(n, nb, 2, half, nb, 2, half)[:, :, row, :, :, col, :]        # [N, nb, half, nb, half]
    return torch.diagonal(six, dim1=1, dim2=3).permute(0, 3, 1, 2)            # [N, nb, half, half]


def _halves(t: torch.Tensor, block: int):
    """``[N, L, X]`` -> (upper halves, lower halves, last row of each lower half) per block."""
    n, length = t.shape[:2]
    half = block // 2
    blocks = t.reshape(n, length // block, block, *t.shape[2:])
    return blocks[:, :, half:], blocks[:, :, :half], blocks[:, :, half - 1]


class _Levels:
    """For ``block = 2, 4, ..., L``: ``(block, up, lo)``, ``[N, L/block, half, Kg]`` each, with
    ``up = exp(sum_(r, t] g)`` for the upper half's ``t`` and ``lo = exp(sum_(s, r] g)`` for the
    lower half's ``s`` (``r`` the lower half's last token).

    Built by doubling on the per-token decays ``step = exp(g)`` (one ``exp`` per token, taken by
    the caller): a block's factors are its halves' factors times one value, so a level costs one
    in-place product over half the tokens, and every factor is a tree of at most ``L`` factors
    <= 1: relative error <= log2(L) ulp, whatever the magnitudes elsewhere; an underflow only where
    the true value is smaller still. The views are updated in place for the next level: use them
    before asking for it.

    With ``ends``, one more doubling after the last level leaves the chunk-wide running products
    in :attr:`prefix` (``exp(sum_[0, t] g)``) and :attr:`suffix` (``exp(sum_(t, L) g)``, 1 at the
    last token), ``[N, L, Kg]`` each, with one rounding more than the levels' factors (<= log2(L) + 1
    ulp).
    """

    def __init__(self, step: torch.Tensor, *, ends: bool = False):
        self.step, self.ends = step, ends
        self.prefix = self.suffix = None

    def __iter__(self):
        n, length, kg = self.step.shape
        fwd = self.step.clone()                # from the start of each half-size block through t
        rev = torch.ones_like(self.step)       # after t to the end of each half-size block
        half = 1
        while half < length:
            block = 2 * half
            f = fwd.view(n, length // block, 2, half, kg)
            r = rev.view(n, length // block, 2, half, kg)
            yield block, f[:, :, 1], r[:, :, 0]
            if block < length or self.ends:
                r[:, :, 0] *= f[:, :, 1, -1:]            # * the whole upper half
                f[:, :, 1] *= f[:, :, 0, -1:]            # * the whole lower half
            half = block
        if self.ends:
            self.prefix, self.suffix = fwd, rev


def scalar_decay(step: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[N, L, L]`` ``exp(sum_(s, t] g)`` on same-segment pairs ``s <= t``, exactly 0 elsewhere.

    ``step [N, L, 1]`` the per-token decays ``exp(g)``; ``keep [X, 1, L, L]`` (``N = X * H``): the
    same-segment causal mask, as a float of the same dtype. Column ``s`` is the running product of
    the decays after ``s`` (``factors[u, s] = step[u]`` for ``u > s``, else 1), taken in the
    order the step recurrence takes them.
    """
    n, length, _ = step.shape
    below = torch.ones(length, length, dtype=step.dtype, device=step.device).tril_(-1)
    factors = torch.addcmul(1 - below, step, below)                             # [N, L, L]
    decay = factors.cumprod_(dim=1)
    return decay.view(keep.shape[0], -1, length, length).mul_(keep).view(n, length, length)


def _pair_quadrant(s2: torch.Tensor, block: int) -> torch.Tensor:
    """View ``[N, L/block, 2, half, half]`` of the lower-left quadrants of both Grams of ``s2 [N, 2, L, L]``."""
    n, _, length, _ = s2.shape
    half = block // 2
    return quadrant(s2.view(n * 2, length, length), block).view(n, 2, length // block, half, half).transpose(1, 2)


def _upper_pairs(left: torch.Tensor, block: int) -> torch.Tensor:
    """View ``[N, 2, L/block, half, K]`` of the upper halves of both ``q`` and ``beta k`` in
    ``left [N, 2L, K]`` (or its gradient)."""
    n, two_l, kd = left.shape
    return left.view(n, 2, two_l // 2 // block, block, kd)[:, :, :, block // 2:]


def _left_factors(left: torch.Tensor, up: torch.Tensor, block: int) -> torch.Tensor:
    """``[N, L/block, 2 * half, K]``: the upper halves of both ``q`` and ``beta k`` (``left [N, 2L, K]``)
    times ``up``, stacked per block (one product, no concatenation)."""
    upper = _upper_pairs(left, block)                                           # [N, 2, nb, half, K]
    n, _, nb, half, kd = upper.shape
    out = left.new_empty(n, nb, 2, half, kd)
    into(out.transpose(1, 2), torch.mul, upper, up.unsqueeze(1))
    return out.view(n, nb, 2 * half, kd)


def channel_grams(left, k, step, keep):
    """``(S2 [N, 2, L, L], prefix, suffix)`` for per-channel gates: ``left = [q; beta k] [N, 2L, K]``,
    ``k [N, L, K]``, ``step [N, L, K]`` the per-token decays ``exp(g)``, ``keep [X, 1, L, L]``
    (``N = X * H``) the same-segment causal mask as floats. ``prefix`` and ``suffix`` ``[N, L, K]``
    are the running products of ``step`` through ``t`` and after ``t`` over the whole chunk
    (ignoring segments), left by the levels' doubling for two more products (:class:`_Levels`).

    The products are taken for every pair of a block (both factors are finite and <= 1 times finite
    values); the pairs of two segments are zeroed by ``keep`` at the end."""
    n, length, _ = k.shape
    s2 = k.new_zeros(n, 2, length, length)
    levels = _Levels(step, ends=True)
    for block, up, lo in levels:
        right = _halves(k, block)[1] * lo                                       # [N, nb, half, K]
        both = _left_factors(left, up, block) @ right.transpose(-1, -2)        # [N, nb, 2*half, half]
        half = block // 2
        _pair_quadrant(s2, block).copy_(both.view(n, length // block, 2, half, half))
    s2[:, 0].diagonal(dim1=-2, dim2=-1).copy_((left[:, :length] * k).sum(-1))
    s2 = s2.view(keep.shape[0], -1, 2, length, length).mul_(keep.unsqueeze(2)).view(n, 2, length, length)
    return s2, levels.prefix, levels.suffix


def scalar_grams_backward(d_s2, decay, left, k):
    """Backward of ``S2 = (left @ k^T) * D`` with ``left = [q; beta k] [N, 2L, K]`` (the diagonal of
    ``Akk`` unused): returns ``(d_left [N, 2L, K], dk, dG [N, L, 1])``; ``d_s2`` is overwritten.

    ``S2`` itself is not needed: with ``scaled = d_S2 * D``, the gradient of each pair's
    ``G_t - G_s`` is ``scaled[t, s] (left_t . k_s)``, whose sum over ``s`` is ``left_t . d_left_t``
    and over ``t`` is ``k_s . dk_s``."""
    n, _, length, _ = d_s2.shape
    d_s2[:, 1].diagonal(dim1=-2, dim2=-1).zero_()                          # Akk has no diagonal
    scaled = d_s2.mul_(decay.unsqueeze(1)).view(n, 2 * length, length)     # [d_qk * D; d_Akk * D]
    d_left, dk = torch.bmm(scaled, k), torch.bmm(scaled.transpose(1, 2), left)
    rows = (left * d_left).sum(-1).view(n, 2, length)
    dG = rows[:, 0].add_(rows[:, 1]).sub_((k * dk).sum(-1)).unsqueeze(-1)
    return d_left, dk, dG


_DIRECT_HALF = 8     # quadrants of at least this size go to batched products directly


def _level_grad(d: torch.Tensor, block: int, right: torch.Tensor, factors: torch.Tensor):
    """One level's ``(d factors [N, nb, 2*half, K], d right [N, nb, half, K])`` from the quadrants of
    ``d [N, 2, L, L]``. Small blocks are laid into one block-diagonal ``[L, L/2]`` matrix per
    chunk-head first: thousands of ``2 x 1`` or ``8 x 4`` products cost a fixed overhead each as a
    batch, a few zeros in one ``L x L/2`` product cost less."""
    n, _, length, _ = d.shape
    kd, half, nb = right.shape[-1], block // 2, length // block
    if half >= _DIRECT_HALF:
        grad = _pair_quadrant(d, block).reshape(n, nb, 2 * half, half)
        return grad @ right, grad.transpose(-1, -2) @ factors
    full = d.new_zeros(n, nb, 2, half, nb, half)
    torch.diagonal(full, dim1=1, dim2=4).copy_(_pair_quadrant(d, block).permute(0, 2, 3, 4, 1))
    full = full.view(n, length, length // 2)
    d_factors = torch.bmm(full, right.reshape(n, length // 2, kd))
    d_right = torch.bmm(full.transpose(1, 2), factors.reshape(n, length, kd))
    return d_factors.view(n, nb, 2 * half, kd), d_right.view(n, nb, half, kd)


def channel_grams_backward(d_s2, left, k, step, keep):
    """Backward of :func:`channel_grams`: ``(d_left [N, 2L, K], dk, dG [N, L, K])``; ``d_s2`` is
    overwritten."""
    n, _, length, _ = d_s2.shape
    kd = k.shape[-1]
    d = d_s2.view(keep.shape[0], -1, 2, length, length).mul_(keep.unsqueeze(2)).view(n, 2, length, length)
    d_left, dk, dg = torch.zeros_like(left), torch.zeros_like(k), torch.zeros_like(step)
    for block, up, lo in _Levels(step):
        half, nb = block // 2, length // block
        right = _halves(k, block)[1] * lo                                       # [N, nb, half, K]
        factors = _left_factors(left, up, block)                                 # [N, nb, 2*half, K]
        d_factors, d_right = _level_grad(d, block, right, factors)
        _upper_pairs(d_left, block).addcmul_(d_factors.view(n, nb, 2, half, kd).transpose(1, 2), up.unsqueeze(1))
        _halves(dk, block)[1].addcmul_(d_right, lo)
        dg_up, dg_lo, dg_ref = _halves(dg, block)
        both = (d_factors * factors).view(n, nb, 2, half, kd)
        u = both[:, :, 0].add_(both[:, :, 1])                                   # d up * up
        w = d_right.mul_(right)                                                 # d lo * lo
        dg_up += u
        dg_lo -= w
        dg_ref += w.sum(2) - u.sum(2)
    dd = d[:, 0].diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    d_left[:, :length].addcmul_(dd, k)
    dk.addcmul_(dd, left[:, :length])
    return d_left, dk, dg
