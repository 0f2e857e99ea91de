"""``mamba_chunk_scan_combined``: Mamba2's chunked SSD scan with upstream's signature.

    B = rows, T = tokens, H = heads, P = head dim, G = groups, Ns = state size, N = documents

Mirrors ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` and its return
conventions: ``out``, ``(out, final_states)``, ``(out, varlen_states)`` or
``(out, final_states, varlen_states)``. ``seq_idx`` resets the state at every change of value;
per-row ``initial_states`` feed the first segment of each row; ``final_states`` is the state
after each row's last token.

Beyond upstream: with ``cu_seqlens`` (``B == 1``), ``initial_states`` may hold one state per
document ``[N, H, P, Ns]``; ``varlen_states`` (per-document final states) are differentiable; and
``seq_idx`` is derived from ``cu_seqlens`` when not given (upstream would silently not reset).
"""

from __future__ import annotations

import math

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from ._validate import SSDCall, checked_call
from .kernel import ssd_kernel, unsupported
from .reference import empty_result, ssd_reference

__all__ = ["mamba_chunk_scan_combined"]


def _run(call: SSDCall):
    """Context parallelism (:mod:`.cp`), no token, else mamba-ssm's scan or the reference (one backend choice)."""
    if call.varlen is not None and call.varlen.cp is not None:
        from .cp import ssd_cp
        return ssd_cp(call, mamba_chunk_scan_combined)
    if no_tokens(call.x.shape[0], call.x.shape[1]):
        return empty_result(call)
    features = ("seq_idx",) + dispatch.backward_of(call.x, call.dt, call.A, call.B, call.C, call.D, call.z,
                                                   call.dt_bias, call.initial_states)
    choice = dispatch.select_backend("mamba_chunk_scan_combined", call.backend, on_cuda=dispatch.is_cuda(call.x),
                                     support_state=lambda: dispatch.cached_support("mamba_ssd", features),
                                     missing_feature=unsupported(call))
    return ssd_kernel(call) if choice == "kernel" else ssd_reference(call)


@outside_autocast
def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                              return_final_states=False, return_varlen_states=False, *, backend="auto"):
    """Mamba2 SSD scan over packed rows, resetting the state at every document.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]``; A: ``[H]``; B, C: ``[B, T, G, Ns]``.
        chunk_size: tokens per chunk (any T; documents may straddle chunks).
        D: ``[H]`` or ``[H, P]`` skip; z: ``[B, T, H, P]`` gate (``out * silu(z)``).
        dt_bias: ``[H]``; dt_softplus: apply softplus to ``dt + dt_bias``; dt_limit: clamp.
        initial_states: ``[B, H, P, Ns]`` per row, or ``[N, H, P, Ns]`` per document with cu_seqlens.
        seq_idx: ``[B, T]`` int document index per token; cu_seqlens: ``[N+1]`` (``B == 1``) or the
            forward's prebuilt :class:`ssm_pack.VarlenBatch`.
        return_final_states: also return ``[B, H, P, Ns]``, the state after each row.
        return_varlen_states: also return ``[N, H, P, Ns]``, the state after each document.
        backend: ``"auto"``, ``"kernel"`` (mamba-ssm, CUDA) or ``"reference"``.
    """
    return _run(checked_call(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                             seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
                             return_final_states=return_final_states, return_varlen_states=return_varlen_states,
                             backend=backend))
