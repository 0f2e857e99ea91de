"""Argument checks of the delta-rule ops (shapes in :mod:`mixers.ops.delta_rule`)."""

from __future__ import annotations

from ssm_pack.checks import check_tensor

from ..common.checks import check_chunk_size, varlen_of


def _shape(name, t, want, labels):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{', '.join(labels)}] = {list(want)}, got {list(t.shape)}")


def check_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, householder=1):
    """Validate one of ``gdn`` / ``kda`` / ``gdp``; return the resolved :class:`ssm_pack.VarlenBatch`
    of ``cu_seqlens`` (``None`` without)."""
    check_tensor("q", q, ndim=4)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    b, t, h, kd = q.shape
    steps = t * householder
    _shape("k", k, (b, steps, h, kd), ("B", "T*num_householder" if householder > 1 else "T", "H", "K"))
    check_tensor("v", v, ndim=4)
    hv, vd = v.shape[2], v.shape[3]
    _shape("v", v, (b, steps, hv, vd), ("B", "T*num_householder" if householder > 1 else "T", "HV", "V"))
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of key heads H={h}")
    if kind == "gdp" and hv != h:
        raise ValueError(f"chunk_gated_delta_product needs as many value heads as key heads, got HV={hv}, H={h}")
    _shape("beta", beta, (b, steps, hv), ("B", "T*num_householder" if householder > 1 else "T", "HV"))
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
