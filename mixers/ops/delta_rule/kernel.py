"""flash-linear-attention's chunk kernels, called the way fla wants them.

fla's varlen contract: batch 1, ``cu_seqlens`` int64 with ``cu_seqlens[-1] == T``,
``initial_state`` one row per document. Releases before 0.6 count documents by the chunks that
start them, so an empty document followed by a non-empty one shifts every later document's
index. So the call gets :attr:`ssm_pack.VarlenBatch.nonempty_layout`: the padding tail as a
document of its own and every empty document moved to the end (no token moves; nothing is read
on the host). fla returns an empty document's initial state (zeros without one) as its final
state; the states are put back in the documents' order after the call.

States: fla keeps them in fp32 and ``chunk_kda`` asserts an fp32 ``initial_state``
(fla/ops/kda/chunk.py), so every kind gets ``initial_state`` in fp32 (the cast is differentiable) and
the final state comes back in the reference's state dtype (:func:`mixers.ops.common.chunks.compute_dtype`
of ``v``: fp32 for fp32 / fp16 / bf16 inputs).
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed

from ..common.chunks import compute_dtype
from ._validate import DeltaCall

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_KEY_DIM = 256       # fla 0.6.0 asserts K <= 256 in chunk_delta_h / chunk_deltaproduct_h and chunk_kda


def unsupported(kind: str, q: torch.Tensor) -> str | None:
    """What fla's kernel cannot do with these inputs, or ``None``."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if kind == "gdp" and q.dtype == torch.float32:
        return "float32 (fla's Gated DeltaProduct kernel takes fp16 / bf16)"
    if q.shape[-1] > MAX_KEY_DIM:
        return (f"key head dim K={q.shape[-1]} (fla's delta-rule kernels take K <= {MAX_KEY_DIM}: "
                "fla/ops/common/chunk_delta_h.py, fla/ops/kda/chunk.py, 0.6.0)")
    return None


def load_upstream(kind: str):
    installed.pin_fla_triton()
    if kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
    elif kind == "kda":
        from fla.ops.kda import chunk_kda as op
    else:
        from fla.ops.gated_delta_product import chunk_gated_delta_product as op
    return op


def fla_kernel(call: DeltaCall):
    """``(o, final_state | None)`` of fla's chunk kernel for ``call``."""
    q, k, v, g, beta, varlen = call.q, call.k, call.v, call.g, call.beta, call.varlen
    op = load_upstream(call.kind)
    extra = {"num_householder": call.num_householder} if call.kind == "gdp" else {}
    initial_state = call.initial_state
    if initial_state is not None:
        initial_state = initial_state.float()
    options = dict(scale=call.scale, output_final_state=call.output_final_state, use_qk_l2norm_in_kernel=call.l2norm,
                   **extra)
    if varlen is None:
        o, final = op(q, k, v, g, beta, initial_state=initial_state, **options)
        return o, (final.to(compute_dtype(v.dtype)) if final is not None else None)
    bounds, order = varlen.nonempty_layout                       # [N+2] int64, [N+1]: entry N is the tail
    init = None
    if initial_state is not None:
        init = torch.cat([initial_state, initial_state.new_zeros(1, *initial_state.shape[1:])]).index_select(0, order)
    o, final = op(q, k, v, g, beta, initial_state=init, cu_seqlens=bounds, **options)
    if not call.output_final_state:
        return o, None
    restored = torch.empty_like(final).index_copy(0, order, final)
    return o, restored[: varlen.num_docs].to(compute_dtype(v.dtype))
