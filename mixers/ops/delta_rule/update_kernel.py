"""flash-linear-attention's Triton ``fused_recurrent_*`` kernels (the decode step), called as fla wants.

fla's contract (``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``,
``fla.ops.kda.fused_recurrent_kda``; both with ``initial_state`` / ``output_final_state`` since
0.4.0): rows ``[B, T, ...]`` with one initial state per row ``[B, HV, K, V]``, fp32 / fp16 / bf16,
forward only (``FusedRecurrentFunction.backward`` raises, ``fused_recurrent_kda`` is no autograd
function at all), so a call autograd records takes the reference (:func:`mixers.ops.dispatch.forward_only`).
fla >= 0.4 put ``gk`` and ``gv`` between ``g`` and ``beta`` in the GDN function,
so every argument after ``v`` is passed by keyword. Gated DeltaProduct has no fused recurrent
kernel of its own: like fla's ``GatedDeltaProduct`` layer in decoding, ssm-pack runs GDN's on the
sub-step layout (``num_householder`` steps per token, the query on the last, the gate on the first)
and keeps every token's last output.
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed

from .. import dispatch
from ._validate import DeltaCall
from .reference import substeps

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unsupported(q: torch.Tensor, *inputs) -> str | None:
    """Why fla's fused recurrent kernel cannot take ``q`` (and the other ``inputs``), or ``None``."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    return dispatch.forward_only("fla's fused_recurrent kernel", q, *inputs)


def load_upstream(kind: str):
    installed.pin_fla_triton()
    if kind == "kda":
        from fla.ops.kda import fused_recurrent_kda as op
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as op
    return op


def fused_recurrent_kernel(call: DeltaCall):
    """``(o, final_state | None)`` of fla's fused recurrent kernel for ``call`` (one token per row)."""
    q, g, nh = call.q, call.g, call.num_householder
    op = load_upstream(call.kind)
    if call.kind == "gdp":
        if g is None:
            g = call.beta.new_zeros(q.shape[0], q.shape[1], q.shape[2])
        q, g = substeps(q, nh, -1), substeps(g, nh, 0)
    o, final = op(q, call.k, call.v, g=g, beta=call.beta, scale=call.scale, initial_state=call.initial_state,
                  output_final_state=call.output_final_state, use_qk_l2norm_in_kernel=call.l2norm)
    if call.kind == "gdp":
        o = o[:, nh - 1::nh]
    return o, final
