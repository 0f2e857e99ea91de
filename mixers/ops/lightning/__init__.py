"""``chunk_simple_gla``: linear attention with a constant per-head decay (MiniMax's lightning attention),
with fla's signature.

    B = rows, T = tokens, H = heads, K = key head dim, V = value head dim, N = documents

Mirrors ``fla.ops.simple_gla.chunk_simple_gla`` with its per-head decay ``g_gamma`` (fla's
``chunk_lightning_attn`` is this op with a slope formula of its own; MiniMax's layer computes its
slopes itself and passes ``g_gamma = -slope``): ``(o, final_state)``, ``initial_state`` and
``final_state`` ``[N, H, K, V]`` per document with ``cu_seqlens`` (``B == 1``), per row without.
The per-token gate ``g`` is refused (its state update is not a constant decay).

Computed by the SSD scan (:mod:`.as_ssd`: an exact change of variables), so the document resets,
per-document states, context parallelism (a ``cu_seqlens`` ``VarlenBatch`` carrying a CP run) and
the kernel choice are the SSD op's. Its spec, one token at a time: :mod:`.naive`; the decode step:
:mod:`.update`.
"""

from __future__ import annotations

from ..common.autocast import outside_autocast
from ._validate import checked_call
from .as_ssd import simple_gla_as_ssd

__all__ = ["chunk_simple_gla"]


@outside_autocast
def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, *, chunk_size=64, backend="auto"):
    """Linear attention ``S_t = exp(g_gamma) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``, packed.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (one dtype).
        g: must be ``None`` (fla's per-token gate; not supported).
        g_gamma: ``[H]``, the log decay per head (``<= 0``; MiniMax: ``-slope``).
        scale: multiplies ``q``; ``None`` is ``1 / sqrt(K)`` (fla's default; MiniMax uses 1).
        initial_state: ``[N, H, K, V]`` per document with ``cu_seqlens``, else ``[B, H, K, V]``.
        output_final_state: also return the state after each document (row) in the same layout.
        cu_seqlens: ``[N+1]`` offsets (``B == 1``) or the forward's :class:`ssm_pack.VarlenBatch`.
        chunk_size: the scan's chunk length (any ``T``; documents may straddle chunks).
        backend: ``"auto"``, ``"kernel"`` (mamba-ssm's SSD scan, CUDA) or ``"reference"``.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    from ..ssd import mamba_chunk_scan_combined
    call = checked_call("chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                        cu_seqlens, chunk_size, backend)
    return simple_gla_as_ssd(call, mamba_chunk_scan_combined)
