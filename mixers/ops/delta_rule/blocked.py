"""The chunked delta rule over blocks of chunks (the fast path).

    B = rows, T = tokens, C = chunks, n = chunks per block, H = heads, L = chunk length,
    K, V = head dims, Kg = 1 or K, N = n * B * H (one block's chunk-heads, chunk-major)

The inputs stay token-major (``[B, T, H, ...]``, as the caller has them). Block by block: the
block's q, k and beta are copied chunk-major (the query scaled on the way, q and k
l2-normalized first with ``use_qk_l2norm_in_kernel``; v, only ever read elementwise, stays a
strided view), :func:`.prep.prep_forward` prepares its chunks, the state
recurrence runs chunk by chunk (``delta = T (R_U - R_W S)``: the WY solve applied to the
corrected right-hand side, no ``[W | U]``), and the block's outputs are written straight into the
token-major output. A block's ``[N, L, max(K, V)]`` tensors hold about ``_BLOCK_NUMBERS``
numbers, or up to twice that to give it 8 chunks (at H = 8: 64 chunk-heads at K = V = 64 and at
128), so its working set stays small, and the only sequence-sized allocations are the output,
what the backward keeps and (in the backward) the input gradients: a fresh large allocation costs
a page fault per 4 KB on first touch, which on a CPU costs more than the arithmetic that fills it.

With gradients wanted, the forward keeps per chunk what is costly to recompute and small to keep:
the entering state (``K * V / L`` numbers per token and head), the corrected values ``delta``
(``V``), and the WY inverse ``T`` (``L``). The backward walks the blocks in reverse: it recomputes
the rest of the block's preparation from the inputs (the Grams, only ``qk`` for a scalar gate,
the scalar decay matrix; no ``[W | U]``), runs the recurrence backwards, then the
preparation's hand-written backward (:func:`.prep.prep_backward`), and writes the block's input
gradients in place. No autograd inside: ``torch.compile`` traces the forward and the backward.

Like every mixing step of the references, the masks here multiply exact zeros into the
cross-document terms; every value is finite (the caller sanitizes non-finite inputs and output
gradients, see :mod:`mixers.ops.common.isolation`), so that is exact.
"""

from __future__ import annotations

import torch

from ..common.inplace import into
from .l2norm import inverse_norm, normalize_backward
from .prep import Masks, Prep, chunk_masks, prep_backward, prep_forward

_BLOCK_NUMBERS = 1 << 18
_MIN_CHUNKS = 8


def _blocks(rows: int, heads: int, chunks: int, chunk: int, width: int) -> list[tuple[int, int]]:
    """Ranges of chunks, ``rows * heads`` chunk-heads each, whose ``[N, chunk, width]`` tensors hold
    about ``_BLOCK_NUMBERS`` numbers (``width = max(K, V)``), widened to ``_MIN_CHUNKS`` chunks
    where that at most doubles them: a block costs some fifty small ops besides its recurrence,
    which fewer chunks amortise worse."""
    step = max(1, _BLOCK_NUMBERS // (chunk * width * rows * heads))
    step = max(step, min(_MIN_CHUNKS, 2 * step))
    return [(c0, min(c0 + step, chunks)) for c0 in range(0, chunks, step)]


def _sparse_rows(t0: int, rows: int, every: int, compact: int) -> tuple[int, int, int]:
    """Steps ``t0 .. t0 + rows - 1`` of a sequence whose ``x`` holds only every ``every``-th step
    (the last of each group of ``every``; ``compact`` rows in all): ``(first, lo, count)``, the
    offset of the first such step in the range, its row of ``x`` and how many rows of ``x`` fall
    in the range."""
    first = (every - 1 - t0) % every
    lo = (t0 + first) // every
    count = max(0, min(compact - lo, (rows - first + every - 1) // every))
    return first, lo, count


def _chunks(x: torch.Tensor, t0: int, n: int, length: int, every: int = 1) -> torch.Tensor:
    """``x [B, T, ...]`` -> ``[n, B, L, ...]``: the ``n`` chunks from step ``t0``, zero-padded.
    ``every > 1``: ``x`` holds only the last step of each group of ``every`` (Gated DeltaProduct's
    queries and output gradients); the other steps are zeros, laid out here for one block only."""
    b, t = x.shape[:2]
    if every > 1:
        first, lo, count = _sparse_rows(t0, n * length, every, t)
        part = x.new_zeros(b, n * length, *x.shape[2:])
        part[:, first:first + count * every:every] = x[:, lo:lo + count]
        return part.reshape(b, n, length, *x.shape[2:]).transpose(0, 1)
    t1 = min(t0 + n * length, t)
    part = x[:, t0:t1]
    if t1 - t0 < n * length:
        part = torch.cat([part, part.new_zeros(b, n * length - (t1 - t0), *x.shape[2:])], 1)
    return part.reshape(b, n, length, *x.shape[2:]).transpose(0, 1)


def _store(dst: torch.Tensor, src: torch.Tensor, t0: int, every: int = 1) -> None:
    """Write ``src [B, n, L, ...]`` (any strides) into steps ``t0 ..`` of ``dst [B, T, ...]``
    (``every > 1``: ``dst`` keeps only the last step of each group of ``every``)."""
    b, n, length = src.shape[:3]
    if every > 1:
        first, lo, count = _sparse_rows(t0, n * length, every, dst.shape[1])
        flat = src.reshape(b, n * length, *src.shape[3:])
        dst[:, lo:lo + count].copy_(flat[:, first:first + count * every:every])
        return
    t1 = min(t0 + n * length, dst.shape[1])
    if t1 - t0 == n * length:
        dst[:, t0:t1].view(src.shape).copy_(src)
    else:
        dst[:, t0:t1].copy_(src.reshape(b, n * length, *src.shape[3:])[:, :t1 - t0])


class _Block:
    """One block's inputs, chunk-major, and its masks. ``l2norm``: q and k are normalized here
    (fla's ``use_qk_l2norm_in_kernel``; ``norms`` keeps ``(q, 1/|q|, k, 1/|k|)`` of the block,
    chunk-major ``[n, B, H, L, ...]``, for the backward)."""

    def __init__(self, q, k, v, g, beta, masks: Masks, c0, c1, length, scale, every=1, l2norm=False):
        n, b, h, kd = c1 - c0, q.shape[0], q.shape[2], q.shape[3]
        t0 = c0 * length
        self.n, self.t0 = n, t0
        left = q.new_empty(n, b, h, 2, length, kd)
        qb = _chunks(q, t0, n, length, every).permute(0, 1, 3, 2, 4)                # [n, B, H, L, K]
        kb = _chunks(k, t0, n, length).permute(0, 1, 3, 2, 4)
        self.norms = None
        if l2norm:
            (qb, r_q), (kb, r_k) = _normalized(qb), _normalized(kb)
            self.norms = (qb, r_q, kb, r_k)
        else:
            kb = kb.contiguous()
        into(left[:, :, :, 0], torch.mul, qb, scale)
        bb = _chunks(beta, t0, n, length).permute(0, 1, 3, 2).unsqueeze(-1).contiguous()
        into(left[:, :, :, 1], torch.mul, kb, bb)
        # v is only read elementwise (``beta v``, and ``dbeta`` in the backward): a strided view, no copy
        vb = _chunks(v, t0, n, length).permute(0, 1, 3, 2, 4)                   # [n, B, H, L, V]
        gb = _chunks(g, t0, n, length).reshape(n * b, length, -1)                  # [X, L, H*Kg]
        self.args = (left.view(-1, 2 * length, kd), kb.view(-1, length, kd), vb, bb.view(-1, length, 1), gb)
        self.masks = masks.rows(c0 * b, c1 * b)

    def prep(self, inverse: torch.Tensor | None = None, inverse_out: torch.Tensor | None = None) -> Prep:
        return prep_forward(*self.args, self.masks, inverse=inverse, inverse_out=inverse_out)


def _normalized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x r, r)``, ``r = 1 / |x|`` over the last dim, on a new contiguous buffer: ``x`` may be a
    view of the caller's input (with one head, chunk-major is token-major)."""
    x = x.clone(memory_format=torch.contiguous_format)
    r = inverse_norm(x)
    return x.mul_(r), r


def _all_masks(seg: torch.Tensor, enter: torch.Tensor, dtype) -> Masks:
    """The masks of every chunk, chunk-major (``X = C * B``: a block's chunks are a range of rows),
    built once per call (a block's own would cost a dozen small ops each time); the ``[2L, L]``
    matrices stay bools until a block asks for its rows (0.5 KB per token as floats)."""
    b, c, length = seg.shape
    return chunk_masks(seg.transpose(0, 1).reshape(c * b, length), enter.transpose(0, 1).reshape(c * b), dtype,
                       bool_sums=True)


def recurrence(p: Prep, states: torch.Tensor, n: int, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Run a block's ``n`` chunks: ``delta = T (R_U - R_W S)`` (``= U - w_read S`` without forming
    ``[W | U] = T R``: one chunk-sized product fewer), ``S' = kappa S + k_out^T delta``.
    ``states [n + 1, B*H, K, V]`` holds the entering state in ``[0]``; the states leaving each chunk
    are written to ``[1:]``. Returns the deltas ``[n, B*H, L, V]`` (written into ``delta`` if given,
    contiguous)."""
    N, length, kd = p.k.shape
    bh, vd = N // n, p.v.shape[-1]
    R_w, R_u, T = p.R_w.view(n, bh, length, kd), p.R_u.view(n, bh, length, vd), p.T.view(n, bh, length, length)
    k_out, kappa = p.k_out.view(n, bh, length, kd), p.kappa.view(n, bh, -1, 1)
    delta = states.new_empty(n, bh, length, vd) if delta is None else delta.view(n, bh, length, vd)
    corrected = states.new_empty(bh, length, vd)                                # R_U - R_W S of one chunk
    # the per-chunk views taken in one call each (indexing inside the loop costs a call per view)
    R_w, R_u, T = R_w.unbind(), R_u.unbind(), T.unbind()
    S, d, kappa = states.unbind(), delta.unbind(), kappa.unbind()
    k_out_t = k_out.transpose(2, 3).unbind()
    for j in range(n):
        into(corrected, torch.baddbmm, R_u[j], R_w[j], S[j], alpha=-1)
        into(d[j], torch.bmm, T[j], corrected)
        into(S[j + 1], torch.mul, S[j], kappa[j])
        S[j + 1].baddbmm_(k_out_t[j], d[j])
    return delta


def _as_row_chunk_token_head(t: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """``[N, L, X]`` -> ``[B, n, L, H, X]`` (a view, for :func:`_store`)."""
    return t.view(n, b, -1, *t.shape[1:]).permute(1, 0, 3, 2, 4)


class DeltaRuleBlocked(torch.autograd.Function):
    """``(q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,Kg], beta [B,T,H], seg [B,C,L], enter [B,C],
    h0 [B,H,K,V], scale, chunk, every) -> (o [B,T,H,V], S_final [B,H,K,V])``; ``q`` is scaled by
    ``scale`` here; ``seg`` and ``enter`` are padded to whole chunks
    (:func:`mixers.ops.common.chunks.entering_segments`). ``every > 1``: the steps come in groups of ``every`` and
    only each group's last step reads: ``q`` and ``o`` hold those steps only (``[B, T/every, ...]``;
    Gated DeltaProduct's Householder sub-steps), the other steps' queries are zeros."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, seg, enter, h0, scale, chunk, every=1, l2norm=False):
        b, _, h, _ = k.shape
        vd = v.shape[-1]
        out = v.new_empty(b, q.shape[1], h, vd)
        # with gradients wanted, kept for the backward: the state entering every chunk (and the
        # final one; K * V / L numbers per token and head: no replay of the recurrence), the
        # corrected values (V numbers per token and head) and the chunks' WY inverses (L numbers
        # per token and head, written there by the preparation: the backward's skips them);
        # without, one block's states are reused
        blocks = _blocks(b, h, seg.shape[1], chunk, max(k.shape[-1], vd))
        keep = any(ctx.needs_input_grad)
        rows = seg.shape[1] if keep else max(c1 - c0 for c0, c1 in blocks)
        states = q.new_empty(rows + 1, b * h, *h0.shape[2:])
        inverses = q.new_empty(seg.shape[1] * b * h, chunk, chunk) if keep else None
        deltas = q.new_empty(seg.shape[1] * b * h, chunk, vd) if keep else None
        states[0] = h0.reshape(b * h, *h0.shape[2:])
        masks = _all_masks(seg, enter, q.dtype)
        last = 0                                                # the row of the latest state
        for c0, c1 in blocks:
            blk = _Block(q, k, v, g, beta, masks, c0, c1, chunk, scale, every, l2norm)
            span = slice(c0 * b * h, c1 * b * h)
            p = blk.prep(inverse_out=inverses[span] if keep else None)
            s0 = c0 if keep else 0
            if not keep and last:
                states[0] = states[last]
            delta = recurrence(p, states[s0:s0 + blk.n + 1], blk.n, deltas[span] if keep else None)
            last = s0 + blk.n
            o = torch.bmm(p.q_read, states[s0:last].view(-1, *states.shape[2:])).baddbmm_(p.qk, delta.view(
                -1, chunk, vd))
            _store(out, _as_row_chunk_token_head(o, blk.n, b), blk.t0, every)
        if keep:
            ctx.save_for_backward(q, k, v, g, beta, seg, enter, states, inverses, deltas)
        ctx.scale, ctx.chunk, ctx.every, ctx.l2norm = scale, chunk, every, l2norm
        return out, states[last].view(b, h, *states.shape[2:]).clone()   # not a view of a saved buffer

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, seg, enter, states, inverses, deltas = ctx.saved_tensors
        b, _, h, kd = k.shape
        vd = v.shape[-1]
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        d_state = q.new_zeros(b * h, kd, vd) if d_final is None else d_final.reshape(b * h, kd, vd).clone()
        d_out = v.new_zeros(b, q.shape[1], h, vd) if d_out is None else d_out
        blocks = _blocks(b, h, seg.shape[1], ctx.chunk, max(kd, vd))
        masks = _all_masks(seg, enter, q.dtype)
        for index in range(len(blocks) - 1, -1, -1):
            c0, c1 = blocks[index]
            blk = _Block(q, k, v, g, beta, masks, c0, c1, ctx.chunk, ctx.scale, ctx.every, ctx.l2norm)
            d_o = _chunks(d_out, blk.t0, blk.n, ctx.chunk, ctx.every).permute(0, 1, 3, 2, 4)
            d_o = d_o.reshape(-1, ctx.chunk, vd)
            span = slice(c0 * b * h, c1 * b * h)
            p = blk.prep(inverse=inverses[span])
            d_state, block_grads = _block_backward(p, states[c0:c1], deltas[span], d_o, d_state, blk.n, ctx.scale,
                                                   blk.norms)
            for i, (full, part) in enumerate(zip(grads, block_grads)):
                _store(full, part, blk.t0, ctx.every if i == 0 else 1)
        return (*grads, None, None, d_state.view(b, h, kd, vd), None, None, None, None)


def _block_backward(p: Prep, entering, delta, d_o, d_state, n, scale, norms=None):
    """One block backwards from the states entering its chunks ``[n, B*H, K, V]`` and its corrected
    values ``[N, L, V]``: returns (gradient of the state entering the block, the block's input
    gradients as :func:`_store` views of ``[B, n, L, ...]``). ``norms``: the block's normalized q
    and k with their inverse norms (:class:`_Block`), whose backward is applied here."""
    N, length, kd = p.k.shape
    bh, vd = N // n, p.v.shape[-1]
    S = entering.reshape(N, kd, vd)
    from_out = torch.bmm(p.qk.transpose(1, 2), d_o).view(n, bh, length, vd)    # d delta from o = qk delta
    from_read = torch.bmm(p.q_read.transpose(1, 2), d_o).view(n, bh, kd, vd)    # d S from o = q_read S
    k_out, kappa = p.k_out.view(n, bh, length, kd), p.kappa.view(n, bh, -1, 1)
    # delta = T (R_U - R_W S) (see :func:`recurrence`): S's gradient through it is -R_W^T T^T d_delta,
    # and T^T d_delta is all that the WY system's backward needs (``prep_backward``'s ``read``)
    T_t = p.T.view(n, bh, length, length).transpose(2, 3)
    R_w_t = p.R_w.view(n, bh, length, kd).transpose(2, 3)
    # every product below writes a contiguous buffer: a strided ``out=`` makes bmm fall back to one
    # matmul per batch entry
    dd = d_o.new_empty(bh, length, vd)                                           # d delta of one chunk
    dR_u = d_o.new_empty(n, bh, length, vd)                                      # T^T d delta
    d_after = d_o.new_empty(n, bh, kd, vd)                                       # d of each leaving state
    d_after[n - 1] = d_state
    # the per-chunk views taken in one call each, as in :func:`recurrence`
    dR_u_j, after_j, from_out_j, from_read_j = dR_u.unbind(), d_after.unbind(), from_out.unbind(), from_read.unbind()
    k_out_j, T_t, R_w_t, kappa_j = k_out.unbind(), T_t.unbind(), R_w_t.unbind(), kappa.unbind()
    for j in range(n - 1, -1, -1):
        into(dd, torch.baddbmm, from_out_j[j], k_out_j[j], after_j[j])
        into(dR_u_j[j], torch.bmm, T_t[j], dd)
        d_enter = after_j[j - 1] if j else d_state
        into(d_enter, torch.baddbmm, from_read_j[j], R_w_t[j], dR_u_j[j], alpha=-1)
        d_enter.addcmul_(kappa_j[j], after_j[j])
    delta = delta.view(N, length, vd)
    d_q_read = torch.bmm(d_o, S.transpose(1, 2))
    d_qk = torch.bmm(d_o, delta.transpose(1, 2))
    d_k_out = torch.bmm(delta, d_after.view(N, kd, vd).transpose(1, 2))
    d_kappa = (d_after.view(N, kd, vd) * S).sum(-1, keepdim=True)
    if p.kappa.shape[1] == 1:
        d_kappa = d_kappa.sum(1, keepdim=True)
    dq, dk, dv, dbeta, dg = prep_backward(p, None, None, d_q_read, d_qk, d_k_out, d_kappa,
                                          read=(dR_u.view(N, length, vd), S, delta))
    dq.mul_(scale)
    if norms is not None:                            # chunk-major [N, L, K], like dq and dk
        y_q, r_q, y_k, r_k = (x.view(N, length, -1) for x in norms)
        normalize_backward(dq, y_q, r_q)
        normalize_backward(dk, y_k, r_k)
    b = N // (n * p.heads)
    views = [_as_row_chunk_token_head(x, n, b) for x in (dq, dk, dv)]
    views.append(dg.view(n, b, length, *dg.shape[2:]).transpose(0, 1).reshape(b, n, length, p.heads, -1))
    views.append(_as_row_chunk_token_head(dbeta, n, b).squeeze(-1))
    return d_state, views
