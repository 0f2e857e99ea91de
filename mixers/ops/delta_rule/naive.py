"""The specification of the delta-rule ops: the gated (generalized) delta rule, token by token.

    T = tokens, H = key heads, HV = value heads, K, V = head dims, N = documents, nh = sub-steps

Per value head, from the document's initial state ``S`` ``[K, V]``, for every token t::

    S = diag(exp(g_t)) S                                  (gate: a scalar per head, or per key channel for KDA)
    for each of the nh Householder sub-steps j:           (nh = 1: Gated DeltaNet and KDA)
        S = (I - beta_j k_j k_j^T) S + beta_j k_j v_j^T   (delta rule: move S k_j towards v_j)
    o_t = S^T (scale q_t)

Gated DeltaNet (g ``[B, T, HV]``), KDA (g ``[B, T, HV, K]``) and Gated DeltaProduct (nh sub-steps,
k, v, beta ``[B, T * nh, ...]``, g ``[B, T, HV]`` or ``None``) are this one loop. Every document
runs alone. Written to be read, not to be fast: the torch backend (:mod:`.reference`, the chunked WY
form) and the kernels must agree with it; the tests hold them to it in fp64.
"""

from __future__ import annotations

import torch

from ..common.naive_documents import document_spans


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's ``l2norm``: ``x / sqrt(sum_K x^2 + 1e-6)``."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _run_document(q, k, v, g, beta, S, scale: float, nh: int):
    """One document of one value head: q ``[t, K]``; k, v, beta with nh sub-steps per token
    (``[t * nh, ...]``); g ``[t, K]`` or ``None``; S ``[K, V]``. Returns ``(o [t, V], S)``."""
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    outs = []
    for t in range(q.shape[0]):
        # 1. the gate, once per token, before its first sub-step
        if g is not None:
            S = torch.exp(g[t]).unsqueeze(-1) * S
        # 2. the Householder-like sub-steps: S = (I - beta k k^T) S + beta k v^T
        for j in range(t * nh, (t + 1) * nh):
            kj = k[j].unsqueeze(-1)
            S = (eye - beta[j] * kj @ kj.T) @ S + beta[j] * kj @ v[j].unsqueeze(0)
        # 3. the output, read after the last sub-step
        outs.append(S.T @ (scale * q[t]))
    o = torch.stack(outs) if outs else v.new_zeros(0, v.shape[-1])
    return o, S


def gated_delta_rule_naive(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, num_householder=1):
    """The three delta-rule ops (shapes as :func:`mixers.ops.chunk_gated_delta_rule`, ``chunk_kda``
    and ``chunk_gated_delta_product``).

    ``cu_seqlens`` ``[N+1]`` (``B == 1``) gives the documents, each from its own
    ``initial_state[n]`` ``[N, HV, K, V]``; without it every row is one document. Tokens after
    ``cu_seqlens[-1]`` are one more segment, from zeros. Returns ``(o [B, T, HV, V], final_state)``
    with ``final_state`` ``[N, HV, K, V]`` (or ``[B, ...]``) when ``output_final_state``, else ``None``.
    """
    rows, total, heads, kd = q.shape
    value_heads, vd, nh = v.shape[2], v.shape[3], num_householder
    scale = kd ** -0.5 if scale is None else scale
    # 1. optional normalization of queries and keys
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    # 2. one gate shape [B, T, HV, K] (or none); value head h reads key head h // (HV / H)
    if g is not None and g.dim() == 3:
        g = g.unsqueeze(-1).expand(*g.shape, kd)
    per_key = value_heads // heads
    o = v.new_zeros(rows, total, value_heads, vd)
    finals = {}
    # 3. every document and value head alone, from its own initial state
    for row, s, e, doc in document_spans(cu_seqlens, rows, total):
        for h in range(value_heads):
            S = initial_state[doc, h] if initial_state is not None and doc is not None else v.new_zeros(kd, vd)
            hk = h // per_key
            o_doc, S = _run_document(q[row, s:e, hk], k[row, s * nh:e * nh, hk], v[row, s * nh:e * nh, h],
                                     None if g is None else g[row, s:e, h], beta[row, s * nh:e * nh, h],
                                     S, scale, nh)
            o[row, s:e, h] = o_doc
            if doc is not None:
                finals[doc, h] = S
    if not output_final_state:
        return o, None
    count = rows if cu_seqlens is None else len(cu_seqlens) - 1
    final = [torch.stack([finals[i, h] for h in range(value_heads)]) for i in range(count)]
    return o, torch.stack(final) if final else v.new_zeros(0, value_heads, kd, vd)
