"""``fused_recurrent_simple_gla``: the decode form of ``chunk_simple_gla`` (fla's signature), and the
in-place step on a pool of per-slot states the inference cache runs.

    B = rows, T = tokens per row, H = heads, K, V = head dims, S = slots

One token per row (``T == 1``, no ``cu_seqlens``) is one vectorised recurrence step in the compute
dtype (fp32 for half inputs, fp64 for fp64): ``S <- exp(g_gamma) S + k^T v``, ``o = scale q S``.
Anything else is the chunked op's, same arguments and ``backend``. Both compute what
:mod:`.naive` states.
"""

from __future__ import annotations

import torch

from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import SimpleGLACall, checked_call

__all__ = ["fused_recurrent_simple_gla"]


def step(q, k, v, g_gamma, state, scale: float):
    """One token: q, k ``[N, H, K]``, v ``[N, H, V]``, g_gamma ``[H]``, state ``[N, H, K, V]`` (all in one
    dtype) -> ``(o [N, H, V], new state)``."""
    state = torch.exp(g_gamma)[:, None, None] * state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return torch.einsum("nhk,nhkv->nhv", q * scale, state), state


def _step_call(call: SimpleGLACall):
    q, k, v = call.q, call.k, call.v
    compute = compute_dtype(v.dtype)
    b, _, h, kd = q.shape
    state = (call.initial_state.to(compute) if call.initial_state is not None
             else v.new_zeros(b, h, kd, v.shape[3], dtype=compute))
    o, state = step(q[:, 0].to(compute), k[:, 0].to(compute), v[:, 0].to(compute), call.g_gamma.to(compute), state,
                    call.scale)
    return o.unsqueeze(1).to(v.dtype), (state if call.output_final_state else None)


@outside_autocast
def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, *, backend="auto"):
    """Decode step of :func:`mixers.ops.chunk_simple_gla` (same arguments and returns); final state in the
    compute dtype."""
    call = checked_call("fused_recurrent_simple_gla", q, k, v, g, g_gamma, scale, initial_state,
                        output_final_state, cu_seqlens, 64, backend)
    if call.varlen is not None or q.shape[1] != 1:
        from . import chunk_simple_gla
        return chunk_simple_gla(q, k, v, None, g_gamma, call.scale, initial_state, output_final_state, call.varlen,
                                backend=backend)
    return _step_call(call)
