"""Argument checks of ``selective_scan_fn`` (shapes in its docstring) and the checked call every
backend takes (:class:`ScanCall`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ssm_pack.checks import check_int, check_tensor
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of


@dataclass(frozen=True)
class ScanCall:
    """One checked call of ``selective_scan_fn`` (mamba-ssm's argument names; ``varlen`` is
    ``cu_seqlens`` resolved)."""

    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    delta_bias: torch.Tensor | None
    delta_softplus: bool
    return_last_state: bool
    initial_states: torch.Tensor | None
    varlen: VarlenBatch | None
    return_varlen_states: bool
    chunk_size: int
    backend: str

    def replace(self, **changes) -> ScanCall:
        return dataclasses.replace(self, **changes)


def _shape(name, t, want, labels):
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{', '.join(labels)}] = {list(want)}, got {list(t.shape)}")


def checked_call(u, delta, A, B, C, *, D, z, delta_bias, delta_softplus, return_last_state, initial_states,
                 cu_seqlens, return_varlen_states, chunk_size, backend) -> ScanCall:
    """Every argument checked (nothing computed yet), then the call as one :class:`ScanCall`."""
    check_tensor("u", u, ndim=3)
    if not u.is_floating_point():
        raise TypeError(f"u must be a floating-point tensor, got {u.dtype}")
    b, e, t = u.shape
    _shape("delta", delta, (b, e, t), ("B", "E", "T"))
    check_tensor("A", A, ndim=2)
    ns = A.shape[1]
    _shape("A", A, (e, ns), ("E", "N_state"))
    if B is not None and isinstance(B, torch.Tensor) and B.dim() == 4:
        raise ValueError(f"B must be [B, N_state, T] (one group; Mamba-1's layout), got {list(B.shape)}; "
                         "squeeze a single group first")
    _shape("B", B, (b, ns, t), ("B", "N_state", "T"))
    _shape("C", C, (b, ns, t), ("B", "N_state", "T"))
    if D is not None:
        _shape("D", D, (e,), ("E",))
    if z is not None:
        _shape("z", z, (b, e, t), ("B", "E", "T"))
    if delta_bias is not None:
        _shape("delta_bias", delta_bias, (e,), ("E",))
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (the document boundaries)")
    varlen = None
    if cu_seqlens is not None:
        varlen = varlen_of(cu_seqlens, b, t, u.device)
    if initial_states is not None:
        rows, label = (varlen.num_docs, "N") if varlen is not None else (b, "B")
        _shape("initial_states", initial_states, (rows, e, ns), (label, "E", "N_state"))
    return ScanCall(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(return_last_state),
                    initial_states, varlen, bool(return_varlen_states), chunk_size, backend)
