"""Argument checks of ``mamba_chunk_scan_combined`` (shapes in the op's docstring)."""

from __future__ import annotations

import math

from ssm_pack.checks import check_int, check_tensor

from ..common.checks import varlen_of


def _shape(name, t, want, labels):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{', '.join(labels)}] = {list(want)}, got {list(t.shape)}")


def check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                     dt_limit, return_varlen_states):
    """Validate; return ``(per_doc, varlen)``: whether ``initial_states`` are per document
    (``cu_seqlens``, ``N`` rows) and the resolved :class:`ssm_pack.VarlenBatch` (or ``None``)."""
    check_tensor("x", x, ndim=4)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    b, t, h, p = x.shape
    _shape("dt", dt, (b, t, h), ("B", "T", "H"))
    _shape("A", A, (h,), ("H",))
    check_tensor("B", B, ndim=4)
    g, ns = B.shape[2:]
    _shape("B", B, (b, t, g, ns), ("B", "T", "G", "N_state"))
    _shape("C", C, (b, t, g, ns), ("B", "T", "G", "N_state"))
    if g == 0 or h % g:
        raise ValueError(f"the groups of B/C (G={g}) must divide the heads of x (H={h})")
    check_int("chunk_size", chunk_size, minimum=1)
    if D is not None:
        check_tensor("D", D, ndim=(1, 2))
        if tuple(D.shape) not in ((h,), (h, p)):
            raise ValueError(f"D must be [H] = [{h}] or [H, P] = [{h}, {p}], got {list(D.shape)}")
    if z is not None:
        _shape("z", z, (b, t, h, p), ("B", "T", "H", "P"))
    if dt_bias is not None:
        _shape("dt_bias", dt_bias, (h,), ("H",))
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not all(isinstance(v, (int, float)) for v in dt_limit) or dt_limit[0] > dt_limit[1]):
        raise ValueError(f"dt_limit must be a (low, high) pair with low <= high, got {dt_limit!r}")
    if seq_idx is not None:
        _shape("seq_idx", seq_idx, (b, t), ("B", "T"))
        check_tensor("seq_idx", seq_idx, integer=True)
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (the document boundaries)")
    per_doc, varlen = False, None
    if cu_seqlens is not None:
        varlen = varlen_of(cu_seqlens, b, t, x.device, seq_idx)
        per_doc = initial_states is not None and initial_states.shape[0] == varlen.num_docs
    if initial_states is not None:
        rows = initial_states.shape[0] if per_doc else b
        _shape("initial_states", initial_states, (rows, h, p, ns), ("N" if per_doc else "B", "H", "P", "N_state"))
    return per_doc, varlen


def default_limit(dt_limit) -> bool:
    return tuple(float(v) for v in dt_limit) == (0.0, math.inf)
