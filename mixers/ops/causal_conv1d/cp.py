"""``causal_conv1d_fn`` under context parallelism: a halo of the previous ranks' last inputs.

    D = channels, T_r = this rank's tokens, W = width, J = W - 1, N = documents

A document's conv state is its last J inputs (reaching into its initial state when shorter).
The segment leaving a rank hands the next rank that window: the element is ``(Shift_L, tail)``
with ``tail`` the rank's last ``min(L, J)`` inputs of the segment (right-aligned, zeros
before; the document's initial state before its first token where it starts on this rank) and
``Shift_L`` the ``J x J`` matrix moving an incoming window L places left, so
``S_out = S_in @ Shift_L + tail``; a segment with ``L >= J`` tokens on the rank (or starting
there) needs nothing from before. :func:`mixers.ops.common.cp_exchange.chain_scan` composes these over
the ranks, so a document spanning ranks holding fewer than J of its tokens is still exact. The
received window becomes the first local segment's initial state and the op runs once, locally.
Backward: the window's gradient flows back through the exchange to the inputs it came from.
"""

from __future__ import annotations

import torch

from ..common.cp_exchange import chain_scan
from ._validate import ConvCall


def _shift(length: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """``[J, J]``: ``(S @ shift)[:, b] = S[:, b + length]`` (zero where ``b + length >= J``)."""
    if length >= width:
        return like.new_zeros(width, width)
    return torch.diag(like.new_ones(width - length), -length)


def causal_conv1d_cp(call: ConvCall, local_op):
    """The CP version of :func:`mixers.ops.causal_conv1d_fn` (``call.varlen.cp`` set).
    ``local_op`` is the op itself, run on this rank's pieces without CP (passed in, so this module
    does not import its package)."""
    x, initial_states, seq_idx, final_states_out = call.x, call.initial_states, call.seq_idx, call.final_states_out
    run = call.varlen.cp
    lay, r = run.layout, run.rank
    n, state_len = lay.num_docs, call.state_len
    if seq_idx is not None:
        raise ValueError("causal_conv1d_fn: seq_idx cannot be combined with a context-parallel cu_seqlens "
                         "(the shard's documents come from its VarlenBatch); pass only cu_seqlens")
    if initial_states is not None and not call.per_doc:
        raise ValueError(f"causal_conv1d_fn: under context parallelism initial_states must be per document "
                         f"[N, D, W-1] with N={n}, got {tuple(initial_states.shape)}")
    inits = x.new_zeros(n + 1, x.shape[1], state_len)                # the N documents and the tail
    if initial_states is not None:
        inits = torch.cat([initial_states.to(x.dtype), inits[n:]])
    incoming = _exchange(run, x, inits, state_len) if state_len > 0 else None
    if incoming is not None:
        f = lay.first_seg[r]
        inits = torch.cat([inits[:f], incoming[None], inits[f + 1:]])
    given = incoming is not None or initial_states is not None      # else none: the CUDA kernel stays eligible
    result = local_op(x, call.weight, call.bias, initial_states=inits if given else None,
                      return_final_states=call.return_final_states, activation=call.activation,
                      cu_seqlens=run.local_cover, backend=call.backend)
    out = run.anchor(result[0] if call.return_final_states else result)
    if not call.return_final_states:
        return out
    final = run.mask_owned(result[1][:n])
    if initial_states is not None:
        final = final.to(initial_states.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _exchange(run, x, inits, state_len):
    """The window entering this rank's first segment (``[D, J]``), or ``None``."""
    lay, r = run.layout, run.rank
    closed = [lay.last_starts_here[j] or lay.last_len[j] >= state_len for j in range(lay.size)]
    element = None
    if lay.continues_out[r]:
        length = lay.last_len[r]
        before = inits[lay.last_seg[r]] if lay.last_starts_here[r] else inits.new_zeros(inits.shape[1:])
        tail = torch.cat([before, x[0, :, x.shape[2] - length:]], dim=1)[:, -state_len:]
        element = (None if closed[r] else _shift(length, state_len, tail), tail)
    return chain_scan(run, "conv", element, closed, apply=lambda m, s: s @ m,
                      compose=lambda later, early: early @ later, s_shape=(x.shape[1], state_len),
                      m_shape=(state_len, state_len), dtype=x.dtype,
                      anchors=(x, inits))
