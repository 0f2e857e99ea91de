"""Everything a chunk needs that does not depend on the state entering it (steps 1-2 of
:mod:`.reference`), for a batch of chunks at once, and its backward, written out.

    X = chunks (rows x chunks, batched), H = heads, N = X * H, L = chunk length,
    K, V = head dims, Kg = 1 (scalar gate) or K

Tensors are ``[N, L, ...]`` with ``N`` ordered ``(X, H)``; the masks depend on the chunk only and
broadcast over the heads (``[X, 1, ...]``).

Forward (``S`` the state entering a chunk)::

    G   = keep @ g                 segmented cumulative log-decay          [N, L, Kg]
    suf = keep_strict^T @ g        log-decay from after t to the chunk end  [N, L, Kg]
    S2  = [qk; beta kk]            decayed Grams (:mod:`.gram`)             [N, 2, L, L]
    T   = (I + strict(beta kk))^-1                          (:mod:`.wy`)   [N, L, L]
    R   = [R_W | R_U] = [beta exp(G) k (* reads) | beta v]                 [N, L, K + V]
    [W | U] = T @ R                                                         [N, L, K + V]
    q_read = reads q exp(G),  k_out = last k exp(suf),  kappa = keep_state exp(G_last)

so that ``delta = U - w_read S``, ``o = q_read S + qk delta``, ``S' = kappa S + k_out^T delta``.
The fast path forms no ``[W | U]``: its recurrence takes ``delta = T (R_U - R_W S)`` chunk by
chunk (one chunk-sized product fewer), and so does its backward (``T^T d_delta`` in the loop).
Only the entering document's rows of ``W`` are ever read: the fast path masks ``R``'s rows
before the product (``T`` is block-diagonal per document, so that equals masking ``W``'s rows);
the composed path (``full_w``) keeps every row (per-document initial states correct them). For
the same reason the fast path needs ``exp(G)`` on the entering segment's tokens only and
``exp(suf)`` on the last segment's only, where no reset lies between the token and the chunk's
start (end): it takes them as running products of ``exp(g)``, with no segmented sum.

The backward is the chain rule through the same steps: the WY system's is one product with the
transposed inverse (``dR = T^T dX``, ``dA = -dR X^T``; on the fast path, where ``W`` and ``U``
only enter ``delta``, ``dR_U = T^T d_delta``, ``dR_W = -dR_U S^T`` and ``dA = -dR_U delta^T``), the Grams' is
:mod:`.gram`'s, and the segmented sums' is one product with the transposed masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.chunks import LOG_DECAY_FLOOR, same_segment_causal
from ..common.inplace import into
from .gram import channel_grams, channel_grams_backward, scalar_decay, scalar_grams_backward
from .wy import unit_lower_inverse


@dataclass
class Masks:
    """Per chunk (``X`` of them), broadcast over the heads, as floats of the compute dtype
    (``sums`` may be kept as bools: :meth:`rows` converts a block's)."""

    X: int
    keep: torch.Tensor        # [X, 1, L, L] same segment, s <= t
    sums: torch.Tensor        # [X, 2L, L]  [keep; strict keep^T]: G and suf as one product
    reads: torch.Tensor       # [X, 1, L, 1] token of the entering state's segment
    last: torch.Tensor        # [X, 1, L, 1] token of the chunk's last segment
    keep_state: torch.Tensor  # [X, 1, 1, 1] the entering state's segment reaches the chunk's end

    def rows(self, r0: int, r1: int) -> Masks:
        """The masks of chunks ``r0 .. r1 - 1``, all as floats."""
        sums = self.sums[r0:r1].to(self.reads.dtype)
        return Masks(X=r1 - r0, keep=sums[:, None, :sums.shape[-1]], sums=sums, reads=self.reads[r0:r1],
                     last=self.last[r0:r1], keep_state=self.keep_state[r0:r1])


def chunk_masks(seg: torch.Tensor, enter: torch.Tensor, dtype, *, bool_sums: bool = False) -> Masks:
    """Masks of chunks ``seg [X, L]`` whose entering state belongs to segment ``enter [X]``;
    ``bool_sums``: keep the ``[X, 2L, L]`` matrices as bools (a quarter of the memory, for masks of
    a whole sequence that :meth:`Masks.rows` hands out block by block)."""
    x, length = seg.shape
    keep = same_segment_causal(seg)
    strict = keep & ~torch.eye(length, dtype=torch.bool, device=seg.device)
    sums = torch.cat([keep, strict.transpose(1, 2)], dim=1)
    sums = sums if bool_sums else sums.to(dtype)
    reads = seg == enter.unsqueeze(-1)

    def col(m):
        return m.to(dtype).reshape(x, 1, length, 1)
    return Masks(X=x, keep=sums[:, None, :length], sums=sums, reads=col(reads), last=col(keep[:, -1]),
                 keep_state=(seg[:, -1] == enter).to(dtype).reshape(x, 1, 1, 1))


def _to_head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[X, L, H*Kg]`` -> ``[X*H, L, Kg]``."""
    x, length, hk = t.shape
    return t.view(x, length, heads, hk // heads).transpose(1, 2).reshape(x * heads, length, hk // heads)


def _exp_to_head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``exp`` of ``[X, L, H*Kg]`` as ``[X*H, L, Kg]`` (the transpose done by the same pass)."""
    x, length, hk = t.shape
    out = t.new_empty(x, heads, length, hk // heads)
    into(out, torch.exp, t.view(x, length, heads, hk // heads).transpose(1, 2))
    return out.view(x * heads, length, hk // heads)


def _from_head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[X*H, L, Kg]`` -> ``[X, L, H*Kg]``."""
    n, length, kg = t.shape
    return t.view(n // heads, heads, length, kg).transpose(1, 2).reshape(n // heads, length, heads * kg)


def _per_head(t: torch.Tensor, x: int) -> torch.Tensor:
    """``[N, ...]`` -> ``[X, H, ...]`` (a view)."""
    return t.view(x, -1, *t.shape[1:])


@dataclass
class Prep:
    """The per-chunk quantities (``[N, ...]``) and what the backward needs. Each field means one thing;
    a field only one path forms is ``None`` on the other: ``full_w`` (the composed path, every row of
    ``[W | U]``) or the fast path (``delta = T (R_U - R_W S)`` chunk by chunk)."""

    m: Masks
    heads: int
    full_w: bool
    left: torch.Tensor      # [N, 2L, K] = [q; beta k]
    k: torch.Tensor         # [N, L, K]
    v: torch.Tensor         # [N, L, V], or a view splitting N (read elementwise only)
    beta: torch.Tensor      # [N, L, 1]
    g: torch.Tensor         # [X, L, H*Kg] log-decays as given (not floored)
    gate: torch.Tensor | None  # [N, L, Kg] floored (``full_w`` only)
    step: torch.Tensor      # [N, L, Kg] exp(gate): each token's decay
    G: torch.Tensor | None  # [N, L, Kg] (``full_w`` only)
    exp_G: torch.Tensor | None  # [N, L, Kg] exp(G) on every token (``full_w`` only)
    read_in: torch.Tensor   # [N, L, Kg] exp(G) on the entering segment's tokens, else 0
    tail_out: torch.Tensor  # [N, L, Kg] exp(suf) on the chunk's last segment's tokens, else 0 (suf: log-decay
                            # from after t to the chunk's end)
    qk: torch.Tensor        # [N, L, L] the decayed Gram of queries and keys
    decay: torch.Tensor | None  # [N, L, L] scalar gate: the decay matrix
    T: torch.Tensor         # [N, L, L] (I + strict(beta kk))^-1
    R_w: torch.Tensor | None  # [N, L, K] beta k exp(G) on the entering segment's rows, else 0 (fast path only)
    R_u: torch.Tensor | None  # [N, L, V] beta v (fast path without ``inverse``: the backward needs R_W only)
    wu: torch.Tensor | None   # [N, L, K + V] = [W | U] = T [beta exp(G) k | beta v], every row (``full_w`` only)
    q_read: torch.Tensor    # [N, L, K]
    k_out: torch.Tensor     # [N, L, K]
    kappa: torch.Tensor     # [N, Kg, 1]

    @property
    def q(self):
        return self.left[:, :self.k.shape[1]]

    @property
    def W(self):
        assert self.wu is not None, "[W | U] is not formed on the fast path"
        return self.wu[..., :self.k.shape[-1]]

    @property
    def w_read(self):
        """``W`` on the entering segment's rows, else 0 (``full_w`` only)."""
        return self.W * _flat(self.m.reads, self.heads)

    @property
    def U(self):
        assert self.wu is not None, "[W | U] is not formed on the fast path"
        return self.wu[..., self.k.shape[-1]:]


def _flat(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """``[X, 1, ...]`` -> ``[X*H, ...]``."""
    return mask.expand(mask.shape[0], heads, *mask.shape[2:]).reshape(-1, *mask.shape[2:])


def prep_forward(left, k, v, beta, g, m: Masks, *, full_w: bool = False, inverse: torch.Tensor | None = None,
                 inverse_out: torch.Tensor | None = None) -> Prep:
    """``left [N, 2L, K]`` holding ``q`` (scaled) in rows ``:L`` and ``beta k`` in rows ``L:``;
    ``k [N, L, K]``, ``v [N, L, V]`` (or any view splitting ``N``, e.g. ``[n, B, H, L, V]``: only read
    elementwise), ``beta [N, L, 1]``, ``g [X, L, H*Kg]`` (token-major in the chunk).
    ``inverse``: ``T [N, L, L]`` of these chunks, kept from an earlier call, for the backward (then,
    for a scalar gate, only ``qk`` of the Grams is formed: ``beta kk`` feeds nothing else; and only
    ``R_W`` of ``R``); ``inverse_out``: where to
    write ``T`` (a contiguous ``[N, L, L]``, e.g. a slice of what the backward keeps)."""
    n, length, kd = k.shape
    x = m.X
    heads = n // x
    gate_tm = g.clamp(min=LOG_DECAY_FLOOR)
    step = _exp_to_head_rows(gate_tm, heads)                                     # exp(g) per token
    q, bk = left[:, :length], left[:, length:]
    scalar = step.shape[-1] == 1
    decay = None
    if scalar:
        decay = scalar_decay(step, m.keep)
        rows = q if inverse is not None else left
        s2 = torch.bmm(rows, k.transpose(1, 2)).view(n, -1, length, length).mul_(decay.unsqueeze(1))
        running = None
    else:
        s2, *running = channel_grams(left, k, step, m.keep)
    G = gate = exp_G = None
    if full_w:
        sums = torch.bmm(m.sums, gate_tm)                                       # [X, 2L, H*Kg]
        # heads-major exponentials straight from the token-major sums (one pass each)
        exp_G, tail = _exp_to_head_rows(sums[:, :length], heads), _exp_to_head_rows(sums[:, length:], heads)
        G, gate = _to_head_rows(sums[:, :length], heads), _to_head_rows(gate_tm, heads)
        decay_in = exp_G
    else:
        # read only on the entering segment's tokens (exp(G)) and the last segment's (exp(suf)):
        # no reset lies between those and the chunk's start or end, so both are running products
        # of the per-token decays (no segmented sum: for a per-channel gate that product is as
        # large as a Gram's, and the Grams' levels leave both behind)
        decay_in, tail = running if running is not None else (step.cumprod(1), _suffix_products(step))
    T = unit_lower_inverse(s2[:, 1], out=inverse_out) if inverse is None else inverse
    # the masks multiply the per-token factors (``[N, L, 1]`` for a scalar gate), not the rows
    read_in = _per_head(decay_in, x).mul(m.reads).view(n, length, -1)         # exp(G) on read rows
    tail_out = _per_head(tail, x).mul(m.last).view(n, length, -1)             # exp(suf) on last rows
    R = k.new_empty(n, length, kd + (v.shape[-1] if inverse is None else 0))
    into(R[..., :kd], torch.mul, bk, exp_G if full_w else read_in)
    if inverse is None:
        into(R[..., kd:].view(v.shape), torch.mul, v, beta.view(*v.shape[:-1], 1))   # v may be [n, B, H, L, V]
    wu = torch.bmm(T, R) if full_w else None
    kappa = _per_head(decay_in[:, -1:].transpose(1, 2), x).mul(m.keep_state).view(n, -1, 1)
    fast = not full_w
    return Prep(m=m, heads=heads, full_w=full_w, left=left, k=k, v=v, beta=beta, g=g, gate=gate, step=step, G=G,
                exp_G=exp_G, read_in=read_in, tail_out=tail_out, qk=s2[:, 0], decay=decay, T=T,
                R_w=R[..., :kd] if fast else None, R_u=R[..., kd:] if fast and inverse is None else None, wu=wu,
                q_read=q * read_in, k_out=k * tail_out, kappa=kappa)


def _suffix_products(step: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = prod_{u > t} step[:, u]`` (1 at the last token) for ``step [N, L, Kg]``."""
    out = torch.empty_like(step)
    out[:, -1] = 1.0
    out[:, :-1] = step[:, 1:].flip(1).cumprod(1).flip(1)
    return out


def _masked(t: torch.Tensor, mask: torch.Tensor, x: int) -> torch.Tensor:
    """``t [N, L, Kg] *= mask [X, 1, L, 1]`` (in place; returns ``t``)."""
    _per_head(t, x).mul_(mask)
    return t


def _reduce(t: torch.Tensor, kg: int) -> torch.Tensor:
    """A per-channel gradient ``[N, L, K]`` summed to the gate's width ``Kg``."""
    return t if kg != 1 else t.sum(-1, keepdim=True)


def prep_backward(p: Prep, d_w, d_u, d_q_read, d_qk, d_k_out, d_kappa, d_G=None, d_gate=None, d_exp_G=None,
                  *, read=None):
    """Gradients ``(dq, dk, dv, dbeta [N, L, 1], dg [X, L, H*Kg])`` from those of the prep's
    outputs: ``d_w [N, L, K]`` and ``d_u [N, L, V]`` (of ``W`` and ``U``, ``full_w``), ``d_q_read``,
    ``d_qk``, ``d_k_out``, ``d_kappa`` and, optionally (``None``: zero), ``d_G``, ``d_gate``,
    ``d_exp_G``.

    The fast path passes ``d_w = d_u = None`` and ``read = (dR_u, S, delta)``, ``[N, L, V]``,
    ``[N, K, V]``, ``[N, L, V]``: ``W`` and ``U`` enter nothing but ``delta = U - w_read S`` (``S``
    the entering states), so with ``dR_u = T^T d_delta`` (its recurrence's backward forms it),
    ``dR_W = T^T d_w = -dR_u S^T`` and ``dA = -(dR_W W^T + dR_u U^T) = -dR_u delta^T``."""
    n, length, kd = p.k.shape
    x, m = p.m.X, p.m
    kg = p.step.shape[-1]
    d_s2 = p.k.new_empty(n, 2, length, length)
    d_s2[:, 0].copy_(d_qk)
    # dA = -dR X^T, into a contiguous buffer (bmm into a strided one runs a matmul per batch entry)
    if read is not None:
        dR_u, states, delta = read
        dR_w = torch.bmm(dR_u, states.transpose(1, 2)).neg_()
        into(d_s2[:, 1], torch.neg, torch.bmm(dR_u, delta.transpose(1, 2)))
    else:
        t_t = p.T.transpose(1, 2)
        dR_w, dR_u = torch.bmm(t_t, d_w), torch.bmm(t_t, d_u)                # dR = T^T [d_W | d_U]
        into(d_s2[:, 1], torch.neg, torch.bmm(dR_w, p.W.transpose(1, 2)).baddbmm_(dR_u, p.U.transpose(1, 2)))
    d_dec = _reduce(dR_w * p.left[:, length:], kg)                             # d exp(G) from R
    if not p.full_w:
        _masked(d_dec, m.reads, x)
    dv = dR_u * p.beta
    dbeta = (dR_u.view(p.v.shape) * p.v).sum(-1, keepdim=True).view(n, length, 1)
    d_dec += _masked(_reduce(d_q_read * p.q, kg), m.reads, x)
    if d_exp_G is not None:
        d_dec = d_dec + d_exp_G
    d_suf = _reduce(d_k_out * p.k, kg).mul_(p.tail_out)
    # the fast path's d_dec lies on the entering segment's rows only, where exp(G) = read_in
    dG = d_dec.mul_(p.exp_G if p.full_w else p.read_in)
    dG[:, -1] += (d_kappa * p.kappa).squeeze(-1)
    if d_G is not None:
        dG = dG + d_G
    if kg == 1:
        d_left, dk, dG_g = scalar_grams_backward(d_s2, p.decay, p.left, p.k)
    else:
        d_left, dk, dG_g = channel_grams_backward(d_s2, p.left, p.k, p.step, m.keep)
    dG += dG_g
    dq = d_left[:, :length].addcmul_(d_q_read, p.read_in)
    d_bk = d_left[:, length:].addcmul_(dR_w, p.exp_G if p.full_w else p.read_in)
    dk.addcmul_(d_k_out, p.tail_out).addcmul_(d_bk, p.beta)
    dbeta += (d_bk * p.k).sum(-1, keepdim=True)
    both = torch.cat([_from_head_rows(dG, p.heads), _from_head_rows(d_suf, p.heads)], dim=1)   # [X, 2L, H*Kg]
    dg = torch.bmm(m.sums.transpose(1, 2), both)
    if d_gate is not None:
        dg += _from_head_rows(d_gate, p.heads)
    dg.mul_(p.g >= LOG_DECAY_FLOOR)                                            # the floor's gradient
    return dq, dk, dv, dbeta, dg
