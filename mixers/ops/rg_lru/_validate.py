"""Argument checks of ``rg_lru`` and ``rg_lru_update`` (shapes in the ops' docstrings), and the
checked calls their backends take (:class:`RGLRUCall`, :class:`RGLRUStepCall`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ssm_pack.checks import check_tensor, describe
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of
from ..common.slots import state_rows
from ..dispatch import check_backend


@dataclass(frozen=True)
class RGLRUCall:
    """One checked call of ``rg_lru`` (``varlen``: ``cu_seqlens`` resolved; ``continues``: ``[B or N]``
    bool, which rows / documents continue a state, ``None`` when none does)."""

    x: torch.Tensor
    gate_x: torch.Tensor
    gate_a: torch.Tensor
    recurrent_param: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    continues: torch.Tensor | None
    output_final_state: bool
    varlen: VarlenBatch | None
    backend: str

    def replace(self, **changes) -> RGLRUCall:
        return dataclasses.replace(self, **changes)

    @property
    def segments(self) -> int:
        """Rows, or documents plus the padding tail (whose state starts fresh)."""
        return self.x.shape[0] if self.varlen is None else self.varlen.num_docs + 1

    def continues_per_segment(self, device) -> torch.Tensor:
        """``[S]`` bool: the segment's first token continues a state (the tail never does)."""
        out = torch.zeros(self.segments, dtype=torch.bool, device=device)
        if self.continues is not None:
            out[:self.continues.shape[0]] = self.continues.to(device)
        return out

    def states_per_segment(self, dtype) -> torch.Tensor:
        """``[S, D]``: each segment's starting state (zero where none is given)."""
        h0 = self.initial_state.to(dtype)
        pad = self.segments - h0.shape[0]
        return torch.cat([h0, h0.new_zeros(pad, h0.shape[1])]) if pad else h0


def _same_shape(name: str, t, want, labels: str) -> None:
    check_tensor(name, t, ndim=len(want))
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be [{labels}] = {list(want)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (RecurrentGemma's 8.0), got {scale!r}")
    return float(scale)


def check_continues(continues, initial_state, rows: int, what: str, device) -> torch.Tensor | None:
    """``continues`` as ``[rows]`` bool on ``device`` (default: every row when ``initial_state`` is
    given, else ``None``: every row starts fresh)."""
    if continues is None:
        return None if initial_state is None else torch.ones(rows, dtype=torch.bool, device=device)
    check_tensor("continues", continues, ndim=1)
    if continues.dtype != torch.bool:
        raise TypeError(f"continues must be a bool tensor (True: the {what} continues its state), got "
                        f"{describe(continues)}")
    if continues.shape[0] != rows:
        raise ValueError(f"continues must be [{what}s] = [{rows}], got {list(continues.shape)}")
    return continues.to(device)


def checked_call(x, gate_x, gate_a, recurrent_param, *, scale, initial_state, continues, output_final_state,
                 cu_seqlens, backend) -> RGLRUCall:
    """Every argument checked, then the call as one :class:`RGLRUCall`."""
    check_tensor("x", x, ndim=3)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    b, t, d = x.shape
    _same_shape("gate_x", gate_x, (b, t, d), "B, T, D")
    _same_shape("gate_a", gate_a, (b, t, d), "B, T, D")
    _same_shape("recurrent_param", recurrent_param, (d,), "D")
    scale = check_scale(scale)
    check_backend(backend)
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {describe(output_final_state)}")
    varlen = None if cu_seqlens is None else varlen_of(cu_seqlens, b, t, x.device)
    rows, what = (b, "row") if varlen is None else (varlen.num_docs, "document")
    if initial_state is not None:
        _same_shape("initial_state", initial_state, (rows, d), "B, D" if varlen is None else "N, D")
    continues = check_continues(continues, initial_state, rows, what, x.device)
    return RGLRUCall(x, gate_x, gate_a, recurrent_param, scale, initial_state, continues, output_final_state,
                     varlen, backend)


@dataclass(frozen=True)
class RGLRUStepCall:
    """One checked call of ``rg_lru_update`` (``indices``: the pool rows as int64, or ``None``)."""

    state: torch.Tensor
    x: torch.Tensor
    gate_x: torch.Tensor
    gate_a: torch.Tensor
    recurrent_param: torch.Tensor
    scale: float
    indices: torch.Tensor | None
    continues: torch.Tensor | None
    backend: str


def checked_update(state, x, gate_x, gate_a, recurrent_param, *, scale, state_indices, continues,
                   backend) -> RGLRUStepCall:
    """Every argument of ``rg_lru_update`` checked, as one :class:`RGLRUStepCall`."""
    check_tensor("x", x, ndim=2)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    n, d = x.shape
    _same_shape("gate_x", gate_x, (n, d), "N, D")
    _same_shape("gate_a", gate_a, (n, d), "N, D")
    _same_shape("recurrent_param", recurrent_param, (d,), "D")
    check_tensor("state", state, ndim=2)
    if state.shape[1] != d or not state.is_floating_point():
        raise ValueError(f"state must be a floating-point [S, D] = [S, {d}] pool, got {describe(state)}")
    indices = state_rows(state_indices, state, n, x.device, state_name="state", indices_name="state_indices")
    if indices is not None and indices.numel() and indices.device.type == "cpu":
        if int(indices.min()) < 0 or int(indices.max()) >= state.shape[0]:
            raise ValueError(f"state_indices must name rows 0..{state.shape[0] - 1} of state, got "
                             f"{indices.tolist()}")
    if continues is not None:
        continues = check_continues(continues, None, n, "row", x.device)
    check_backend(backend)
    return RGLRUStepCall(state, x, gate_x, gate_a, recurrent_param, check_scale(scale), indices, continues, backend)
