"""``varlen_attention`` under context parallelism: the continuing document's earlier keys.

    T_r = this rank's tokens, T1 = tokens of its first segment, T_pre = that segment's tokens on
    earlier ranks that its queries can reach (all of them, or the sliding window's ``left``),
    Hq / Hk = query / key-value heads, D = head dim

Causal attention inside documents needs, on each rank, only the keys and values of the
document it starts with that lie on earlier ranks. Every rank knows the layout, so one
all-to-all sends each rank exactly those rows (``[T_pre, 2, Hk, D]`` in all), nothing for
documents that start on the rank. The first segment's ``T1`` queries then attend over
``T_pre + T1`` keys, bottom-right causal (query i at key position ``T_pre + i``), through the same
choice as single-rank attention (:mod:`.choice`): PyTorch's ``varlen_attn`` with ``cu_seq_q = [0, T1]``
and ``cu_seq_k = [0, T_pre + T1]``, else flash-attn's varlen function with the same boundaries,
else blockwise SDPA; the rest of the shard runs the op unchanged. Keys' and values' gradients
return to their ranks through the exchange's backward.
Rotary positions are global (:attr:`ssm_pack.VarlenBatch.position_ids`), so the received keys
arrive rotated as the single-process run rotates them.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..common.chunks import compute_dtype
from ..common.cp_exchange import exchange
from . import kernel as flash_kernel
from . import kernel_torch
from ._validate import AttentionCall
from .choice import choose

BLOCK = 256


@lru_cache(maxsize=256)
def key_plan(layout, left: int) -> dict:
    """``{(sender, receiver): (lo, hi)}``: the global token range of keys the receiver's first
    segment needs from the sender (``left < 0``: no window). Kept per layout (the same every forward)."""
    plan, bounds = {}, layout.bounds
    for j in range(layout.size):
        if not layout.continues_in[j]:
            continue
        lo = layout.first_seg_start[j] if left < 0 else max(layout.first_seg_start[j], bounds[j] - left)
        if lo >= bounds[j]:
            continue
        for s in range(layout.rank_of(lo), j):
            a, b = max(bounds[s], lo), min(bounds[s + 1], bounds[j])
            if b > a:
                plan[(s, j)] = (a, b)
    return plan


def _continuing(q1, keys, values, offset: int, left: int, scale: float) -> torch.Tensor:
    """``q1 [T1, Hq, D]`` over ``keys, values [offset + T1, Hk, D]``, query i at key position
    ``offset + i`` (causal, window ``left``), SDPA block by block of queries."""
    t1, hq, _ = q1.shape
    groups = hq // keys.shape[1]
    outs = []
    for a in range(0, t1, BLOCK):
        b = min(a + BLOCK, t1)
        lo = 0 if left < 0 else max(0, offset + a - left)
        qpos = torch.arange(offset + a, offset + b, device=q1.device)[:, None]
        kpos = torch.arange(lo, offset + b, device=q1.device)[None, :]
        keep = kpos <= qpos if left < 0 else (kpos <= qpos) & (kpos >= qpos - left)
        kb, vb = (t[lo:offset + b].repeat_interleave(groups, dim=1) for t in (keys, values))
        o = F.scaled_dot_product_attention(q1[a:b].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1),
                                           attn_mask=keep, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _continuing_kernel(kernel: str, q1, keys, values, window: tuple[int, int], scale: float) -> torch.Tensor:
    """``q1 [T1, Hq, D]`` over ``keys, values [T_pre + T1, Hk, D]`` as one document of the attention
    ``kernel`` (``"torch_varlen"`` or ``"flash_attn"``): the kernels align causal bottom-right."""
    t1, tk = q1.shape[0], keys.shape[0]
    cu_q = torch.tensor([0, t1], dtype=torch.int32, device=q1.device)
    cu_k = torch.tensor([0, tk], dtype=torch.int32, device=q1.device)
    call = kernel_torch.varlen_call if kernel == "torch_varlen" else flash_kernel.varlen_call
    return call(q1.contiguous(), keys, values, cu_q, cu_k, t1, tk, causal=True, window=window, scale=scale)


def varlen_attention_cp(call: AttentionCall, local_op):
    """The CP version of :func:`mixers.ops.varlen_attention` (``call.varlen.cp`` set).
    ``local_op`` is the op itself, run on this rank's pieces without CP (passed in, so this module
    does not import its package)."""
    q, k, v, window, scale, backend = call.q, call.k, call.v, call.window, call.scale, call.backend
    if not call.causal:
        raise ValueError("varlen_attention: context parallelism needs causal=True (a query would need keys of "
                         "later ranks); run non-causal attention on the whole row")
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    plan = key_plan(lay, window[0])
    received = {}
    if plan:
        sends = {j: [k[a - lay.start:b - lay.start], v[a - lay.start:b - lay.start]]
                 for (s, j), (a, b) in plan.items() if s == r}
        recvs = {s: [(b - a, *k.shape[1:])] * 2 for (s, j), (a, b) in plan.items() if j == r}
        received = exchange(run, "attention", sends, recvs, k.dtype, anchors=(q, k, v))
    if not run.continues_in:
        out = local_op(q, k, v, run.local_cover, causal=True, window_size=window, softmax_scale=scale,
                       backend=backend)
        return run.anchor(out)
    t1 = run.first_len
    sources = sorted(received)
    keys = torch.cat([received[s][0] for s in sources] + [k[:t1]])
    values = torch.cat([received[s][1] for s in sources] + [v[:t1]])
    kernel = choose("varlen_attention", q, True, window, scale, backend)
    if kernel == "reference":
        compute = compute_dtype(q.dtype)
        first = _continuing(q[:t1].to(compute), keys.to(compute), values.to(compute), keys.shape[0] - t1,
                            window[0], scale).to(q.dtype)
    else:
        first = _continuing_kernel(kernel, q[:t1], keys, values, window, scale)
    if t1 == q.shape[0]:
        return run.anchor(first)
    rest = local_op(q[t1:], k[t1:], v[t1:], run.after_first, causal=True, window_size=window,
                    softmax_scale=scale, backend=backend)
    return run.anchor(torch.cat([first, rest]))
