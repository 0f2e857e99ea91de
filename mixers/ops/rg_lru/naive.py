"""The specification of ``rg_lru``: Griffin's real-gated linear recurrent unit, one document at a time.

    T = tokens, D = channels (RecurrentGemma's ``lru_width``), N = documents

From the document's state ``h`` (zero, or its initial state when it continues one), per token t,
in the compute dtype (fp32 for half inputs, as RecurrentGemma accumulates; fp64 for fp64):

1. the gates: ``i_t = sigmoid(gate_x_t)`` (input), ``r_t = sigmoid(gate_a_t)`` (recurrence);
2. the decay: ``a_t = exp(-scale * r_t * softplus(recurrent_param))`` (Griffin's ``a^(c r_t)``
   with ``a = sigmoid(-recurrent_param)``, ``c = scale = 8``), in (0, 1];
3. the first token of a document that does not continue a state resets:
   ``h_t = i_t * x_t`` (no decay, the input not normalised: RecurrentGemma's ``position == 0``);
4. every other token: ``h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)``;
5. the output is ``h_t``; the document's final state is its last ``h`` (its starting state when
   it has no token).

Every document runs alone, so no state can cross a boundary. Written to be read, not to be fast:
the torch backend (:mod:`.reference`) and the CP and decode paths must agree with it in fp64.
"""

from __future__ import annotations

import torch

from ..common.chunks import compute_dtype
from ..common.naive_documents import document_spans
from .gates import bounded_sqrt


def _document(x, gate_x, gate_a, recurrent_param, scale, h, continues: bool):
    """One document: ``x, gate_x, gate_a [T, D]``, ``h [D]``. Returns ``(out [T, D], h_final [D])``."""
    outputs = []
    for t in range(x.shape[0]):
        i = torch.sigmoid(gate_x[t])                                                     # 1.
        r = torch.sigmoid(gate_a[t])
        log_a = -scale * r * torch.nn.functional.softplus(recurrent_param)               # 2.
        if t == 0 and not continues:
            h = x[t] * i                                                                 # 3.
        else:
            h = torch.exp(log_a) * h + x[t] * i * bounded_sqrt(1 - torch.exp(2 * log_a))  # 4.
        outputs.append(h)
    out = torch.stack(outputs) if outputs else x.new_zeros(0, x.shape[-1])
    return out, h                                                                        # 5.


def rg_lru_naive(x, gate_x, gate_a, recurrent_param, *, scale=8.0, initial_state=None, continues=None,
                 cu_seqlens=None):
    """``x, gate_x, gate_a [B, T, D]``, ``recurrent_param [D]``; ``initial_state [B or N, D]``;
    ``continues [B or N]`` bool (default: whether ``initial_state`` is given); ``cu_seqlens [N+1]``
    (``B == 1``; a tail after it is one more segment, starting fresh).

    Returns ``(out [B, T, D] in x's dtype, final [B or N, D] in the compute dtype)``."""
    compute = compute_dtype(x.dtype)
    x, gate_x, gate_a, lam = (t.to(compute) for t in (x, gate_x, gate_a, recurrent_param))
    rows, total, width = x.shape
    spans = document_spans(cu_seqlens, rows, total)
    count = rows if cu_seqlens is None else len(cu_seqlens) - 1
    out = torch.zeros_like(x)
    finals = [x.new_zeros(width)] * count
    for row, start, end, doc in spans:
        goes_on = doc is not None and (bool(continues[doc]) if continues is not None else initial_state is not None)
        h = initial_state[doc].to(compute) if goes_on and initial_state is not None else x.new_zeros(width)
        y, h = _document(x[row, start:end], gate_x[row, start:end], gate_a[row, start:end], lam, scale, h, goes_on)
        out = torch.cat([out[:row], torch.cat([out[row, :start], y, out[row, end:]])[None], out[row + 1:]])
        if doc is not None:
            finals[doc] = h
    final = torch.stack(finals) if finals else x.new_zeros(0, width)
    return out, final
