"""Decode-step forms of the delta-rule ops with fla's ``fused_recurrent_*`` signatures.

    B = rows, T = tokens per row, H = key heads, HV = value heads, K, V = head dims

``fused_recurrent_gated_delta_rule``, ``fused_recurrent_kda`` (fla's functions) and
``fused_recurrent_gated_delta_product`` (ssm-pack's: fla runs its layer's decoding through GDN's
kernel on the sub-step layout) compute exactly what the chunked ops compute, for the same
arguments: ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``. They are the path for
decoding, one token per row (``T == 1``): the kernel is fla's Triton fused recurrent kernel
(:mod:`.update_kernel`); the reference is one vectorised recurrence step
(:mod:`.step`). Any other call (``T > 1``, or ``cu_seqlens``) is the chunked op's, with the
same ``backend``.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import DeltaCall, checked_call
from .step import gated_delta_product_step, gated_delta_rule_step
from .update_kernel import fused_recurrent_kernel, unsupported

__all__ = ["fused_recurrent_gated_delta_product", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]

_NAMES = {"gdn": "fused_recurrent_gated_delta_rule", "kda": "fused_recurrent_kda",
          "gdp": "fused_recurrent_gated_delta_product"}


def _chunked(call: DeltaCall, cu_seqlens):
    """Not one token per row: the chunked op of ``call.kind``, same arguments and ``backend``."""
    from . import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
    kwargs = dict(scale=call.scale, initial_state=call.initial_state, output_final_state=call.output_final_state,
                  use_qk_l2norm_in_kernel=call.l2norm, cu_seqlens=cu_seqlens, backend=call.backend)
    args = (call.q, call.k, call.v, call.g, call.beta)
    if call.kind == "gdp":
        return chunk_gated_delta_product(*args, call.num_householder, **kwargs)
    return (chunk_kda if call.kind == "kda" else chunk_gated_delta_rule)(*args, **kwargs)


def _step(call: DeltaCall):
    """One token per row: the recurrence in the compute dtype, state kept there."""
    q, k, v, g, beta, nh = call.q, call.k, call.v, call.g, call.beta, call.num_householder
    compute = compute_dtype(v.dtype)
    b, _, heads, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    state = call.initial_state.to(compute) if call.initial_state is not None else \
        v.new_zeros(b, hv, kd, vd, dtype=compute)
    up = lambda t: None if t is None else t.to(compute)  # noqa: E731
    options = dict(scale=call.scale, use_qk_l2norm_in_kernel=call.l2norm)
    if call.kind == "gdp":
        o, state = gated_delta_product_step(up(q[:, 0]), up(k).reshape(b, nh, heads, kd), up(v).reshape(b, nh, hv, vd),
                                            None if g is None else up(g[:, 0]), up(beta).reshape(b, nh, hv), state,
                                            **options)
    else:
        o, state = gated_delta_rule_step(up(q[:, 0]), up(k[:, 0]), up(v[:, 0]), up(g[:, 0]), up(beta[:, 0]), state,
                                         **options)
    return o.unsqueeze(1).to(v.dtype), (state if call.output_final_state else None)


def _run(call: DeltaCall, cu_seqlens):
    """The chunked op for anything but one token per row, else fla's kernel or the step (one choice)."""
    q, v = call.q, call.v
    if cu_seqlens is not None or q.shape[1] != 1:
        return _chunked(call, cu_seqlens)
    features = ("fused_recurrent",) + (("grouped_values",) if v.shape[2] != q.shape[2] else ())
    choice = dispatch.select_backend(_NAMES[call.kind], call.backend, on_cuda=dispatch.is_cuda(q),
                                     support_state=lambda: dispatch.cached_support("fla", features),
                                     missing_feature=unsupported(q, call.k, v, call.g, call.beta, call.initial_state))
    return fused_recurrent_kernel(call) if choice == "kernel" else _step(call)


@outside_autocast
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend="auto"):
    """Gated DeltaNet decode step: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``.

    fla >= 0.4 names ``gk`` and ``gv`` between ``g`` and ``beta``: pass ``g`` and ``beta`` by keyword
    to run the same call against fla."""
    return _run(checked_call("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=64, backend=backend), cu_seqlens)


@outside_autocast
def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend="auto"):
    """KDA decode step: like :func:`fused_recurrent_gated_delta_rule` with g ``[B, T, HV, K]``."""
    return _run(checked_call("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=64, backend=backend), cu_seqlens)


@outside_autocast
def fused_recurrent_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
                                        backend="auto"):
    """Gated DeltaProduct decode step: q ``[B, T, H, K]``; k, v, beta with ``num_householder`` sub-steps
    per token ``[B, T * nh, H, ...]``; g ``[B, T, H]`` or ``None``."""
    return _run(checked_call("gdp", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, chunk_size=64, backend=backend,
                             num_householder=num_householder), cu_seqlens)
