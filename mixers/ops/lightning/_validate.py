"""Argument checks of ``chunk_simple_gla`` and ``fused_recurrent_simple_gla`` (shapes in the ops'
docstrings), and the checked call their backends take (:class:`SimpleGLACall`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssm_pack.checks import check_tensor
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of


@dataclass(frozen=True)
class SimpleGLACall:
    """One checked call (fla's argument names; ``varlen`` is ``cu_seqlens`` resolved, ``scale`` a float)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g_gamma: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    varlen: VarlenBatch | None
    chunk_size: int
    backend: str


def _shape(name, t, want, labels):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{', '.join(labels)}] = {list(want)}, got {list(t.shape)}")


def checked_call(op, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                 backend) -> SimpleGLACall:
    """Every argument checked (before anything is computed), then the call as one :class:`SimpleGLACall`."""
    if g is not None:
        raise ValueError(f"{op}: a per-token gate g is not supported (the decay here is one constant per head); "
                         "pass g=None and the per-head log decay as g_gamma [H]")
    check_tensor("q", q, ndim=4)
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    b, t, h, kd = q.shape
    _shape("k", k, (b, t, h, kd), ("B", "T", "H", "K"))
    check_tensor("v", v, ndim=4)
    _shape("v", v, (b, t, h, v.shape[3]), ("B", "T", "H", "V"))
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if g_gamma is None:
        raise ValueError(f"{op}: g_gamma (the per-head log decay [H], <= 0) is required")
    _shape("g_gamma", g_gamma, (h,), ("H",))
    if not g_gamma.is_floating_point():
        raise TypeError(f"g_gamma must be a floating-point tensor, got {g_gamma.dtype}")
    if scale is None:
        scale = kd ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None (1 / sqrt(K)), got {scale!r}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {output_final_state!r}")
    varlen = None if cu_seqlens is None else varlen_of(cu_seqlens, b, t, q.device)
    if initial_state is not None:
        rows, label = (b, "B") if varlen is None else (varlen.num_docs, "N")
        _shape("initial_state", initial_state, (rows, h, kd, v.shape[3]), (label, "H", "K", "V"))
    return SimpleGLACall(q, k, v, g_gamma, float(scale), initial_state, output_final_state, varlen, chunk_size,
                         backend)
