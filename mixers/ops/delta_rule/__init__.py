"""Gated DeltaNet, KDA and Gated DeltaProduct ops with fla's signatures, on one chunked core.

    B = rows, T = tokens, H = key heads, HV = value heads (a multiple of H), K, V = head dims,
    N = documents (with ``cu_seqlens``, ``B == 1``) or rows

* ``chunk_gated_delta_rule``: g ``[B, T, HV]`` (scalar log-decay per head);
* ``chunk_kda``: g ``[B, T, HV, K]`` (per-channel log-decay);
* ``chunk_gated_delta_product``: k, v, beta carry ``num_householder`` sub-steps per token
  interleaved (``[B, T * nh, ...]``, fla's layout); the gate ``g`` ``[B, T, H]`` (or ``None``)
  applies once per token, before its first sub-step; the output is read after the last.

All return ``(o [B, T, HV, V], final_state)`` where ``final_state`` is ``[N, HV, K, V]`` (one per
document with ``cu_seqlens``) when ``output_final_state`` else ``None``; ``initial_state`` has
the same shape. A padding tail after ``cu_seqlens[-1]`` is its own segment; empty documents keep
their initial state. ``chunk_size`` (keyword-only, a power of two) and ``backend`` are ssm-pack's.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import check_delta_inputs
from .chunk import delta_rule_chunked
from .kernel import fla_kernel, unsupported
from .recurrent import gated_delta_product_step, gated_delta_rule_step, kda_step
from .varlen_states import DocInitialStates, doc_final_states

__all__ = ["chunk_gated_delta_product", "chunk_gated_delta_rule", "chunk_kda", "gated_delta_product_step",
           "gated_delta_rule_step", "kda_step"]


def _substeps(x, nh, at):
    """Sub-step layout ``[B, T * nh, ...]``: ``x`` on each token's sub-step ``at``, zeros elsewhere
    (``q`` is read at the last sub-step, ``g`` decays at the first)."""
    b, t = x.shape[:2]
    steps = x.new_zeros(b, t, nh, *x.shape[2:])
    steps[:, :, at] = x
    return steps.reshape(b, t * nh, *x.shape[2:])


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen, chunk, nh):
    """The shared reference path of the three ops (``g`` already ``[B, T, HV, Kg]``)."""
    compute = compute_dtype(v.dtype)
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    groups = v.shape[2] // q.shape[2]
    if groups > 1:                                    # grouped values: key head h serves h*G .. h*G+G-1
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    b, steps = k.shape[:2]
    doc_init = varlen is not None and initial_state is not None
    keep = output_final_state and varlen is not None
    # the fast path takes Gated DeltaProduct's queries as they are (one per token, read at its last
    # sub-step) and lays the sub-steps out block by block; per-document states need every step's
    q_every = nh if nh > 1 and not (doc_init or keep) else 1
    if nh > 1:
        g = _substeps(g, nh, 0)
    if q_every == 1 and nh > 1:
        q = _substeps(q, nh, -1)
    segs = None
    if varlen is None:
        seg_id = torch.arange(b, device=k.device).unsqueeze(1).expand(b, steps)
    elif doc_init or output_final_state:              # per-document states need the runs of the sub-steps
        segs = varlen.segments.expanded(nh)
        seg_id = segs.seg_id
    else:                                             # the segment ids alone: no tensor sized by the documents
        seg_id = varlen.segments.seg_id if nh == 1 else varlen.segments.seg_id.repeat_interleave(nh, dim=1)
    extra = DocInitialStates(initial_state.to(compute), segs, chunk) if doc_init else None
    o, ch = delta_rule_chunked(q, k, v, g, beta, seg_id, chunk, initial_state=None if doc_init else initial_state,
                               extra=extra, keep_intermediates=keep, scale=scale, q_every=q_every, l2norm=l2norm)
    if nh > 1 and q_every == 1:
        o = o[:, nh - 1::nh]
    final = None
    if output_final_state:
        if varlen is None:
            final = ch.s_final
        else:
            final = doc_final_states(ch, segs, initial_state.to(compute) if doc_init else None, varlen.num_docs)
    return o, final


def _empty(q, v, initial_state, output_final_state, varlen):
    """No tokens: the output is empty and every state is its initial state (or zeros)."""
    b, _, _, kd = q.shape
    o = v.new_zeros(b, 0, v.shape[2], v.shape[3])
    if not output_final_state:
        return o, None
    rows = b if varlen is None else varlen.num_docs
    compute = compute_dtype(v.dtype)
    final = initial_state.to(compute) if initial_state is not None else \
        v.new_zeros(rows, v.shape[2], kd, v.shape[3], dtype=compute)
    return o, final


def _run(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, chunk_size,
         backend, nh=1):
    varlen = check_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, nh)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if varlen is not None and varlen.cp is not None:          # context parallelism: cp.py
        from .cp import delta_rule_cp
        return delta_rule_cp(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen,
                             chunk_size, backend, nh, _PUBLIC[kind])
    name = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gdp": "chunk_gated_delta_product"}[kind]
    features = (("varlen",) if varlen is not None else ()) + (("grouped_values",) if v.shape[2] != q.shape[2] else ())
    choice = dispatch.select_backend(name, backend, on_cuda=dispatch.is_cuda(q),
                                     support_state=lambda: dispatch.cached_support("fla", features),
                                     missing_feature=unsupported(kind, q))
    if choice == "kernel":
        return fla_kernel(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen, nh)
    if kind == "kda" and not torch.compiler.is_compiling() and bool((g > 0).any()):   # a value read: eager only
        raise ValueError("chunk_kda: g holds log-decays <= 0 (a decay exp(g) <= 1); got positive values, "
                         f"max {float(g.max()):.3g}. Pass log(decay), e.g. -exp(A_log) * softplus(x)")
    if g is None:
        g = beta.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    g = g if kind == "kda" else g.unsqueeze(-1)
    if q.shape[1] == 0:
        return _empty(q, v, initial_state, output_final_state, varlen)
    o, final = _reference(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen,
                          chunk_size, nh)
    return o.to(v.dtype), final


@outside_autocast
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, chunk_size=64, backend="auto"):
    """Gated DeltaNet: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``."""
    return _run("gdn", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size, backend)


@outside_autocast
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, chunk_size=64, backend="auto"):
    """Kimi Delta Attention: like GDN with a per-channel log-decay g ``[B, T, HV, K]``."""
    return _run("kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size, backend)


@outside_autocast
def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
                              chunk_size=64, backend="auto"):
    """Gated DeltaProduct: q ``[B, T, H, K]``; k, v, beta with ``num_householder`` sub-steps per token
    ``[B, T * nh, H, ...]``; g ``[B, T, H]`` or ``None`` (no decay)."""
    from ssm_pack.checks import check_int
    nh = check_int("num_householder", num_householder, minimum=1)
    return _run("gdp", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size, backend, nh=nh)


_PUBLIC = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}   # CP local passes

