"""``chunk_simple_gla``: linear attention with a constant per-head decay (MiniMax's lightning attention),
with fla's signature.

    B = rows, T = tokens, H = heads, K = key head dim, V = value head dim, N = documents

Mirrors ``fla.ops.simple_gla.chunk_simple_gla`` with its per-head decay ``g_gamma`` (fla's
``chunk_lightning_attn`` is this op with a slope formula of its own; MiniMax's layer computes its
slopes itself and passes ``g_gamma = -slope``): ``(o, final_state)``, ``initial_state`` and
``final_state`` ``[N, H, K, V]`` per document with ``cu_seqlens`` (``B == 1``), per row without.
The per-token gate ``g`` is refused (its state update is not a constant decay).

Two routes, one backend choice (:func:`_route`): fla's own Triton kernel (:mod:`.kernel`) on CUDA where
fla is installed and can do the call, else the SSD scan (:mod:`.as_ssd`: an exact change of variables),
whose document resets, per-document states, context parallelism (a ``cu_seqlens`` ``VarlenBatch``
carrying a CP run, always this route) and own choice (mamba-ssm's scan, else the torch scan) serve the
op unchanged. CPU calls with ``"auto"`` take the SSD route without reading any package metadata. Its
spec, one token at a time: :mod:`.naive`; the decode step: :mod:`.update`.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from ._validate import SimpleGLACall, checked_call
from .as_ssd import simple_gla_as_ssd
from .kernel import fla_simple_gla, unsupported

__all__ = ["chunk_simple_gla"]

FLA_LABEL = "fla's chunk_simple_gla"
SSD_LABEL = "mamba-ssm's SSD scan"


def _route(call: SimpleGLACall) -> str:
    """``"fla"`` (fla's kernel) or ``"ssd"`` (the SSD op, which makes its own kernel choice).

    ``"auto"``: fla's kernel on CUDA when it is installed and can do the call, else the SSD op with
    ``"auto"`` (on CPU without asking anything). ``"kernel"``: fla's kernel, else mamba-ssm's SSD
    kernel, else a ``RuntimeError`` (``ValueError`` when neither kernel can take the inputs) naming
    both reasons. ``"reference"``: the SSD op's torch scan. Context parallelism and the empty call
    are the SSD op's.
    """
    if (call.varlen is not None and call.varlen.cp is not None) or no_tokens(call.q.shape[0], call.q.shape[1]):
        return "ssd"
    on_cuda = dispatch.is_cuda(call.q)
    if call.backend == "reference" or (call.backend == "auto" and not on_cuda):
        return "ssd"                    # nothing more to decide: the CPU default costs one device test
    backward = dispatch.backward_of(call.q, call.k, call.v, call.g_gamma, call.initial_state)
    packed = ("varlen",) if call.varlen is not None else ()
    candidates = (("fla_simple_gla", FLA_LABEL, unsupported(call),
                   lambda: dispatch.cached_support("fla_simple_gla", packed + backward)),
                  ("mamba_ssd", SSD_LABEL, None, lambda: dispatch.cached_support("mamba_ssd", ("seq_idx",) + backward)))
    choice = dispatch.choose_kernel("chunk_simple_gla", call.backend, on_cuda=on_cuda, candidates=candidates)
    return "fla" if choice == "fla_simple_gla" else "ssd"


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
        chunk_size: the SSD route's chunk length (any ``T``; documents may straddle chunks); fla's
            kernel chunks by its own 64.
        backend: ``"auto"``, ``"kernel"`` (fla's ``chunk_simple_gla``, else mamba-ssm's SSD scan; CUDA)
            or ``"reference"`` (the torch SSD scan).

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    from ..ssd import mamba_chunk_scan_combined
    call = checked_call("chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                        cu_seqlens, chunk_size, backend)
    if _route(call) == "fla":
        return fla_simple_gla(call)
    return simple_gla_as_ssd(call, mamba_chunk_scan_combined)
