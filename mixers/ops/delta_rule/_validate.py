"""Argument checks of the delta-rule ops (shapes in :mod:`mixers.ops.delta_rule`), and the checked
call every backend of them takes (:class:`DeltaCall`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ssm_pack.checks import check_int, check_tensor
from ssm_pack.varlen import VarlenBatch

from ..common.checks import check_chunk_size, varlen_of

NAMES = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gdp": "chunk_gated_delta_product"}


@dataclass(frozen=True)
class DeltaCall:
    """One checked call of a delta-rule op: what the chunked ops, their decode forms, the kernels,
    the reference and the context-parallel path take (fla's argument names; ``l2norm`` is
    ``use_qk_l2norm_in_kernel``, ``scale`` is resolved, ``varlen`` is ``cu_seqlens`` resolved).

    ``kind``: ``"gdn"`` (Gated DeltaNet), ``"kda"`` or ``"gdp"`` (Gated DeltaProduct, with
    ``num_householder`` sub-steps per token in ``k``, ``v`` and ``beta``).
    """

    kind: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    l2norm: bool
    varlen: VarlenBatch | None
    chunk_size: int
    backend: str
    num_householder: int = 1

    def replace(self, **changes) -> DeltaCall:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        """The public op's name (for messages)."""
        return NAMES[self.kind]


def _shape(name, t, want, labels):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{', '.join(labels)}] = {list(want)}, got {list(t.shape)}")


def check_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, num_householder=1):
    """Validate one of ``gdn`` / ``kda`` / ``gdp``; return the resolved :class:`ssm_pack.VarlenBatch`
    of ``cu_seqlens`` (``None`` without)."""
    check_tensor("q", q, ndim=4)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        check_tensor(name, t)
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    b, t, h, kd = q.shape
    steps = t * num_householder
    _shape("k", k, (b, steps, h, kd), ("B", "T*num_householder" if num_householder > 1 else "T", "H", "K"))
    check_tensor("v", v, ndim=4)
    hv, vd = v.shape[2], v.shape[3]
    _shape("v", v, (b, steps, hv, vd), ("B", "T*num_householder" if num_householder > 1 else "T", "HV", "V"))
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of key heads H={h}")
    if kind == "gdp" and hv != h:
        raise ValueError(f"chunk_gated_delta_product needs as many value heads as key heads, got HV={hv}, H={h}")
    _shape("beta", beta, (b, steps, hv), ("B", "T*num_householder" if num_householder > 1 else "T", "HV"))
    if kind == "kda":
        _shape("g", g, (b, t, hv, kd), ("B", "T", "HV", "K"))
    elif g is not None or kind == "gdn":
        _shape("g", g, (b, t, hv), ("B", "T", "HV"))
    check_chunk_size(chunk_size)
    varlen = None if cu_seqlens is None else varlen_of(cu_seqlens, b, t, q.device)
    rows = b if varlen is None else varlen.num_docs
    if initial_state is not None:
        _shape("initial_state", initial_state, (rows, hv, kd, vd),
               ("N" if varlen is not None else "B", "HV", "K", "V"))
    return varlen


def checked_call(kind, q, k, v, g, beta, *, scale, initial_state, output_final_state, l2norm, cu_seqlens,
                 chunk_size, backend, num_householder=1) -> DeltaCall:
    """Every argument checked (:func:`check_delta_inputs`), then the call as one :class:`DeltaCall`
    (``scale`` defaults to ``K ** -0.5``)."""
    if kind == "gdp":
        num_householder = check_int("num_householder", num_householder, minimum=1)
    varlen = check_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, num_householder)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return DeltaCall(kind, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, varlen, chunk_size,
                     backend, num_householder)
