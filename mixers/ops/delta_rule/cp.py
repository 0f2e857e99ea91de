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
  one (otherwise it starts on the rank: no ``M`` needed, no extra columns at all).

:func:`ssm_pack.cp_exchange.chain_scan` composes ``(M, S_local)`` over the ranks a segment
crosses (``M_2 M_1``, ``M_2 S_1 + S_2``) in the op's compute dtype and returns ``S_in``; the
exact outputs are then ``o_t + (M_t^T q_t)^T S_in`` and the segment's final state
``S_local + M S_in``. Backward is autograd through the same pass and the exchange (the state
gradient flows to the earlier ranks). Cost on a continuing rank: ``V + K`` value columns
instead of ``V`` in the local pass.
"""

from __future__ import annotations

import torch

from ssm_pack.cp_exchange import chain_scan

from ..chunks import compute_dtype


def _local(kind, q, k, v, g, beta, scale, inits, l2norm, cover, chunk_size, backend, nh):
    from . import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
    kwargs = dict(scale=scale, initial_state=inits, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                  cu_seqlens=cover, chunk_size=chunk_size, backend=backend)
    if kind == "gdp":
        return chunk_gated_delta_product(q, k, v, g, beta, nh, **kwargs)
    return (chunk_gated_delta_rule if kind == "gdn" else chunk_kda)(q, k, v, g, beta, **kwargs)


def _initial_states(run, initial_state, hv, kd, vd, extra, compute, device):
    """``[N+1, HV, K, V + extra]``: the documents' states (extra columns 0), the tail's zeros, and
    ``[0 | I]`` for a segment entering from an earlier rank (``None`` when all would be zero)."""
    n, f = run.layout.num_docs, run.layout.first_seg[run.rank]
    if initial_state is None and not extra:
        return None
    rows = torch.zeros(n, hv, kd, vd, dtype=compute, device=device) if initial_state is None \
        else initial_state.to(compute)
    rows = torch.cat([rows, rows.new_zeros(1, hv, kd, vd)])
    if not extra:
        return rows
    rows = torch.cat([rows, rows.new_zeros(n + 1, hv, kd, extra)], dim=-1)
    eye = torch.eye(kd, dtype=compute, device=device).expand(hv, kd, kd)
    entering = torch.cat([rows.new_zeros(hv, kd, vd), eye], dim=-1)
    return torch.cat([rows[:f], entering[None], rows[f + 1:]])


def delta_rule_cp(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen, chunk_size,
                  backend, nh=1):
    """The CP version of the three delta-rule ops (arguments as in :func:`mixers.ops.delta_rule._run`)."""
    run = varlen.cp
    lay, r = run.layout, run.rank
    n, f = lay.num_docs, lay.first_seg[r]
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    compute = compute_dtype(v.dtype)
    extra = kd if run.continues_in else 0
    v_in = torch.cat([v, v.new_zeros(*v.shape[:3], extra)], dim=-1) if extra else v
    inits = _initial_states(run, initial_state, hv, kd, vd, extra, compute, v.device)
    o, final = _local(kind, q, k, v_in, g, beta, scale, inits, l2norm, run.local_cover, chunk_size, backend, nh)
    closed = lay.last_starts_here
    element = None
    if run.continues_out:
        last = final[lay.last_seg[r]].to(compute)
        element = (None if closed[r] else last[..., vd:], last[..., :vd])
    s_in = chain_scan(run, kind, element, closed, apply=lambda m, s: m @ s, compose=lambda later, early: later @ early,
                      s_shape=(hv, kd, vd), m_shape=(hv, kd, kd), dtype=compute,
                      anchors=(q, k, v, g, beta, initial_state))
    out = o[..., :vd]
    if s_in is not None:
        t1 = run.first_len
        fix = torch.einsum("thk,hkv->thv", o[0, :t1, :, vd:].to(compute), s_in)
        out = torch.cat([(out[:, :t1].to(compute) + fix[None]).to(out.dtype), out[:, t1:]], dim=1)
    out = run.anchor(out.contiguous())
    if not output_final_state:
        return out, None
    states = final[:n, ..., :vd].to(compute)
    if s_in is not None and f < n:
        entering = states[f] + final[f, ..., vd:].to(compute) @ s_in
        states = torch.cat([states[:f], entering[None], states[f + 1:]])
    return out, run.mask_owned(states)
