"""flash-linear-attention's chunk kernels, called the way fla wants them.

fla's varlen contract: batch 1, ``cu_seqlens`` int64 with ``cu_seqlens[-1] == T``, no repeated
offsets (an empty document confuses its chunk indexing), ``initial_state`` one row per
document. So a padding tail is appended as a document of its own, empty documents are removed
before the call, and their states (the initial state, or zeros) are put back after it.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unsupported(kind: str, q: torch.Tensor) -> str | None:
    """What fla's kernel cannot do with these inputs, or ``None``."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if kind == "gdp" and q.dtype == torch.float32:
        return "float32 (fla's Gated DeltaProduct kernel takes fp16 / bf16)"
    return None


def load_upstream(kind: str):
    if kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
    elif kind == "kda":
        from fla.ops.kda import chunk_kda as op
    else:
        from fla.ops.gated_delta_product import chunk_gated_delta_product as op
    return op


def fla_kernel(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, nh):
    op = load_upstream(kind)
    extra = {"num_householder": nh} if kind == "gdp" else {}
    if cu_seqlens is None:
        return op(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=l2norm, **extra)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    total = q.shape[1]
    nonempty = torch.nonzero(cu[1:] > cu[:-1]).reshape(-1)
    bounds = torch.cat([cu[:1], cu[1:][nonempty]])
    tail = total - int(cu[-1])
    init = None if initial_state is None else initial_state.index_select(0, nonempty)
    if tail > 0:                                          # the padding tail: a document of its own
        bounds = torch.cat([bounds, bounds.new_tensor([total])])
        if init is not None:
            init = torch.cat([init, init.new_zeros(1, *init.shape[1:])])
    o, final = op(q, k, v, g, beta, scale=scale, initial_state=init, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=l2norm, cu_seqlens=bounds, **extra)
    if not output_final_state:
        return o, None
    docs = cu.numel() - 1
    base = initial_state.to(final.dtype) if initial_state is not None else \
        final.new_zeros(docs, *final.shape[1:])
    return o, base.index_copy(0, nonempty, final[: nonempty.numel()])
