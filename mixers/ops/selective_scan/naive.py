"""The specification of ``selective_scan_fn``: Mamba's selective scan, one token at a time, one
document at a time.

    T = tokens, E = channels (Mamba's d_inner), Ns = state size, N = documents

The recurrence (Mamba, "selective state spaces", Algorithm 2), per channel ``d`` and state
entry ``n``, from the document's initial state::

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] u_t[d]
    y_t[d]    = sum_n C_t[n] h_t[d, n] + D[d] u_t[d],   then   y_t[d] *= silu(z_t[d])

``A`` is diagonal per channel (``[E, Ns]``), ``B``, ``C`` and ``dt`` depend on the token. Every
document runs alone, so no state can cross a boundary. Written to be read, not to be fast: the
torch backend (:mod:`.reference`) must agree with it; the tests hold it to it in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.naive_documents import document_spans


def _scan_document(u, dt, A, B, C, h):
    """One document: u, dt ``[T, E]``, A ``[E, Ns]``, B, C ``[T, Ns]``, h ``[E, Ns]`` its initial
    state. Returns ``(y [T, E], h_final [E, Ns])``."""
    ys = []
    for t in range(u.shape[0]):
        h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * u[t])[:, None] * B[t][None, :]
        ys.append((h * C[t][None, :]).sum(-1))
    return (torch.stack(ys) if ys else u.new_zeros(0, u.shape[1])), h


def selective_scan_naive(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         return_last_state=False, *, initial_states=None, cu_seqlens=None,
                         return_varlen_states=False):
    """Mamba's selective scan over packed rows (shapes as :func:`mixers.ops.selective_scan_fn`:
    ``u, delta, z [B, E, T]``, ``A [E, Ns]``, ``B, C [B, Ns, T]``).

    ``cu_seqlens`` ``[N+1]`` (``B == 1``) gives the documents, each from its own
    ``initial_states[n]`` ``[N, E, Ns]``; without it every row is one document (``[B, E, Ns]``).
    Tokens after ``cu_seqlens[-1]`` are one more segment, from zeros. Returns ``out [B, E, T]``,
    then the state after each row's last token ``[B, E, Ns]`` (whatever segment holds it; empty
    documents after it do not change it) and the state after each document ``[N, E, Ns]`` when asked.
    """
    rows, channels, total = u.shape
    # 1. the step sizes: delta + delta_bias, softplus
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    # 2. token-major views: [B, T, E] and [B, T, Ns]
    u_t, dt_t, B_t, C_t = u.transpose(1, 2), dt.transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2)
    # 3. every document alone, from its own initial state
    y = torch.zeros_like(u_t)
    zero = u.new_zeros(channels, A.shape[1])
    row_final, doc_final = [zero] * rows, {}
    for row, s, e, doc in document_spans(cu_seqlens, rows, total):
        h0 = initial_states[doc] if initial_states is not None and doc is not None else zero
        y_doc, h = _scan_document(u_t[row, s:e], dt_t[row, s:e], A, B_t[row, s:e], C_t[row, s:e], h0)
        y[row, s:e] = y_doc
        if e > s or cu_seqlens is None:         # the state after the row's last token
            row_final[row] = h
        if doc is not None:
            doc_final[doc] = h
    # 4. the skip and the gate, per token
    y = y.transpose(1, 2)
    if D is not None:
        y = y + u * D[:, None]
    if z is not None:
        y = y * F.silu(z)
    results = [y]
    if return_last_state:
        results.append(torch.stack(row_final))
    if return_varlen_states:
        count = len(cu_seqlens) - 1
        results.append(torch.stack([doc_final[i] for i in range(count)]) if count else u.new_zeros(0, *zero.shape))
    return results[0] if len(results) == 1 else tuple(results)
