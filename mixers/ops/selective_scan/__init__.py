"""``selective_scan_fn``: Mamba's (Mamba-1's) selective scan with upstream's signature.

    B = rows, E = channels (d_inner), T = tokens, Ns = state size, N = documents

Mirrors ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn(u, delta, A, B, C, D=None,
z=None, delta_bias=None, delta_softplus=False, return_last_state=False)`` and its return
conventions: ``out`` or ``(out, last_state)``; ``u, delta, z [B, E, T]``, ``A [E, Ns]`` (real),
``B, C [B, Ns, T]`` (input-dependent, one group).

Beyond upstream (keyword-only): ``cu_seqlens`` (``B == 1``) resets the state at every document,
``initial_states`` (``[B, E, Ns]`` per row, ``[N, E, Ns]`` per document with ``cu_seqlens``),
``return_varlen_states`` (the differentiable state after each document, ``[N, E, Ns]``) and
``chunk_size`` (the torch backend's chunk length: memory, not results).

Backend: mamba-ssm's CUDA ``selective_scan_fn`` takes neither ``seq_idx`` nor ``cu_seqlens`` nor an
initial state, so it cannot run a packed row without leaking one document's state into the next.
Every call therefore runs ssm-pack's torch backend (:mod:`.reference`) on every device;
``backend="kernel"`` raises saying so.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from ._validate import ScanCall, checked_call
from .reference import empty_result, selective_scan_reference

__all__ = ["NO_KERNEL", "selective_scan_fn"]

NO_KERNEL = ("mamba-ssm's selective_scan_fn has no seq_idx / cu_seqlens and no initial state, so it cannot "
             "reset at packed documents; ssm-pack's torch backend runs on every device")


def _run(call: ScanCall):
    """Context parallelism (:mod:`.cp`), no token, else the torch backend."""
    if call.varlen is not None and call.varlen.cp is not None:
        from .cp import selective_scan_cp
        return selective_scan_cp(call, selective_scan_fn)
    if no_tokens(call.u.shape[0], call.u.shape[2]):
        return empty_result(call)
    return selective_scan_reference(call)


@outside_autocast
def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, *, initial_states=None, cu_seqlens=None, return_varlen_states=False,
                      chunk_size=64, backend="auto"):
    """Mamba-1 selective scan over packed rows, resetting the state at every document.

    Args:
        u: ``[B, E, T]`` input; delta: ``[B, E, T]`` step sizes (before ``delta_bias`` / softplus).
        A: ``[E, Ns]`` (``-exp(A_log)``); B, C: ``[B, Ns, T]``; D: ``[E]`` skip; z: ``[B, E, T]`` gate
            (``out * silu(z)``); delta_bias: ``[E]``; delta_softplus: ``softplus(delta + delta_bias)``.
        return_last_state: also return ``[B, E, Ns]``, the state after each row's last token.
        initial_states: ``[B, E, Ns]`` per row, or ``[N, E, Ns]`` per document with ``cu_seqlens``.
        cu_seqlens: ``[N+1]`` document boundaries (``B == 1``) or the forward's
            :class:`ssm_pack.VarlenBatch`; a tail after ``cu_seqlens[-1]`` is one more segment.
        return_varlen_states: also return ``[N, E, Ns]``, the state after each document.
        chunk_size: tokens per chunk of the torch backend (any T; documents may straddle chunks).
        backend: ``"auto"`` or ``"reference"`` (the same path); ``"kernel"`` raises (see the module docstring).
    """
    dispatch.check_backend(backend)
    if backend == "kernel":
        raise ValueError(f"selective_scan_fn: backend='kernel' is unavailable: {NO_KERNEL}; use backend='auto'")
    return _run(checked_call(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                             return_last_state=return_last_state, initial_states=initial_states,
                             cu_seqlens=cu_seqlens, return_varlen_states=return_varlen_states,
                             chunk_size=chunk_size, backend=backend))
