"""Gated DeltaNet, KDA and Gated DeltaProduct ops with fla's signatures, on one chunked core.

    B = rows, T = tokens, H = key heads, HV = value heads (a multiple of H), K, V = head dims,
    N = documents (with ``cu_seqlens``, ``B == 1``) or rows

* ``chunk_gated_delta_rule``: g ``[B, T, HV]`` (scalar log-decay per head);
* ``chunk_kda``: g ``[B, T, HV, K]`` (per-channel log-decay);
* ``chunk_gated_delta_product``: k, v, beta carry ``num_householder`` sub-steps per token
  interleaved (``[B, T * nh, ...]``, fla's layout); the gate ``g`` ``[B, T, H]`` (or ``None``)
  applies once per token, before its first sub-step; the output is read after the last.

All return ``(o [B, T, HV, V], final_state)`` where ``final_state`` is ``[N, HV, K, V]`` (one per
document with ``cu_seqlens``) when ``output_final_state`` else ``None``; ``initial_state`` has
the same shape. A padding tail after ``cu_seqlens[-1]`` is its own segment; empty documents keep
their initial state. ``chunk_size`` (keyword-only, a power of two) and ``backend`` are ssm-pack's.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from ._validate import DeltaCall, checked_call
from .kernel import fla_kernel, unsupported
from .reference import delta_rule_reference, empty_result
from .step import gated_delta_product_step, gated_delta_rule_step, kda_step

__all__ = ["chunk_gated_delta_product", "chunk_gated_delta_rule", "chunk_kda", "gated_delta_product_step",
           "gated_delta_rule_step", "kda_step"]


def _run(call: DeltaCall):
    """Context parallelism (:mod:`.cp`), else fla's kernel or the reference (one backend choice)."""
    if call.varlen is not None and call.varlen.cp is not None:
        from .cp import delta_rule_cp
        return delta_rule_cp(call, _PUBLIC[call.kind])
    q, v = call.q, call.v
    if no_tokens(q.shape[0], q.shape[1]):
        return empty_result(call)
    features = (("varlen",) if call.varlen is not None else ()) + (("grouped_values",) if v.shape[2] != q.shape[2]
                                                                  else ())
    features += dispatch.backward_of(q, call.k, v, call.g, call.beta, call.initial_state)
    choice = dispatch.select_backend(call.name, call.backend, on_cuda=dispatch.is_cuda(q),
                                     support_state=lambda: dispatch.cached_support("fla", features),
                                     missing_feature=unsupported(call.kind, q))
    return fla_kernel(call) if choice == "kernel" else delta_rule_reference(call)


@outside_autocast
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, chunk_size=64, backend="auto"):
    """Gated DeltaNet: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``."""
    return _run(checked_call("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend))


@outside_autocast
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, chunk_size=64, backend="auto"):
    """Kimi Delta Attention: like GDN with a per-channel log-decay g ``[B, T, HV, K]``."""
    return _run(checked_call("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend))


@outside_autocast
def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
                              chunk_size=64, backend="auto"):
    """Gated DeltaProduct: q ``[B, T, H, K]``; k, v, beta with ``num_householder`` sub-steps per token
    ``[B, T * nh, H, ...]``; g ``[B, T, H]`` or ``None`` (no decay)."""
    return _run(checked_call("gdp", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                             num_householder=num_householder))


_PUBLIC = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gdp": chunk_gated_delta_product}   # CP local passes
