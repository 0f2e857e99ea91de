"""The torch backend of the delta-rule ops: the chunked generalized delta rule, with document resets
inside the chunks. Its specification, the same recurrence token by token, is :mod:`.naive`.

    B = rows, T = tokens, H = heads, K = key dim, V = value dim, Kg = 1 (scalar gate) or K,
    C = chunks, L = chunk length

Recurrence per head, state ``S`` ``[K, V]``, gate ``g`` (log-decay, per channel or scalar):

    S <- exp(g_t) * S                         (row-wise decay)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T    (delta update)
    o_t = S^T q_t

Inside a chunk (WY / UT form, as in the DeltaNet and Gated DeltaNet papers), with ``G`` the
cumulative log-decay from the chunk start (or the document start, if later) and ``S0`` the state
entering the chunk:

1. ``A[t, s] = beta_t sum_c k_t k_s exp(G_t - G_s)`` (s < t) and
   ``Aqk[t, s] = sum_c q_t k_s exp(G_t - G_s)`` (s <= t), same-document pairs only;
2. one triangular solve ``(I + A) [W | U] = [beta exp(G) k | beta v]``, so that the corrected
   values are ``delta = U - W S0`` (rows of the entering document; the others start from 0;
   the fast path solves once the right-hand side is corrected, ``T (R_U - R_W S0)``);
3. chunk by chunk, the state leaving a chunk: ``exp(G_L) S0`` (if its document fills the
   chunk) plus ``(exp(G_L - G) k)^T delta`` over the chunk's last document;
4. ``o = (exp(G) q) S0 + Aqk delta``.

Steps 1-2 depend on no state and run for many chunks at once (:mod:`.prep`). Every
cross-document term is a masked zero (the solve is block-diagonal per document), so documents
stay bitwise independent for finite values; non-finite inputs are sanitized on the way in and
re-poisoned on the way out (:mod:`mixers.ops.common.isolation`), so a NaN or inf stays in its document. A gate
``g = -inf`` (decay exactly 0) is a reset, computed exactly. The fast path (:mod:`.blocked`)
runs blocks of chunks with a hand-written backward; per-document initial or final states use
the composed path below, which keeps every intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..common.chunks import compute_dtype, entering_segments, pad_tokens, untracked
from ..common.empty import passed_through
from ..common.isolation import Isolation
from ._validate import DeltaCall
from .blocked import DeltaRuleBlocked
from .l2norm import l2_normalize
from .prep import chunk_masks, prep_backward, prep_forward
from .varlen_states import DocInitialStates, doc_final_states


def delta_rule_reference(call: DeltaCall):
    """``(o [B, T, HV, V] in v's dtype, final_state | None)``: the reference path of the three ops."""
    q, v, g, beta = call.q, call.v, call.g, call.beta
    if call.kind == "kda" and not torch.compiler.is_compiling() and bool((g > 0).any()):   # a value read: eager only
        raise ValueError("chunk_kda: g holds log-decays <= 0 (a decay exp(g) <= 1); got positive values, "
                         f"max {float(g.max()):.3g}. Pass log(decay), e.g. -exp(A_log) * softplus(x)")
    if g is None:
        g = beta.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    g = g if call.kind == "kda" else g.unsqueeze(-1)
    o, final = _chunked_call(call.replace(g=g))
    return o.to(v.dtype), final


def substeps(x, nh, at):
    """Sub-step layout ``[B, T * nh, ...]``: ``x`` on each token's sub-step ``at``, zeros elsewhere
    (``q`` is read at the last sub-step, ``g`` decays at the first)."""
    b, t = x.shape[:2]
    steps = x.new_zeros(b, t, nh, *x.shape[2:])
    steps[:, :, at] = x
    return steps.reshape(b, t * nh, *x.shape[2:])


def _chunked_call(call: DeltaCall):
    """The chunked core on a call whose ``g`` is already ``[B, T, HV, Kg]``."""
    compute = compute_dtype(call.v.dtype)
    q, k, v, g, beta = (x.to(compute) for x in (call.q, call.k, call.v, call.g, call.beta))
    varlen, initial_state, nh, chunk = call.varlen, call.initial_state, call.num_householder, call.chunk_size
    groups = v.shape[2] // q.shape[2]
    if groups > 1:                                    # grouped values: key head h serves h*G .. h*G+G-1
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    b, steps = k.shape[:2]
    doc_init = varlen is not None and initial_state is not None
    keep = call.output_final_state and varlen is not None
    # the fast path takes Gated DeltaProduct's queries as they are (one per token, read at its last
    # sub-step) and lays the sub-steps out block by block; per-document states need every step's
    q_every = nh if nh > 1 and not (doc_init or keep) else 1
    if nh > 1:
        g = substeps(g, nh, 0)
    if q_every == 1 and nh > 1:
        q = substeps(q, nh, -1)
    segs = None
    if varlen is None:
        seg_id = torch.arange(b, device=k.device).unsqueeze(1).expand(b, steps)
    elif doc_init or call.output_final_state:         # per-document states need the runs of the sub-steps
        segs = varlen.segments.expanded(nh)
        seg_id = segs.seg_id
    else:                                             # the segment ids alone: no tensor sized by the documents
        seg_id = varlen.segments.seg_id if nh == 1 else varlen.segments.seg_id.repeat_interleave(nh, dim=1)
    extra = DocInitialStates(initial_state.to(compute), segs, chunk) if doc_init else None
    o, ch = delta_rule_chunked(q, k, v, g, beta, seg_id, chunk, initial_state=None if doc_init else initial_state,
                               extra=extra, keep_intermediates=keep, scale=call.scale, q_every=q_every,
                               l2norm=call.l2norm)
    if nh > 1 and q_every == 1:
        o = o[:, nh - 1::nh]
    final = None
    if call.output_final_state:
        if varlen is None:
            final = ch.s_final
        else:
            final = doc_final_states(ch, segs, initial_state.to(compute) if doc_init else None, varlen.num_docs)
    return o, final


def empty_result(call: DeltaCall):
    """No token (:mod:`mixers.ops.common.empty`: no row or no position): the output is empty and every
    state is its initial state (or zeros), in the compute dtype as the reference returns them."""
    q, v = call.q, call.v
    b, length, _, kd = q.shape
    o = v.new_zeros(b, length, v.shape[2], v.shape[3])
    if not call.output_final_state:
        return o, None
    rows = b if call.varlen is None else call.varlen.num_docs
    return o, passed_through(call.initial_state, (rows, v.shape[2], kd, v.shape[3]), v, compute_dtype(v.dtype))


@dataclass
class DeltaIntermediates:
    """Intermediates kept for per-document states (see :mod:`.varlen_states`)."""

    s_final: torch.Tensor               # [B, H, K, V] state after the last chunk
    chunk: int
    G: torch.Tensor | None = None       # [B, C, H, L, Kg] segmented cumulative log-decay
    gate: torch.Tensor | None = None    # [B, C, H, L, Kg] per-token log-decays, floored
    keys: torch.Tensor | None = None    # [B, C, H, L, K]
    delta: torch.Tensor | None = None   # [B, C, H, L, V] corrected values
    enter_seg: torch.Tensor | None = None  # [B, C]
    s_enter: torch.Tensor | None = None    # [B, C, H, K, V] state entering each chunk
    iso: Isolation | None = None           # the guard against non-finite inputs (per-document states use it)
    s0: torch.Tensor | None = None         # [D, H, K, V] per-document initial states, sanitized by ``iso``


def _to_chunk_head_token(t: torch.Tensor, b: int, c: int, L: int) -> torch.Tensor:
    """``[B, C*L, H, X]`` -> ``[B, C, H, L, X]``."""
    return t.reshape(b, c, L, *t.shape[2:]).transpose(2, 3).contiguous()


def delta_rule_chunked(q, k, v, g, beta, seg_id, chunk: int, initial_state=None, extra=None,
                       keep_intermediates: bool = False, scale: float = 1.0, q_every: int = 1,
                       l2norm: bool = False):
    """Chunked delta rule (``q`` scaled by ``scale`` here). Returns ``(o [B, T, H, V], intermediates)``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, Kg]`` log-decays;
        beta: ``[B, T, H]``; seg_id: ``[B, T]`` segment ids; chunk: chunk length.
        initial_state: ``[B, H, K, V]`` state of each row's first segment.
        extra: per-document initial states (:class:`.varlen_states.DocInitialStates`).
        keep_intermediates: keep what per-document final states need.
        q_every: ``> 1``: only the last step of each group of ``q_every`` reads the state
            (Gated DeltaProduct); ``q`` and the output hold those steps only, ``[B, T/q_every, ...]``
            (fast path only: no ``extra``, no ``keep_intermediates``).
        l2norm: q and k are l2-normalized over K first (fla's ``use_qk_l2norm_in_kernel``); the
            fast path does it block by block, so no normalized copy of q or k is ever whole.
    """
    assert q_every == 1 or (extra is None and not keep_intermediates)
    iso = _guard(q, k, v, g, beta, seg_id, initial_state, extra, q_every)
    q = iso.clean(q, owner=Isolation._every(seg_id, q_every))
    k, v, beta = (iso.clean(x) for x in (k, v, beta))
    g = iso.clean(g, gate=True)
    initial_state = iso.clean_states(initial_state, seg_id[:, 0])
    if extra is not None:
        extra.isolate(iso)
    o, ch = _chunked(q, k, v, g, beta, seg_id, chunk, initial_state, extra, keep_intermediates, scale, q_every,
                     l2norm)
    ch.iso, ch.s0 = iso, None if extra is None else extra.s0
    ch.s_final = iso.poison_states(ch.s_final, seg_id[:, -1])
    return iso.poison_tokens(o, q_every), ch


def _guard(q, k, v, g, beta, seg_id, initial_state, extra, q_every=1) -> Isolation:
    """Scan every input for non-finite values (q is read at its own token only)."""
    iso = Isolation(seg_id)
    iso.scan(q, reads=True, every=q_every)
    for x in (k, v, beta):
        iso.scan(x)
    iso.scan(g, gate=True)
    if initial_state is not None:
        iso.scan_states(initial_state, seg_id[:, 0])
    if extra is not None:
        iso.scan_states(extra.s0, extra.owner)
    return iso


def _chunked(q, k, v, g, beta, seg_id, chunk, initial_state, extra, keep_intermediates, scale, q_every=1,
             l2norm=False):
    b, t, h, kd = k.shape
    L = chunk
    pad = (-t) % L
    c = (t + pad) // L
    # padding tokens join the last segment and are neutral (q = k = v = g = beta = 0)
    seg = pad_tokens(seg_id, pad, repeat_last=True).reshape(b, c, L)
    enter_seg = entering_segments(seg)                                          # [B, C]
    h0 = k.new_zeros(b, h, kd, v.shape[-1]) if initial_state is None else initial_state.to(k.dtype)
    if extra is None and not keep_intermediates:
        # without gradients nothing is kept for a backward
        out, s_final = DeltaRuleBlocked.apply(*untracked(q, k, v, g, beta, seg, enter_seg, h0), scale, L, q_every,
                                              l2norm)
        return out, DeltaIntermediates(s_final=s_final, chunk=L)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    q, k, v, g, beta = (pad_tokens(x, pad) for x in (q, k, v, g, beta))
    qc, kc, vc, gc = (_to_chunk_head_token(x, b, c, L) for x in (q, k, v, g))  # [B, C, H, L, X]
    bc = beta.reshape(b, c, L, h).transpose(2, 3).contiguous()                  # [B, C, H, L]
    p = SimpleNamespace(**dict(zip(_PREP_OUTPUTS, PrepFunction.apply(qc, kc, vc, gc, bc, seg, enter_seg))))
    U = p.U if extra is None else p.U - extra.corrections(p.G, p.W)
    s_enter, delta, state = _composed(U, p, h0, extra, seg)
    o = p.q_read @ s_enter + p.qk @ delta
    if extra is not None:
        o = o + extra.reads(p.G, qc * p.exp_G)
    return _tokens(o, b, c, L, t), DeltaIntermediates(s_final=state, chunk=L, G=p.G, gate=p.gate, keys=kc,
                                                      delta=delta, enter_seg=enter_seg, s_enter=s_enter)


# the prep's outputs under autograd, as fields of :class:`.prep.Prep`: named here once
_PREP_OUTPUTS = ("G", "gate", "qk", "W", "w_read", "U", "q_read", "k_out", "kappa", "exp_G")


class PrepFunction(torch.autograd.Function):
    """:func:`.prep.prep_forward` of all chunks ``[B, C, H, L, ...]`` (rows of ``W`` kept, for
    per-document initial states), with its hand-written backward (recomputed from the inputs)."""

    @staticmethod
    def _prep(qc, kc, vc, gc, bc, seg, enter):
        b, c, h, L, kd = kc.shape
        left = torch.cat([qc, bc.unsqueeze(-1) * kc], dim=-2).view(-1, 2 * L, kd)
        g_tm = gc.permute(0, 1, 3, 2, 4).reshape(b * c, L, -1)                   # [X, L, H*Kg]
        masks = chunk_masks(seg.reshape(b * c, L), enter.reshape(b * c), kc.dtype)
        return prep_forward(left, kc.reshape(-1, L, kd), vc.reshape(-1, L, vc.shape[-1]), bc.reshape(-1, L, 1),
                            g_tm, masks, full_w=True)

    @staticmethod
    def forward(ctx, qc, kc, vc, gc, bc, seg, enter):
        ctx.save_for_backward(qc, kc, vc, gc, bc, seg, enter)
        p = PrepFunction._prep(qc, kc, vc, gc, bc, seg, enter)
        lead = kc.shape[:3]
        return tuple(getattr(p, name).reshape(*lead, *getattr(p, name).shape[1:]) for name in _PREP_OUTPUTS)

    @staticmethod
    def backward(ctx, *grads):
        qc, kc, vc, gc, bc, seg, enter = ctx.saved_tensors
        p = PrepFunction._prep(qc, kc, vc, gc, bc, seg, enter)
        d = {name: None if g is None else g.reshape(-1, *g.shape[3:]) for name, g in zip(_PREP_OUTPUTS, grads)}

        def given(name):
            return torch.zeros_like(getattr(p, name)) if d[name] is None else d[name]
        dW = given("W")
        if d["w_read"] is not None:
            dW = dW + _reads(p, d["w_read"])
        dq, dk, dv, dbeta, dg = prep_backward(p, dW, given("U"), given("q_read"), given("qk"), given("k_out"),
                                              given("kappa"), d_G=d["G"], d_gate=d["gate"], d_exp_G=d["exp_G"])
        b, c, h, L = kc.shape[:4]
        dg = dg.view(b, c, L, h, -1).permute(0, 1, 3, 2, 4)
        return (*(x.reshape(b, c, h, L, -1) for x in (dq, dk, dv)), dg, dbeta.reshape(b, c, h, L), None, None)


def _reads(p, d_w_read):
    """``d_w_read`` through ``w_read = reads * W``."""
    x = p.m.X
    return (d_w_read.view(x, -1, *d_w_read.shape[1:]) * p.m.reads).view(d_w_read.shape)


def _composed(U, p, h0, extra, seg):
    """The state recurrence under autograd, all chunks kept (per-document states need them)."""
    extra_states = None if extra is None else extra.chunk_states(p.G, seg)
    state, entering, deltas = h0, [], []
    for ci in range(U.shape[1]):
        entering.append(state)
        delta = U[:, ci] - p.w_read[:, ci] @ state
        deltas.append(delta)
        state = p.kappa[:, ci] * state + p.k_out[:, ci].transpose(-1, -2) @ delta
        if extra_states is not None:
            state = state + extra_states[:, ci]
    return torch.stack(entering, dim=1), torch.stack(deltas, dim=1), state


def _tokens(o: torch.Tensor, b: int, c: int, L: int, t: int) -> torch.Tensor:
    """``[B, C, H, L, V]`` -> ``[B, T, H, V]``."""
    return o.transpose(2, 3).reshape(b, c * L, o.shape[2], -1)[:, :t]
