"""The specification of ``mamba_chunk_scan_combined``: Mamba2's SSD, chunked, one document at a time.

    T = tokens, H = heads, P = head dim, G = groups, Ns = state size, L = chunk length, N = documents

The recurrence (Mamba2, "state space duality"), per head, from the document's initial state::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        [P, Ns]
    y_t = h_t C_t + D x_t,   then   y_t *= silu(z_t)

evaluated the way the paper's minimal SSD does it: the document is cut into chunks of L tokens,
the outputs inside each chunk come from one masked matrix product, the chunk states are carried
from chunk to chunk by a short recurrence. Every document runs alone, so no state can cross a
boundary. Written to be read, not to be fast: the torch backend (:mod:`.reference` with
:mod:`.chunk_scan`) and the kernels must agree with it; the tests hold them to it in fp64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..common.naive_documents import document_spans


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``[..., L] -> [..., L, L]``: entry ``(i, j)`` is ``a[j+1] + ... + a[i]`` for ``j <= i``, else ``-inf``."""
    length = a.shape[-1]
    sums = a.cumsum(-1)
    out = sums[..., :, None] - sums[..., None, :]
    keep = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~keep, -math.inf)


def _ssd_document(x, a, B, C, chunk: int, h0):
    """One document: x ``[T, H, P]`` (already times dt), a = dt A ``[T, H]``, B, C ``[T, H, Ns]``,
    h0 ``[H, P, Ns]``. Returns ``(y [T, H, P], h_final [H, P, Ns])``."""
    length = x.shape[0]
    pad = -length % chunk                     # padded tokens carry a = 0 and x = 0: they change nothing
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    a = F.pad(a, (0, 0, 0, pad))
    # 1. cut into chunks: [c, L, ...], and the running log-decay inside each chunk [c, H, L]
    x, B, C = (t.reshape(-1, chunk, *t.shape[1:]) for t in (x, B, C))
    a = a.reshape(-1, chunk, a.shape[-1]).permute(0, 2, 1)
    a_cum = a.cumsum(-1)
    # 2. inside each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) x_j
    decay = torch.exp(_segment_sums(a))                                         # [c, H, L, L]
    y = torch.einsum("clhn,cshn,chls,cshp->clhp", C, B, decay, x)
    # 3. the state each chunk adds, from zero, at its end: sum_j exp(a_{j+1} + ... + a_L) x_j B_j^T
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                                 # [c, H, L]
    added = torch.einsum("clhn,chl,clhp->chpn", B, to_end, x)
    # 4. carry states across chunks: entering chunk c is h0 and every earlier chunk's, decayed
    states = torch.cat([h0.unsqueeze(0), added])                               # [c+1, H, P, Ns]
    chunk_decay = torch.exp(_segment_sums(F.pad(a_cum[..., -1], (0, 0, 1, 0)).transpose(0, 1)))  # [H, c+1, c+1]
    carried = torch.einsum("hzc,chpn->zhpn", chunk_decay, states)
    entering, h_final = carried[:-1], carried[-1]
    # 5. what the entering state contributes to each token: exp(a_1 + ... + a_i) h C_i
    y = y + torch.einsum("clhn,chpn,chl->clhp", C, entering, torch.exp(a_cum))
    return y.reshape(-1, *y.shape[2:])[:length], h_final


def mamba_chunk_scan_naive(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                           cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
                           return_varlen_states=False):
    """Mamba2 SSD over packed rows (shapes as :func:`mixers.ops.mamba_chunk_scan_combined`).

    ``cu_seqlens`` ``[N+1]`` (``B == 1``) gives the documents, each from its own
    ``initial_states[n]`` ``[N, H, P, Ns]``; without it every row is one document (``[B, H, P, Ns]``).
    Tokens after ``cu_seqlens[-1]`` are one more segment, from zeros. Returns ``out``, then the
    state after each row's last token ``[B, H, P, Ns]`` and the state after each document
    ``[N, H, P, Ns]`` when asked.
    """
    rows, total, heads, _ = x.shape
    per_group = heads // B.shape[2]
    # 1. the step sizes: dt + dt_bias, softplus, clamp
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    # 2. per head: its group's B and C, the decay exponent dt A and the input dt x
    Bh, Ch = B.repeat_interleave(per_group, dim=2), C.repeat_interleave(per_group, dim=2)
    a, xdt = dt * A, x * dt.unsqueeze(-1)
    # 3. every document alone, from its own initial state
    y = torch.zeros_like(x)
    zero = x.new_zeros(heads, x.shape[-1], B.shape[-1])
    row_final = [zero] * rows
    doc_final = {}
    for row, s, e, doc in document_spans(cu_seqlens, rows, total):
        h0 = initial_states[doc] if initial_states is not None and doc is not None else zero
        if e > s:
            y_doc, h = _ssd_document(xdt[row, s:e], a[row, s:e], Bh[row, s:e], Ch[row, s:e], chunk_size, h0)
            y[row, s:e] = y_doc
        else:
            h = h0
        row_final[row] = h
        if doc is not None:
            doc_final[doc] = h
    # 4. the skip and the gate, per token
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    results = [y]
    if return_final_states:
        results.append(torch.stack(row_final))
    if return_varlen_states:
        count = len(cu_seqlens) - 1
        results.append(torch.stack([doc_final[i] for i in range(count)]) if count else x.new_zeros(0, *zero.shape))
    return results[0] if len(results) == 1 else tuple(results)
