"""fla's ``fused_recurrent_hgrn`` as the RG-LRU's recurrence (fla/ops/hgrn/fused_recurrent.py, 0.6.0).

    B = rows, T = tokens, D = channels, N = documents

fla's kernel runs ``h_t = exp(g_t) * h_{t-1} + x_t`` over each row, or each document of one row
with ``cu_seqlens``, from that sequence's ``initial_state`` row (zero without one), accumulating
in fp32. The RG-LRU is this recurrence once its per-token parts (:mod:`.gates`) are computed:

* ``x``: the normalised input ``sqrt(1 - a_t^2) * i_t * x_t``, a reset token's entering as
  ``i_t * x_t`` (step 3 of :mod:`.naive`);
* ``g``: ``log a_t``, and 0 at a reset token, whose starting state is zero: ``exp(0) * 0 + x_t``
  is the reset exactly, and no value of the reset token's recurrence gate reaches its output
  (a NaN there stays out, as in the spec) nor takes a gradient;
* ``initial_state``: a continuing sequence's state, zero for every other one, so its first token
  is an ordinary step (step 4).

fla's contract, which this wrapper meets: with ``cu_seqlens`` one row (``B == 1``) and
``initial_state`` one row per document (``[N, D]``, a ``ValueError`` otherwise); its grid covers
the documents only, so the tokens after ``cu_seqlens[-1]`` would stay unwritten (``torch.empty``):
the padding tail goes as one more document (:attr:`ssm_pack.VarlenBatch.covering_cu_seqlens`, int64,
starting fresh; its final state dropped). Each document runs in its own program, so an empty one
(no step) returns its initial state: step 5 of the spec. Output and final state come back in
``x``'s dtype; the wrapper hands fla the compute dtype (fp32: half inputs keep fp32 gates, as the
torch backend does) and casts the output back.
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed

from ..common.chunks import compute_dtype
from ._validate import RGLRUCall
from .gates import log_decay, normalised_input
from .reference import segment_layout

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)     # fp64 stays on the exact torch backend


def unsupported(call: RGLRUCall) -> str | None:
    """What fla's kernel cannot do for ``call``, or ``None``."""
    if call.x.dtype not in KERNEL_DTYPES:
        return f"dtype {call.x.dtype} (fla's recurrence accumulates in fp32)"
    return None


def load_upstream():
    installed.pin_fla_triton()
    from fla.ops.hgrn import fused_recurrent_hgrn
    return fused_recurrent_hgrn


def kernel_inputs(call: RGLRUCall, compute: torch.dtype):
    """``(x, g, initial_state | None)`` for fla: ``[B, T, D]``, ``[B, T, D]``, ``[B or N+1, D]``
    (the padding tail's zero row last with ``cu_seqlens``), in ``compute``."""
    x, gate_x = call.x.to(compute), call.gate_x.to(compute)
    log_a = log_decay(call.gate_a.to(compute), call.recurrent_param.to(compute), call.scale)
    seg, start = segment_layout(call)
    goes_on = call.continues_per_segment(seg.device)                   # [S] bool, S = N + 1 or B
    reset = (start & ~goes_on[seg]).unsqueeze(-1)                      # [B, T, 1]
    inputs = normalised_input(x, gate_x, log_a, reset)
    g = torch.where(reset, torch.zeros((), dtype=compute, device=log_a.device), log_a)
    if call.initial_state is None:
        return inputs, g, None
    h0 = call.states_per_segment(compute)                              # [S, D]
    return inputs, g, torch.where(goes_on.unsqueeze(-1), h0, torch.zeros((), dtype=compute, device=h0.device))


def fla_kernel(call: RGLRUCall):
    """``(out [B, T, D] in x's dtype, final [B or N, D] in the compute dtype, or None)`` by fla's kernel."""
    compute = compute_dtype(call.x.dtype)
    x, g, h0 = kernel_inputs(call, compute)
    op = load_upstream()
    if call.varlen is None:
        out, final = op(x, g, initial_state=h0, output_final_state=call.output_final_state)
    else:
        out, final = op(x, g, initial_state=h0, output_final_state=call.output_final_state,
                        cu_seqlens=call.varlen.covering_cu_seqlens.to(torch.int64))
        final = None if final is None else final[: call.varlen.num_docs]
    return out.to(call.x.dtype), (None if final is None else final.to(compute))
