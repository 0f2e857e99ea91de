"""The delta-rule ops (GDN, KDA, Gated DeltaProduct) under context parallelism: state passing.

    T_r = this rank's tokens, T1 = tokens of its first segment, HV = value heads, K / V = key /
    value head dims, N = documents

Every delta-rule step is linear in ``(S, v)`` column by column of the value dimension:
``S_t = A_t S_{t-1} + b_t v_t^T`` with ``A_t``, ``b_t`` from ``q, k, g, beta`` only. So a run of
tokens maps an entering state to ``M S_in + S_local``, and one local pass of the op with K
extra value columns (``v = 0`` there, initial state ``[0 | I]`` for the segment entering the
rank) yields, at once,

* the outputs from zero (the first V columns) and ``M_t^T q_t`` (the extra K columns);
* ``S_local`` and ``M`` ``[HV, K, K]`` of the segment leaving the rank, when it is the entering
  one (otherwise it starts on the rank: no ``M`` needed).

Only the entering segment's ``T1`` tokens take the extra columns (a call of their own); the
documents that start on the rank run as one plain call.

:func:`mixers.ops.common.cp_exchange.chain_scan` composes ``(M, S_local)`` over the ranks a segment
crosses (``M_2 M_1``, ``M_2 S_1 + S_2``) in the op's compute dtype and returns ``S_in``; the
exact outputs are then ``o_t + (M_t^T q_t)^T S_in`` and the segment's final state
``S_local + M S_in``. Backward is autograd through the same calls and the exchange (the state
gradient flows to the earlier ranks). Cost: ``V + K`` value columns instead of ``V`` over the
``T1`` tokens of the entering segment.
"""

from __future__ import annotations

import torch

from ssm_pack.varlen import VarlenBatch

from ..common.chunks import compute_dtype
from ..common.cp_exchange import chain_scan
from ._validate import DeltaCall


def _local(call: DeltaCall, local_op, q, k, v, g, beta, inits, cover):
    """The op without CP on this rank's pieces ``q .. beta``, from ``inits``, over the documents ``cover``."""
    kwargs = dict(scale=call.scale, initial_state=inits, output_final_state=True, use_qk_l2norm_in_kernel=call.l2norm,
                  cu_seqlens=cover, chunk_size=call.chunk_size, backend=call.backend)
    if call.kind == "gdp":
        return local_op(q, k, v, g, beta, call.num_householder, **kwargs)
    return local_op(q, k, v, g, beta, **kwargs)


def _initial_states(initial_state, hv, kd, vd, compute):
    """``[N+1, HV, K, V]``: the documents' initial states and the tail's zeros (``None``: none given)."""
    if initial_state is None:
        return None
    rows = initial_state.to(compute)
    return torch.cat([rows, rows.new_zeros(1, hv, kd, vd)])


def _steps(t, lo, hi, nh):
    """Tokens ``lo:hi`` of a ``[1, T * nh, ...]`` step tensor (``None`` stays ``None``)."""
    return None if t is None else t[:, lo * nh:hi * nh]


def _pieces(call: DeltaCall, lo: int, hi: int):
    """``(q, k, v, g, beta)`` of tokens ``lo:hi`` (``k``, ``v``, ``beta``: their sub-steps)."""
    nh = call.num_householder
    return (call.q[:, lo:hi], _steps(call.k, lo, hi, nh), _steps(call.v, lo, hi, nh), _steps(call.g, lo, hi, 1),
            _steps(call.beta, lo, hi, nh))


def _continuing(call: DeltaCall, local_op, run, compute):
    """The first segment's ``T1`` tokens alone, with K extra value columns: ``v = 0`` there and
    initial state ``[0 | I]``. Returns ``(o [1, T1, HV, V + K], final [HV, K, V + K])``."""
    v = call.v
    t1, (hv, kd) = run.first_len, (v.shape[2], call.q.shape[3])
    q1, k1, v1, g1, beta1 = _pieces(call, 0, t1)
    v1 = torch.cat([v1, v1.new_zeros(*v1.shape[:3], kd)], dim=-1)
    eye = torch.eye(kd, dtype=compute, device=v.device).expand(hv, kd, kd)
    inits = torch.cat([eye.new_zeros(hv, kd, v.shape[3]), eye], dim=-1)[None]
    one = VarlenBatch.build(torch.tensor([0, t1], dtype=torch.int32, device=v.device), t1, device=v.device)
    o, final = _local(call, local_op, q1, k1, v1, g1, beta1, inits, one)
    return o, final[0].to(compute)


def delta_rule_cp(call: DeltaCall, local_op):
    """The CP version of the three delta-rule ops (``call.varlen.cp`` set).

    ``local_op`` is the public op of ``call.kind``, run on this rank's pieces without CP (passed in,
    so this module does not import its package).
    """
    q, v, initial_state = call.q, call.v, call.initial_state
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    n, f, t = lay.num_docs, lay.first_seg[r], q.shape[1]
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    compute = compute_dtype(v.dtype)
    inits = _initial_states(initial_state, hv, kd, vd, compute)
    t1 = run.first_len if run.continues_in else 0
    first = _continuing(call, local_op, run, compute) if t1 else None
    rest = None
    if t1 < t:         # the documents starting on this rank (a continuing one is empty here)
        cover = run.after_first if t1 else run.local_cover
        rest = _local(call, local_op, *_pieces(call, t1, t), inits, cover)
    closed = lay.last_starts_here
    element = None
    if run.continues_out:
        last = first[1] if not closed[r] else rest[1][lay.last_seg[r]].to(compute)
        element = (None if closed[r] else last[..., vd:], last[..., :vd])
    s_in = chain_scan(run, call.kind, element, closed, apply=lambda m, s: m @ s,
                      compose=lambda later, early: later @ early,
                      s_shape=(hv, kd, vd), m_shape=(hv, kd, kd), dtype=compute,
                      anchors=(q, call.k, v, call.g, call.beta, initial_state))
    pieces = []
    if first is not None:
        o1 = first[0]
        fix = torch.einsum("thk,hkv->thv", o1[0, :, :, vd:].to(compute), s_in)
        pieces.append((o1[..., :vd].to(compute) + fix[None]).to(v.dtype))
    if rest is not None:
        pieces.append(rest[0])
    out = run.anchor(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous())
    if not call.output_final_state:
        return out, None
    if rest is not None:
        states = rest[1][:n].to(compute)
    else:              # the whole shard continues one segment: any other document here is empty, its state h0
        states = inits[:n] if inits is not None else v.new_zeros(n, hv, kd, vd, dtype=compute)
    if first is not None and f < n:
        entering = first[1][..., :vd] + first[1][..., vd:] @ s_in
        states = torch.cat([states[:f], entering[None], states[f + 1:]])
    return out, run.mask_owned(states)
