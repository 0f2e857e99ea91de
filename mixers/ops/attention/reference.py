"""The torch backend of the attention ops: attention inside segments, over blocks of queries,
without a dense ``[T, T]`` mask.

    T = tokens, Hq / Hk = query / key-value heads (Hk divides Hq), G = Hq // Hk, D = head dim,
    Q = queries per block, W = keys one block can see, n = blocks, g = blocks in one group

One core serves :func:`.segment.segment_attention` (segments from position-id resets, ``[B, H, S, D]``)
and the reference of :func:`mixers.ops.varlen_attention` (segments from ``cu_seqlens``, ``[T, H, D]``).

A query attends only keys of its own segment, and no segment is longer than ``span`` tokens, so
block ``i`` of queries ``[iQ, iQ + Q)`` needs keys ``[iQ - back, iQ + Q + ahead)`` only, where
``back`` / ``ahead`` are the span (narrowed by a sliding window; ``ahead = 0`` when causal)
rounded up to a multiple of Q. Every block's window is a view into one padded copy of K and V;
groups of blocks run as batched matmuls. Time and memory grow with ``T * W``, not ``T^2``; all
sizes derive from shapes and ``span``, so nothing reads a tensor value. While ``torch.compile``
traces, the reach is rounded to a power-of-two multiple of Q instead, which keeps the number of
distinct sizes, hence compile specialisations, logarithmic in the longest document.

1. scores ``q k^T * scale`` per group, ``-inf`` outside the keep-mask (same segment, causal,
   window); 2. ``lse = logsumexp``, ``p = exp(s - lse)``; 3. ``out = p v``. The backward recomputes
   ``p`` from the saved ``lse`` (flash-attention's recipe) and accumulates the key and value
   gradients window by window.

Non-finite values stay in their segment. A sum over keys would turn a masked ``0 * nan`` of
another segment into ``nan``, so q, k, v (and the output gradient) enter the products with
non-finite entries replaced by 0, and every row that really depends on a non-finite value is
set back to ``nan``: a query row whose own q is non-finite or that attends a key whose k or v is
(a finite 0/1 matmul of the keep-mask with per-token flags). In the backward, a query row is hot
when its output gradient is non-finite, or nonzero on a poisoned output (the loss depends on a
NaN): its q gradient and the k / v gradients of every key it reaches are NaN; a poisoned output
whose gradient is exactly 0 (a masked loss) contributes nothing, so the gradients stay finite.
Other segments see only finite numbers, bitwise as without the bad values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import device_policy
from ..common.chunks import compute_dtype
from ._validate import AttentionCall

BLOCK = 128
_GROUP_ELEMENTS = 1 << 22          # scores of one group of blocks: ~16 MB in fp32


def _reach(span: int, limit: int, block: int) -> int:
    """Keys needed on one side: ``min(span - 1, limit)`` rounded up to a multiple of ``block``
    (0 stays 0); while compiling, to ``block * 2**k``, so that the sizes a graph specialises on
    stay few (logarithmic in the longest document) at the price of up to twice the keys."""
    need = span - 1 if limit < 0 else min(span - 1, limit)
    if need <= 0:
        return 0
    if not torch.compiler.is_compiling():
        return -(-need // block) * block
    size = block
    while size < need:
        size *= 2
    return size


def _finite(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t with non-finite entries set to 0, [T] bool: the token has a non-finite entry)``.

    One ``sum`` first (no allocation): when it is finite, so is every entry, and ``t`` itself is
    returned. Not while compiling (a graph cannot branch on a value; the compiler fuses the mask),
    nor branch-free (policy ``"cuda"``: no host read, see ``device_policy.branch_free_isolation``)."""
    if (not torch.compiler.is_compiling() and not device_policy.branch_free_isolation(t)
            and bool(torch.isfinite(t.sum()))):
        return t, torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    ok = torch.isfinite(t)
    return torch.where(ok, t, torch.zeros((), dtype=t.dtype, device=t.device)), ~ok.flatten(1).all(1)


class _Layout:
    """Block and window geometry of one call (plain ints and two small index tensors)."""

    def __init__(self, total, span, causal, window, block, heads, device):
        left, right = window
        self.block = block
        self.back = _reach(span, left, block)
        self.ahead = 0 if causal else _reach(span, right, block)
        self.width = self.back + block + self.ahead                     # W
        self.blocks = -(-total // block)                               # n
        self.padded = self.blocks * block
        per_block = heads * block * self.width
        self.group = max(1, _GROUP_ELEMENTS // max(per_block, 1))
        rel = torch.arange(self.width, device=device)[None, :] - self.back - torch.arange(block, device=device)[:, None]
        keep = torch.ones(block, self.width, dtype=torch.bool, device=device)   # [Q, W]: key - query offsets
        if causal:
            keep &= rel <= 0
        if left >= 0:
            keep &= rel >= -left
        if right >= 0 and not causal:
            keep &= rel <= right
        self.offsets_keep = keep

    def windows(self, t: torch.Tensor, fill) -> torch.Tensor:
        """``[T, ...]`` -> ``[n, W, ...]`` view: the keys every block can see (padded with ``fill``)."""
        pad = [0, 0] * (t.dim() - 1) + [self.back, self.padded - t.shape[0] + self.ahead]
        padded = F.pad(t, pad, value=fill)
        return padded.unfold(0, self.width, self.block).movedim(-1, 1)


def _group_keep(layout, seg_q, seg_w, b0, b1):
    """``[g, Q, W]`` keep-mask of blocks ``b0:b1``: same segment and the offset rules."""
    q = seg_q[b0:b1].unsqueeze(-1)                                       # [g, Q, 1]
    return (q == seg_w[b0:b1].unsqueeze(1)) & layout.offsets_keep


def _group_heads_into_rows(t, b0, b1, block, hk):
    """``[n*Q, Hq, D]`` rows of blocks ``b0:b1`` -> ``[g, Hk, G*Q, D]`` (group heads fold into rows)."""
    g = b1 - b0
    x = t[b0 * block:b1 * block].reshape(g, block, hk, -1, t.shape[-1])   # [g, Q, Hk, G, D]
    return x.permute(0, 2, 3, 1, 4).reshape(g, hk, -1, t.shape[-1])


def _rows_to_token_major(t, block, hq):
    """``[g, Hk, G*Q, D]`` -> ``[g*Q, Hq, D]``."""
    g, hk, _, d = t.shape
    return t.reshape(g, hk, hq // hk, block, d).permute(0, 3, 1, 2, 4).reshape(g * block, hq, d)


class _BlockAttention(torch.autograd.Function):
    """``(q [T,Hq,D], k, v [T,Hk,D], seg [T]) -> out [T,Hq,D]`` (shapes in the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, seg, span, causal, window, scale, block):
        total, hq, d = q.shape
        hk = k.shape[1]
        layout = _Layout(total, span, causal, window, block, hq, q.device)
        (qs, bad_q), (ks, bad_k), (vs, bad_v) = _finite(q), _finite(k), _finite(v)
        pad = layout.padded - total
        qs, seg_q = _pad_rows(qs, pad), F.pad(seg, (0, pad), value=-1).view(layout.blocks, block)
        bad_q = F.pad(bad_q, (0, pad)).view(layout.blocks, block)
        k_w, v_w, seg_w = layout.windows(ks, 0.0), layout.windows(vs, 0.0), layout.windows(seg, -1)
        bad_w = layout.windows((bad_k | bad_v).to(q.dtype), 0.0)                 # [n, W]
        out = torch.empty_like(qs)
        lse = torch.empty(layout.padded, hq, dtype=q.dtype, device=q.device)
        poisoned = torch.empty(layout.blocks, block, dtype=torch.bool, device=q.device)
        for b0 in range(0, layout.blocks, layout.group):
            b1 = min(b0 + layout.group, layout.blocks)
            keep = _group_keep(layout, seg_q, seg_w, b0, b1)                       # [g, Q, W]
            qb = _group_heads_into_rows(qs, b0, b1, block, hk)
            s = (qb @ k_w[b0:b1].transpose(1, 2).transpose(-1, -2)) * scale        # [g, Hk, G*Q, W]
            s = s.view(b1 - b0, hk, -1, block, layout.width).masked_fill(~keep[:, None, None], float("-inf"))
            m = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - m).view(b1 - b0, hk, -1, layout.width)
            out[b0 * block:b1 * block] = _rows_to_token_major(p @ v_w[b0:b1].transpose(1, 2), block, hq)
            lse[b0 * block:b1 * block] = _rows_to_token_major(m.view(b1 - b0, hk, -1, 1), block, hq)[..., 0]
            hits = (keep.to(q.dtype) @ bad_w[b0:b1].unsqueeze(-1))[..., 0] > 0      # a bad key is attended
            poisoned[b0:b1] = hits | bad_q[b0:b1]
        poisoned = poisoned.reshape(-1)
        ctx.save_for_backward(qs, ks, vs, seg, out, lse, poisoned)
        ctx.meta = (span, causal, window, scale, block)
        # a copy even when no row is poisoned: ``out`` is kept for the backward, and the caller may
        # modify the result in place (a view of it could not be)
        return out[:total].masked_fill(poisoned[:total, None, None], float("nan"))

    @staticmethod
    def backward(ctx, g_out):
        qs, ks, vs, seg, out, lse, poisoned = ctx.saved_tensors
        span, causal, window, scale, block = ctx.meta
        total, hk = ks.shape[0], ks.shape[1]
        hq = qs.shape[1]
        layout = _Layout(total, span, causal, window, block, hq, qs.device)
        pad = layout.padded - total
        do, bad_do = _finite(g_out)
        # hot rows: a non-finite cotangent, or a nonzero one on a poisoned output (the loss depends on
        # a NaN); a poisoned output whose cotangent is exactly 0 (a masked loss) contributes nothing
        hot = bad_do | (poisoned[:total] & (do != 0).flatten(1).any(1))
        do = _pad_rows(do, pad)
        rows_bad = F.pad(hot, (0, pad)).view(layout.blocks, block)
        seg_q = F.pad(seg, (0, pad), value=-1).view(layout.blocks, block)
        k_w, v_w, seg_w = layout.windows(ks, 0.0), layout.windows(vs, 0.0), layout.windows(seg, -1)
        dq = torch.empty_like(qs)
        dk_w = qs.new_empty(layout.blocks, layout.width, hk, qs.shape[-1])   # every block writes its rows
        dv_w = torch.empty_like(dk_w)
        reached = qs.new_zeros(layout.blocks, layout.width)
        for b0 in range(0, layout.blocks, layout.group):
            b1 = min(b0 + layout.group, layout.blocks)
            g = b1 - b0
            keep = _group_keep(layout, seg_q, seg_w, b0, b1)
            qb = _group_heads_into_rows(qs, b0, b1, block, hk)
            dob = _group_heads_into_rows(do, b0, b1, block, hk)
            ob = _group_heads_into_rows(out, b0, b1, block, hk)
            kb, vb = k_w[b0:b1].transpose(1, 2), v_w[b0:b1].transpose(1, 2)       # [g, Hk, W, D]
            s = (qb @ kb.transpose(-1, -2)) * scale
            s = s.view(g, hk, -1, block, layout.width).masked_fill(~keep[:, None, None], float("-inf"))
            m = _group_heads_into_rows(lse[:, :, None], b0, b1, block, hk).view(g, hk, -1, block, 1)
            p = torch.exp(s - m).view(g, hk, -1, layout.width)
            dv_w[b0:b1] = (p.transpose(-1, -2) @ dob).transpose(1, 2)
            dp = dob @ vb.transpose(-1, -2)
            ds = p * (dp - (dob * ob).sum(-1, keepdim=True))
            dq[b0 * block:b1 * block] = _rows_to_token_major((ds @ kb) * scale, block, hq)
            dk_w[b0:b1] = ((ds.transpose(-1, -2) @ qb) * scale).transpose(1, 2)
            reached[b0:b1] = (rows_bad[b0:b1].to(qs.dtype).unsqueeze(1) @ keep.to(qs.dtype))[:, 0]
        dk, dv = _overlap_add(dk_w, layout, total), _overlap_add(dv_w, layout, total)
        key_bad = _overlap_add(reached[..., None, None], layout, total)[:, 0, 0] > 0
        return (_nan_rows(dq[:total], rows_bad.reshape(-1)[:total]), _nan_rows(dk, key_bad), _nan_rows(dv, key_bad),
                None, None, None, None, None, None)


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``[T, H, D]`` with ``pad`` zero rows appended; ``t`` itself when there are none (``F.pad``
    copies even then: a fresh ``[T, H, D]`` that a long sequence pays a page fault per 4 KB for)."""
    return t if pad == 0 else F.pad(t, (0, 0, 0, 0, 0, pad))


def _nan_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A gradient ``t [T, H, D]`` with the ``rows [T]`` (bool) set to NaN: a copy when a row is set,
    else ``t`` itself (the common case: nothing non-finite; one host read, like :func:`_finite`'s)."""
    if torch.compiler.is_compiling() or device_policy.branch_free_isolation(t) or bool(rows.any()):
        return t.masked_fill(rows[:, None, None], float("nan"))
    return t


def _overlap_add(windows: torch.Tensor, layout: _Layout, total: int) -> torch.Tensor:
    """Sum the overlapping per-block windows ``[n, W, ...]`` back onto the ``[T, ...]`` tokens."""
    q = layout.block
    parts = layout.width // q
    rows = layout.blocks + parts - 1
    acc = windows.new_zeros(rows * q, *windows.shape[2:])
    for j in range(parts):                  # sub-block j of window i is key block i + j (padded coords)
        acc[j * q:(layout.blocks + j) * q] += windows[:, j * q:(j + 1) * q].reshape(-1, *windows.shape[2:])
    return acc[layout.back:layout.back + total]


def blockwise_attention(q, k, v, seg, span: int, *, causal: bool = True, window=(-1, -1), scale=None,
                        block: int = BLOCK) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over ``k, v [T, Hk, D]`` inside the segments ``seg [T]``.

    ``span`` bounds every segment's length (the longest is enough; no value is read to check
    it); ``window = (left, right)`` is flash-attn's sliding window (-1 = unbounded);
    ``scale`` defaults to ``D ** -0.5``. Differentiable; returns ``[T, Hq, D]``.
    """
    total, _, d = q.shape
    if total == 0:
        return q.clone()
    scale = d ** -0.5 if scale is None else float(scale)
    return _BlockAttention.apply(q, k, v, seg, max(int(span), 1), bool(causal), tuple(window), scale, block)


def varlen_attention_reference(call: AttentionCall) -> torch.Tensor:
    """The torch backend of :func:`mixers.ops.varlen_attention`: the blockwise core in the compute dtype."""
    q, k, v = call.q, call.k, call.v
    compute = compute_dtype(q.dtype)
    out = blockwise_attention(q.to(compute), k.to(compute), v.to(compute), call.varlen.seq_idx[0], call.max_seqlen,
                              causal=call.causal, window=call.window, scale=call.scale)
    return out.to(q.dtype)
