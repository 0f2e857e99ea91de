"""``chunk_simple_gla`` computed by the SSD scan (:func:`mixers.ops.mamba_chunk_scan_combined`).

    B = rows, T = tokens, H = heads, K = key head dim, V = value head dim, N = documents

Mamba2's SSD recurrence per head, ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``
(``h [P, Ns]``), is this op's ``S_t = exp(g_gamma) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` with

    dt = 1,  A = g_gamma,  x = v (P = V),  B = k,  C = scale * q (Ns = K),  one group per head,
    D = z = dt_bias = None,  no softplus,

and the SSD state is this op's state transposed (``h = S^T``, ``[H, V, K]`` vs fla's ``[H, K, V]``).
So the SSD op's every feature serves this op unchanged: document resets from ``cu_seqlens``,
per-document initial and differentiable final states, context parallelism by state passing (a
``VarlenBatch`` with a CP run goes straight through), the empty call, the non-finite isolation, and
its backend choice (mamba-ssm's Triton scan on CUDA where installed, else the exact torch scan).
The tests hold this mapping to the one-token-at-a-time spec (:mod:`.naive`).
"""

from __future__ import annotations

import torch

from ._validate import SimpleGLACall


def _to_ssd(state: torch.Tensor | None) -> torch.Tensor | None:
    return None if state is None else state.transpose(-1, -2)


def simple_gla_as_ssd(call: SimpleGLACall, ssd_op):
    """``(o [B, T, H, V], final_state or None)`` of ``call`` through ``ssd_op``
    (:func:`mixers.ops.mamba_chunk_scan_combined`, passed in so this module does not import its package)."""
    q, k, v = call.q, call.k, call.v
    b, t, h, _ = q.shape
    dt = torch.ones(b, t, h, dtype=v.dtype, device=v.device)
    C = q * call.scale if call.scale != 1.0 else q
    want_states = call.output_final_state
    per_doc = call.varlen is not None
    result = ssd_op(v, dt, call.g_gamma, k, C, call.chunk_size, initial_states=_to_ssd(call.initial_state),
                    cu_seqlens=call.varlen, return_final_states=want_states and not per_doc,
                    return_varlen_states=want_states and per_doc, backend=call.backend)
    if not want_states:
        return result, None
    o, states = result
    return o, states.transpose(-1, -2)
