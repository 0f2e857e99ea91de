"""flash-linear-attention's ``chunk_simple_gla`` (fla/ops/simple_gla/chunk.py, 0.6.0), called the way fla wants it.

    B = rows, T = tokens, H = heads, K = key head dim, V = value head dim, N = documents

fla's contract: q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` (not head-first) in fp32 / fp16 / bf16;
``g_gamma [H]`` the per-head log decay; with ``cu_seqlens`` one row (``B == 1``), int64 boundaries
(fla types them ``torch.LongTensor``) and ``initial_state`` ``[N, H, K, V]``, one per document. fla's
signature puts ``state_v_first`` between ``output_final_state`` and ``cu_seqlens``, so everything
after ``v`` is passed by keyword. Like the delta-rule kernels (:mod:`mixers.ops.delta_rule.kernel`)
the call gets :attr:`ssm_pack.VarlenBatch.nonempty_layout`: the padding tail a document of its own
(fla leaves tokens after ``cu_seqlens[-1]`` uncomputed) and every empty document moved to the end;
the final states are put back in the documents' order after the call.

What the kernel cannot do, so that ``"auto"`` takes the SSD route and ``"kernel"`` refuses
(:func:`unsupported`): fp64; odd ``K`` or ``V`` in half precision (fla's ``chunk_bwd_dv`` asserts
even ones for 16-bit inputs, fla/ops/common/chunk_o.py); a gradient for ``g_gamma``
(``ChunkSimpleGLAFunction.backward`` returns ``None`` for it, which autograd would read as zero).
fla chunks by its own 64 tokens (``chunk_size`` is the SSD route's knob).

States: fla accumulates them in fp32 and returns ``final_state`` in fp32; ``initial_state`` goes in
as fp32 (the cast is differentiable) and the final state comes back as fla returns it, in the compute
dtype (:func:`mixers.ops.common.chunks.compute_dtype` of ``v``: fp32 for every dtype fla takes), the
decode step's state dtype. (The SSD route returns it in ``v``'s dtype.)
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed

from .. import dispatch
from ..common.chunks import compute_dtype
from ._validate import SimpleGLACall

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unsupported(call: SimpleGLACall) -> str | None:
    """What fla's ``chunk_simple_gla`` cannot do for ``call``, or ``None``."""
    q, v = call.q, call.v
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if q.dtype != torch.float32 and (q.shape[-1] % 2 or v.shape[-1] % 2):
        return (f"odd head dims K={q.shape[-1]}, V={v.shape[-1]} in {q.dtype} (fla's chunk_bwd_dv asserts even "
                "K and V for 16-bit inputs: fla/ops/common/chunk_o.py, 0.6.0)")
    if dispatch.records_grad(call.g_gamma):
        return ("a gradient for g_gamma (fla's ChunkSimpleGLAFunction returns none for it); pass a g_gamma "
                "that does not require grad (MiniMax's slopes are a buffer) or detach it")
    return None


def load_upstream():
    installed.pin_fla_triton()
    from fla.ops.simple_gla import chunk_simple_gla as op
    return op


def fla_simple_gla(call: SimpleGLACall):
    """``(o [B, T, H, V], final_state [N or B, H, K, V] or None)`` of fla's kernel for ``call``."""
    op = load_upstream()
    q, k, v, varlen = call.q, call.k, call.v, call.varlen
    initial_state = None if call.initial_state is None else call.initial_state.float()
    options = dict(g_gamma=call.g_gamma.float(), scale=call.scale, output_final_state=call.output_final_state)
    state_dtype = compute_dtype(v.dtype)
    if varlen is None:
        o, final = op(q, k, v, initial_state=initial_state, **options)
        return o, (final.to(state_dtype) if final is not None else None)
    bounds, order = varlen.nonempty_layout                       # [N+2] int64, [N+1]: entry N is the tail
    init = None
    if initial_state is not None:
        init = torch.cat([initial_state, initial_state.new_zeros(1, *initial_state.shape[1:])]).index_select(0, order)
    # the host copy spares fla's prepare_chunk_indices a device read in every layer
    o, final = op(q, k, v, initial_state=init, cu_seqlens=bounds, cu_seqlens_cpu=varlen.host_nonempty_cu, **options)
    if not call.output_final_state:
        return o, None
    restored = torch.empty_like(final).index_copy(0, order, final)
    return o, restored[: varlen.num_docs].to(state_dtype)
