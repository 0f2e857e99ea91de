"""The specification of ``chunk_simple_gla``: linear attention with a constant per-head decay (MiniMax's
lightning attention), one token at a time, one document at a time.

    T = tokens, H = heads, K = key head dim, V = value head dim, N = documents

Per head ``h``, from the document's initial state ``S_0 [K, V]``:

1. ``q_t <- scale * q_t``;
2. ``S_t = exp(g_gamma[h]) * S_{t-1} + k_t^T v_t``   (``g_gamma <= 0`` is the log decay, MiniMax's
   ``-slope``);
3. ``o_t = q_t S_t``.

Every document runs alone from its own initial state, so nothing crosses a boundary. Written to be
read, not fast: the backend (:mod:`.as_ssd`) and the decode step (:mod:`.update`) are held to it.
"""

from __future__ import annotations

import torch

from ..common.naive_documents import document_spans


def _document(q, k, v, decay, s0):
    """One document: q, k ``[T, H, K]``, v ``[T, H, V]``, decay ``[H]`` (``exp(g_gamma)``), s0 ``[H, K, V]``.
    Returns ``(o [T, H, V], S_T [H, K, V])``."""
    state, out = s0, []
    for t in range(q.shape[0]):
        state = decay[:, None, None] * state + k[t, :, :, None] * v[t, :, None, :]    # 2.
        out.append(torch.einsum("hk,hkv->hv", q[t], state))                          # 3.
    return (torch.stack(out) if out else v[:0]), state


def simple_gla_naive(q, k, v, g_gamma, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """``(o [B, T, H, V], final_state [N or B, H, K, V] or None)``; shapes as :func:`mixers.ops.chunk_simple_gla`.

    ``cu_seqlens`` ``[N+1]`` (``B == 1``) gives the documents, each from ``initial_state[n]``; without it
    each row is one document. Tokens after ``cu_seqlens[-1]`` are one more segment, from zeros, whose
    state is not returned.
    """
    rows, total, heads, kd = q.shape
    vd = v.shape[-1]
    scale = kd ** -0.5 if scale is None else scale
    q = q * scale                                                                     # 1.
    decay = torch.exp(g_gamma.to(q.dtype))
    zero = q.new_zeros(heads, kd, vd)
    o = torch.zeros_like(v)
    finals = {}
    for row, s, e, doc in document_spans(cu_seqlens, rows, total):
        s0 = initial_state[doc] if initial_state is not None and doc is not None else zero
        o_doc, state = _document(q[row, s:e], k[row, s:e], v[row, s:e], decay, s0)
        o[row, s:e] = o_doc
        if doc is not None:
            finals[doc] = state
    if not output_final_state:
        return o, None
    count = rows if cu_seqlens is None else len(cu_seqlens) - 1
    return o, (torch.stack([finals[i] for i in range(count)]) if count else q.new_zeros(0, heads, kd, vd))
