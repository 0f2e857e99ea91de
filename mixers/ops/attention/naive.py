"""The specification of ``varlen_attention``: softmax attention inside each document.

    T = packed tokens, Hq = query heads, Hk = key/value heads, D = head dim, N = documents

Per document and query head, with ``i`` and ``j`` positions inside the document::

    s_ij = scale q_i . k_j                       for the keys query i may see, -inf elsewhere
    o_i  = sum_j softmax_j(s_ij) v_j

Query i sees key j when ``j <= i`` (``causal``) and ``i - left <= j <= i + right``
(``window_size=(left, right)``, -1 = unbounded; flash-attn's sliding window). Query head h reads
key/value head ``h // (Hq / Hk)``. Every document runs alone. Written to be read, not to be fast:
the blockwise torch backend and the kernels must agree with it; the tests hold them to it in fp64.
"""

from __future__ import annotations

import torch


def _visible(length: int, causal: bool, window, device) -> torch.Tensor:
    """``[length, length]`` bool: query i may see key j."""
    i = torch.arange(length, device=device).unsqueeze(1)
    j = torch.arange(length, device=device).unsqueeze(0)
    left, right = (-1, -1) if window is None else window
    keep = torch.ones(length, length, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def varlen_attention_naive(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, window_size=None,
                           softmax_scale=None):
    """Attention restricted to each document; q ``[T, Hq, D]``, k, v ``[T, Hk, D]`` -> ``[T, Hq, D]``.

    ``cu_seqlens`` ``[N+1]``; tokens after ``cu_seqlens[-1]`` form one more segment. ``max_seqlen``
    is accepted for the signature and not needed.
    """
    total, heads, dim = q.shape
    per_kv = heads // k.shape[1]
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    bounds = [int(c) for c in cu_seqlens]
    spans = list(zip(bounds[:-1], bounds[1:])) + ([(bounds[-1], total)] if total > bounds[-1] else [])
    out = torch.zeros_like(q)
    for s, e in spans:
        if e == s:
            continue
        keep = _visible(e - s, causal, window_size, q.device)
        for h in range(heads):
            # 1. the scores of the document's queries against its own keys
            scores = scale * q[s:e, h] @ k[s:e, h // per_kv].T
            # 2. the mask: keys a query may not see get -inf
            scores = scores.masked_fill(~keep, float("-inf"))
            # 3. softmax over the keys, then the weighted sum of the values
            out[s:e, h] = torch.softmax(scores, dim=-1) @ v[s:e, h // per_kv]
    return out
