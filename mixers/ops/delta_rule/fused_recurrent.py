"""Decode-step forms of the delta-rule ops with fla's ``fused_recurrent_*`` signatures.

    B = rows, T = tokens per row, H = key heads, HV = value heads, K, V = head dims

``fused_recurrent_gated_delta_rule``, ``fused_recurrent_kda`` (fla's functions) and
``fused_recurrent_gated_delta_product`` (ssm-pack's: fla runs its layer's decoding through GDN's
kernel on the sub-step layout) compute exactly what the chunked ops compute, for the same
arguments: ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``. They are the path for
decoding, one token per row (``T == 1``): the kernel is fla's Triton fused recurrent kernel
(:mod:`.fused_recurrent_kernel`); the reference is one vectorised recurrence step
(:mod:`.recurrent`). Any other call (``T > 1``, or ``cu_seqlens``) is the chunked op's, with the
same ``backend``.
"""

from __future__ import annotations

from ssm_pack.checks import check_int

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.chunks import compute_dtype
from ._validate import check_delta_inputs
from .fused_recurrent_kernel import fused_recurrent_kernel, unsupported
from .recurrent import gated_delta_product_step, gated_delta_rule_step

__all__ = ["fused_recurrent_gated_delta_product", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]

_NAMES = {"gdn": "fused_recurrent_gated_delta_rule", "kda": "fused_recurrent_kda",
          "gdp": "fused_recurrent_gated_delta_product"}


def _chunked(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, backend, nh):
    from . import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu_seqlens, backend=backend)
    if kind == "gdp":
        return chunk_gated_delta_product(q, k, v, g, beta, nh, **kwargs)
    return (chunk_kda if kind == "kda" else chunk_gated_delta_rule)(q, k, v, g, beta, **kwargs)


def _step(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, nh):
    """One token per row: the recurrence in the compute dtype, state kept there."""
    compute = compute_dtype(v.dtype)
    b, _, heads, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    state = initial_state.to(compute) if initial_state is not None else \
        v.new_zeros(b, hv, kd, vd, dtype=compute)
    up = lambda t: None if t is None else t.to(compute)  # noqa: E731
    if kind == "gdp":
        o, state = gated_delta_product_step(up(q[:, 0]), up(k).reshape(b, nh, heads, kd), up(v).reshape(b, nh, hv, vd),
                                            None if g is None else up(g[:, 0]), up(beta).reshape(b, nh, hv), state,
                                            scale=scale, use_qk_l2norm_in_kernel=l2norm)
    else:
        o, state = gated_delta_rule_step(up(q[:, 0]), up(k[:, 0]), up(v[:, 0]), up(g[:, 0]), up(beta[:, 0]), state,
                                         scale=scale, use_qk_l2norm_in_kernel=l2norm)
    return o.unsqueeze(1).to(v.dtype), (state if output_final_state else None)


def _run(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, backend, nh=1):
    check_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, 64, nh)
    if cu_seqlens is not None or q.shape[1] != 1:
        return _chunked(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens,
                        backend, nh)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    choice = dispatch.select_backend(_NAMES[kind], backend, on_cuda=dispatch.is_cuda(q),
                                     support_state=lambda: dispatch.cached_support("fla", ("fused_recurrent",) + (
                                         ("grouped_values",) if v.shape[2] != q.shape[2] else ())),
                                     missing_feature=unsupported(q, k, v, g, beta, initial_state))
    if choice == "kernel":
        return fused_recurrent_kernel(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, nh)
    return _step(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, nh)


@outside_autocast
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend="auto"):
    """Gated DeltaNet decode step: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``.

    fla >= 0.4 names ``gk`` and ``gv`` between ``g`` and ``beta``: pass ``g`` and ``beta`` by keyword
    to run the same call against fla."""
    return _run("gdn", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, backend)


@outside_autocast
def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend="auto"):
    """KDA decode step: like :func:`fused_recurrent_gated_delta_rule` with g ``[B, T, HV, K]``."""
    return _run("kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, backend)


@outside_autocast
def fused_recurrent_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
                                        backend="auto"):
    """Gated DeltaProduct decode step: q ``[B, T, H, K]``; k, v, beta with ``num_householder`` sub-steps
    per token ``[B, T * nh, H, ...]``; g ``[B, T, H]`` or ``None``."""
    nh = check_int("num_householder", num_householder, minimum=1)
    return _run("gdp", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, backend, nh=nh)
