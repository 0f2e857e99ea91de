"""``mamba_chunk_scan_combined``: Mamba2's chunked SSD scan with upstream's signature.

    B = rows, T = tokens, H = heads, P = head dim, G = groups, Ns = state size, N = documents

Mirrors ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` and its return
conventions: ``out``, ``(out, final_states)``, ``(out, varlen_states)`` or
``(out, final_states, varlen_states)``. ``seq_idx`` resets the state at every change of value;
per-row ``initial_states`` feed the first segment of each row; ``final_states`` is the state
after each row's last token.

Beyond upstream: with ``cu_seqlens`` (``B == 1``), ``initial_states`` may hold one state per
document ``[N, H, P, Ns]``; ``varlen_states`` (per-document final states) are differentiable; and
``seq_idx`` is derived from ``cu_seqlens`` when not given (upstream would silently not reset).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssm_pack.formats.segments import segments_from_seq_idx

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import check_ssd_inputs
from .dt import process_dt
from .kernel import KERNEL_DTYPES, ssd_kernel
from .reference import ssd_chunked_reference
from .varlen_states import final_states, initial_chunk_states, initial_outputs

__all__ = ["mamba_chunk_scan_combined"]


def _missing_feature(x, per_doc, initial_states, return_varlen_states, tensors) -> str | None:
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype}"
    if per_doc:
        return "per-document initial states"
    if return_varlen_states and initial_states is not None:
        return "varlen states together with initial states"
    if return_varlen_states and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors):
        return "a backward pass through varlen states"
    return None


def _empty_result(x, B, initial_states, per_doc, varlen, return_final_states, return_varlen_states):
    """No tokens: every state is its initial state (or zeros)."""
    batch, _, heads, p = x.shape
    ns = B.shape[-1]
    results = [x.new_zeros(batch, 0, heads, p)]
    if return_final_states:
        rows = initial_states if initial_states is not None and not per_doc else x.new_zeros(batch, heads, p, ns)
        results.append(rows)
    if return_varlen_states:
        docs = varlen.num_docs
        results.append(initial_states if per_doc else x.new_zeros(docs, heads, p, ns))
    return results[0] if len(results) == 1 else tuple(results)


@outside_autocast
def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                              return_final_states=False, return_varlen_states=False, *, backend="auto"):
    """Mamba2 SSD scan over packed rows, resetting the state at every document.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]``; A: ``[H]``; B, C: ``[B, T, G, Ns]``.
        chunk_size: tokens per chunk (any T; documents may straddle chunks).
        D: ``[H]`` or ``[H, P]`` skip; z: ``[B, T, H, P]`` gate (``out * silu(z)``).
        dt_bias: ``[H]``; dt_softplus: apply softplus to ``dt + dt_bias``; dt_limit: clamp.
        initial_states: ``[B, H, P, Ns]`` per row, or ``[N, H, P, Ns]`` per document with cu_seqlens.
        seq_idx: ``[B, T]`` int document index per token; cu_seqlens: ``[N+1]`` (``B == 1``) or the
            forward's prebuilt :class:`ssm_pack.VarlenBatch`.
        return_final_states: also return ``[B, H, P, Ns]``, the state after each row.
        return_varlen_states: also return ``[N, H, P, Ns]``, the state after each document.
        backend: ``"auto"``, ``"kernel"`` (mamba-ssm, CUDA) or ``"reference"``.
    """
    per_doc, varlen = check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                       cu_seqlens, dt_limit, return_varlen_states)
    if varlen is not None and varlen.cp is not None:          # context parallelism: cp.py
        from .cp import ssd_cp
        return ssd_cp(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, per_doc, dt_softplus, dt_limit,
                      return_final_states, return_varlen_states, varlen, backend, seq_idx,
                      mamba_chunk_scan_combined)
    batch, length, heads, _ = x.shape
    if length == 0:
        return _empty_result(x, B, initial_states, per_doc, varlen, return_final_states, return_varlen_states)
    missing = _missing_feature(x, per_doc, initial_states, return_varlen_states,
                               (x, dt, A, B, C, D, z, dt_bias, initial_states))
    choice = dispatch.select_backend("mamba_chunk_scan_combined", backend, on_cuda=dispatch.is_cuda(x),
                                      support_state=lambda: dispatch.cached_support("mamba_ssd", ("seq_idx",)),
                                      missing_feature=missing)
    if choice == "kernel":                       # upstream resets only at seq_idx, so always pass one
        if seq_idx is None:
            seq_idx = varlen.seq_idx if varlen is not None else \
                torch.zeros(batch, length, dtype=torch.int32, device=x.device)
        return ssd_kernel(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                          varlen.cu_seqlens if return_varlen_states else None, dt_softplus, dt_limit,
                          return_final_states, return_varlen_states)
    compute = compute_dtype(x.dtype)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, compute)
    xc, Bc, Cc, Ac = x.to(compute), B.to(compute), C.to(compute), A.to(compute)
    if varlen is not None:
        segs = varlen.segments
    elif seq_idx is not None:
        segs = segments_from_seq_idx(seq_idx)
    else:
        segs = segments_from_seq_idx(torch.zeros(batch, length, dtype=torch.int32, device=x.device))
    h0 = initial_states.to(compute) if initial_states is not None else None
    extra = None
    if per_doc:
        extra = lambda a_cs, seg: initial_chunk_states(h0, segs, a_cs, seg, chunk_size)  # noqa: E731
    Dc = None if D is None else D.to(compute)
    zc = None if z is None else z.to(compute)
    y, ch = ssd_chunked_reference(xc, dtp, Ac, Bc, Cc, segs.seg_id, chunk_size,
                                  initial_state=None if per_doc else h0, extra_states=extra,
                                  D=None if per_doc else Dc, z=None if per_doc else zc,
                                  keep_enter=return_varlen_states)
    a_cs_flat = ch.a_cs.reshape(-1, heads)
    if per_doc:  # the documents' own initial states are read before the skip and the gate
        y = y + initial_outputs(h0, segs, a_cs_flat, Cc[0], chunk_size, heads).unsqueeze(0)
        if Dc is not None:
            y = y + xc * (Dc[:, None] if Dc.dim() == 1 else Dc)
        if zc is not None:
            y = y * F.silu(zc)
    out = y.to(x.dtype)
    results = [out]
    if return_final_states:
        results.append(ch.h_final.to(x.dtype))
    if return_varlen_states:
        xdt = (xc * dtp.unsqueeze(-1))[0]
        states = final_states(h0 if per_doc else None, segs, a_cs_flat, xdt, Bc[0], ch.h_enter, ch.enter_seg,
                              chunk_size, varlen.num_docs)
        results.append(states.to(x.dtype))
    return results[0] if len(results) == 1 else tuple(results)
