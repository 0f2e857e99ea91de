"""Argument checks of ``mamba_chunk_scan_combined`` and ``selective_state_update`` (shapes in the ops'
docstrings), and the checked calls their backends take (:class:`SSDCall`, :class:`StateUpdateCall`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ssm_pack.checks import check_int, check_tensor
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of
from ..common.slots import state_rows


@dataclass(frozen=True)
class SSDCall:
    """One checked call of ``mamba_chunk_scan_combined`` (mamba-ssm's argument names; ``varlen`` is
    ``cu_seqlens`` resolved, ``per_doc`` says ``initial_states`` are per document ``[N, ...]``)."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    chunk_size: int
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_states: torch.Tensor | None
    seq_idx: torch.Tensor | None
    varlen: VarlenBatch | None
    per_doc: bool
    dt_softplus: bool
    dt_limit: tuple
    return_final_states: bool
    return_varlen_states: bool
    backend: str

    def replace(self, **changes) -> SSDCall:
        return dataclasses.replace(self, **changes)


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


def checked_call(x, dt, A, B, C, chunk_size, *, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                 dt_limit, return_final_states, return_varlen_states, backend) -> SSDCall:
    """Every argument checked (:func:`check_ssd_inputs`), then the call as one :class:`SSDCall`."""
    per_doc, varlen = check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                       cu_seqlens, dt_limit, return_varlen_states)
    return SSDCall(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, varlen, per_doc, dt_softplus,
                   dt_limit, return_final_states, return_varlen_states, backend)


def default_limit(dt_limit) -> bool:
    return tuple(float(v) for v in dt_limit) == (0.0, math.inf)


@dataclass(frozen=True)
class StateUpdateCall:
    """One checked call of ``selective_state_update``, with heads (``state [S, H, P, Ns]``;
    ``indices`` is ``state_batch_indices`` as int64, or ``None`` when row i updates state i)."""

    state: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    indices: torch.Tensor | None
    dt_limit: tuple
    backend: str


def _pool_shape(name, t, want):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be {list(want)}, got {list(t.shape)}")


def _with_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Upstream's head-less forms (``state [S, P, Ns]`` ...) as one head."""
    check_tensor("state", state, ndim=(3, 4))
    if state.dim() == 4:
        return state, x, dt, A, B, C, D, z, dt_bias
    one = lambda t, dim: None if t is None else t.unsqueeze(dim)  # noqa: E731
    return (state.unsqueeze(1), one(x, 1), one(dt, 1), one(A, 0), one(B, 1), one(C, 1), one(D, 0), one(z, 1),
            one(dt_bias, 0))


def _check_update(state, x, dt, A, B, C, D, z, dt_bias, indices, dt_limit):
    _, heads, p, ns = state.shape
    check_tensor("x", x, ndim=3)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    rows = x.shape[0]
    _pool_shape("x", x, (rows, heads, p))
    _pool_shape("dt", dt, (rows, heads, p))
    _pool_shape("A", A, (heads, p, ns))
    check_tensor("B", B, ndim=3)
    groups = B.shape[1]
    if groups == 0 or heads % groups:
        raise ValueError(f"the groups of B (G={groups}) must divide the heads of state (H={heads})")
    _pool_shape("B", B, (rows, groups, ns))
    _pool_shape("C", C, (rows, groups, ns))
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _pool_shape(name, t, (heads, p))
    if z is not None:
        _pool_shape("z", z, (rows, heads, p))
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2 or dt_limit[0] > dt_limit[1]):
        raise ValueError(f"dt_limit must be a (low, high) pair with low <= high, got {dt_limit!r}")
    return state_rows(indices, state, rows, x.device, state_name="state", indices_name="state_batch_indices")


def checked_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, state_batch_indices, dt_limit,
                   backend) -> StateUpdateCall:
    """Every argument of ``selective_state_update`` checked, as one :class:`StateUpdateCall` with heads
    (a 3-D ``state`` is upstream's head-less form: the error says the shapes shown have its one head)."""
    has_heads = isinstance(state, torch.Tensor) and state.dim() == 4
    state, x, dt, A, B, C, D, z, dt_bias = _with_heads(state, x, dt, A, B, C, D, z, dt_bias)
    try:
        indices = _check_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_limit)
    except ValueError as err:
        if has_heads:
            raise
        raise ValueError(f"{err} (a 3-D state is upstream's head-less form: shapes are shown with its one head)") \
            from None
    return StateUpdateCall(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices, dt_limit, backend)
