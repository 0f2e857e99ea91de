"""Argument checks of ``causal_conv1d_fn`` (shapes in the module docstring), and the checked call
every backend of it takes (:class:`ConvCall`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssm_pack.checks import check_tensor
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of

ACTIVATIONS = (None, "silu", "swish")


@dataclass(frozen=True)
class ConvCall:
    """One checked call of ``causal_conv1d_fn`` (causal-conv1d's argument names; ``varlen`` is
    ``cu_seqlens`` resolved, ``per_doc`` says ``initial_states`` are per document ``[N, D, W-1]``)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    seq_idx: torch.Tensor | None
    initial_states: torch.Tensor | None
    per_doc: bool
    return_final_states: bool
    final_states_out: torch.Tensor | None
    activation: str | None
    varlen: VarlenBatch | None
    backend: str

    @property
    def state_len(self) -> int:
        """``W - 1``: the inputs a document's state holds."""
        return self.weight.shape[1] - 1


def _check_states(name, states, rows, dim, state_len, what):
    check_tensor(name, states, ndim=3)
    if tuple(states.shape) != (rows, dim, state_len):
        raise ValueError(f"{name} must be [{what}, D, W-1] = [{rows}, {dim}, {state_len}], "
                         f"got {tuple(states.shape)}")


def check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
                      activation, cu_seqlens):
    """Validate; return ``(per_doc, varlen)``: whether ``initial_states`` are per document
    (``cu_seqlens``, ``N`` rows) and the resolved :class:`ssm_pack.VarlenBatch` (or ``None``)."""
    check_tensor("x", x, ndim=3)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    batch, dim, length = x.shape
    check_tensor("weight", weight, ndim=2)
    if weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D, W] = [{dim}, W>=1], got {tuple(weight.shape)}")
    if bias is not None and tuple(check_tensor("bias", bias, ndim=1).shape) != (dim,):
        raise ValueError(f"bias must be [D] = [{dim}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, ndim=2, integer=True)
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(f"seq_idx must be [B, T] = [{batch}, {length}], got {tuple(seq_idx.shape)}")
    state_len = weight.shape[1] - 1
    per_doc, varlen = False, None
    rows, what = batch, "B"
    if cu_seqlens is not None:
        varlen = varlen_of(cu_seqlens, batch, length, x.device, seq_idx)
        docs = varlen.num_docs
        if initial_states is not None and initial_states.shape[0] == docs:
            per_doc, rows, what = True, docs, "N"
        elif initial_states is not None and initial_states.shape[0] != batch:
            raise ValueError(f"initial_states must have one row per document (N={docs}) or per packed "
                             f"row (B={batch}), got {initial_states.shape[0]} rows")
    if initial_states is not None:
        _check_states("initial_states", initial_states, rows, dim, state_len, what)
    if final_states_out is not None:
        if not return_final_states:
            raise ValueError("final_states_out is given but return_final_states=False; set it to True")
        out_rows = varlen.num_docs if varlen is not None else batch
        _check_states("final_states_out", final_states_out, out_rows, dim, state_len,
                      "N" if varlen is not None else "B")
    return per_doc, varlen


def checked_call(x, weight, bias, seq_idx, initial_states, *, return_final_states, final_states_out, activation,
                 cu_seqlens, backend) -> ConvCall:
    """Every argument checked (:func:`check_conv_inputs`), then the call as one :class:`ConvCall`."""
    per_doc, varlen = check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states,
                                        final_states_out, activation, cu_seqlens)
    return ConvCall(x, weight, bias, seq_idx, initial_states, per_doc, return_final_states, final_states_out,
                    activation, varlen, backend)
