"""``causal_conv1d_fn``: varlen causal depthwise convolution with upstream's signature.

    B = rows, D = channels, T = tokens, W = width, J = W - 1, N = documents

Mirrors ``causal_conv1d.causal_conv1d_fn(x [B, D, T], weight [D, W], bias, seq_idx,
initial_states, return_final_states, final_states_out, activation)``: ``seq_idx`` boundaries are
changes of value, negative ``seq_idx`` marks padding whose output is zero, per-row
``initial_states`` ``[B, D, J]`` feed the first segment of each row.

Beyond upstream (keyword-only): ``cu_seqlens`` (``B == 1``) gives per-document
``initial_states`` ``[N, D, J]`` and per-document final states ``[N, D, J]`` (the last J inputs
of each document, reaching into its initial state when it is shorter), differentiable; final
states are also returned together with ``seq_idx``, which upstream refuses.

Kernels, in order: causal-conv1d's CUDA kernel (``kernel.py``), then fla's Triton
``causal_conv1d`` (``fla_kernel.py``: no compilation needed; also takes per-document initial
states, any width and channel count); ``backend="kernel"`` takes the first that can run and
raises when neither can, ``"auto"`` falls back to the exact reference.
"""

from __future__ import annotations

import torch

from ssm_pack.formats.segments import Segments, segments_from_seq_idx

from .. import dispatch
from ..common.autocast import outside_autocast
from . import fla_kernel
from ._validate import check_conv_inputs
from .kernel import causal_conv1d_kernel, unsupported_shape, varlen_states_kernel
from .reference import causal_conv1d_reference, gather_final_slots

__all__ = ["causal_conv1d_fn"]


def _initial_slots(initial_states, segs: Segments, per_doc: bool) -> torch.Tensor | None:
    """Initial state of every segment: per document, or the row's state for its first segment."""
    if initial_states is None:
        return None
    zeros = initial_states.new_zeros(segs.count, *initial_states.shape[1:])
    if per_doc:
        docs = torch.nonzero(segs.doc_segment >= 0).reshape(-1)
        return zeros.index_copy(0, segs.doc_segment[docs], initial_states[docs])
    rows = segs.starts // max(segs.seg_id.shape[1], 1)
    first = torch.nonzero(segs.first_in_row).reshape(-1)
    return zeros.index_copy(0, first, initial_states[rows[first]])


def _final_states(final_slots, segs: Segments, per_doc: bool, initial_states, shape):
    """Final slots of the segments -> per-document ``[N, D, J]`` or per-row ``[B, D, J]``."""
    if per_doc:
        has = segs.doc_segment >= 0
        if segs.count == 0:  # no token at all: every document keeps its initial state
            picked = final_slots.new_zeros(has.numel(), *final_slots.shape[1:])
        else:
            picked = final_slots.index_select(0, segs.doc_segment.clamp(min=0))
        empty = initial_states if initial_states is not None else torch.zeros_like(picked)
        return torch.where(has[:, None, None], picked, empty.to(picked.dtype))
    last = segs.last_in_row(*shape)
    return final_slots.index_select(0, last)


@outside_autocast
def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, *, cu_seqlens=None, backend="auto"):
    """Causal depthwise conv1d over packed rows, resetting at every document boundary.

    Args:
        x: ``[B, D, T]`` (any layout; channel-last is what the CUDA kernel wants).
        weight: ``[D, W]``; bias: ``[D]``.
        seq_idx: ``[B, T]`` int per-token document index; negative marks padding (output 0).
        initial_states: ``[B, D, J]`` per row, or ``[N, D, J]`` per document with ``cu_seqlens``.
        return_final_states: also return the final states (per row, or per document with
            ``cu_seqlens``); ``final_states_out`` receives them in place when given.
        activation: ``None``, ``"silu"`` or ``"swish"``.
        cu_seqlens: keyword-only ``[N+1]`` document boundaries of the single row (``B == 1``), or
            the forward's prebuilt :class:`ssm_pack.VarlenBatch`.
        backend: ``"auto"``, ``"kernel"`` (causal-conv1d, CUDA) or ``"reference"``.

    Returns:
        ``out`` ``[B, D, T]``, or ``(out, final_states)``.
    """
    init_per_doc, varlen = check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states,
                                             final_states_out, activation, cu_seqlens)
    if varlen is not None and varlen.cp is not None:          # context parallelism: cp.py
        from .cp import causal_conv1d_cp
        return causal_conv1d_cp(x, weight, bias, initial_states, init_per_doc, return_final_states, final_states_out,
                                activation, varlen, backend, seq_idx, causal_conv1d_fn)
    choice = _choose(x, weight, initial_states, init_per_doc, backend, seq_idx)
    pad_mask = seq_idx < 0 if seq_idx is not None else None
    segs = final = None
    if choice == "causal_conv1d":     # reads seq_idx only: no segment structure is built
        kernel_seq_idx = seq_idx if seq_idx is not None else (
            varlen.seq_idx if varlen is not None else _zeros_seq_idx(x))
        out = causal_conv1d_kernel(x, weight, bias, kernel_seq_idx, initial_states, activation)
    else:
        segs = _segments(x, seq_idx, varlen)
        slots = _initial_slots(initial_states, segs, init_per_doc)
        if choice == "fla_conv":
            out, final_slots = fla_kernel.fla_conv(x, weight, bias, segs, slots, activation, pad_mask,
                                                   return_final_states)
            if return_final_states:
                final = _final_states(final_slots, segs, varlen is not None,
                                      initial_states if init_per_doc else None, (x.shape[0], x.shape[2]))
        else:
            out = causal_conv1d_reference(x, weight, bias, segs, slots, activation, pad_mask=pad_mask)
    if not return_final_states:
        return out
    if final is None:
        final = _gather_final_states(x, seq_idx, varlen, segs, initial_states, init_per_doc, weight.shape[1] - 1,
                                     choice == "causal_conv1d")
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _zeros_seq_idx(x) -> torch.Tensor:
    return torch.zeros(x.shape[0], x.shape[2], dtype=torch.int32, device=x.device)


def _segments(x, seq_idx, varlen) -> Segments:
    """The reference's segments: the forward's (built once), or runs of ``seq_idx`` values."""
    if varlen is not None:
        return varlen.segments
    return segments_from_seq_idx(seq_idx if seq_idx is not None else _zeros_seq_idx(x))


def _choose(x, weight, initial_states, init_per_doc, backend, seq_idx) -> str:
    """``"causal_conv1d"`` (CUDA kernel), else ``"fla_conv"`` (Triton kernel), else ``"reference"``."""
    features = ("seq_idx",) + (("initial_states_with_seq_idx",) if initial_states is not None else ())

    def causal_conv1d_state():
        padded = seq_idx is not None and bool((seq_idx < 0).any())   # one device sync, kernel path only
        return dispatch.cached_support("causal_conv1d", features + (("padding_seq_idx",) if padded else ()))

    candidates = (
        ("causal_conv1d", "causal-conv1d",
         "per-document initial states" if init_per_doc else unsupported_shape(x, weight), causal_conv1d_state),
        ("fla_conv", "fla's Triton conv", fla_kernel.unsupported(x), lambda: dispatch.cached_support("fla_conv")),
    )
    return dispatch.choose_kernel("causal_conv1d_fn", backend, on_cuda=dispatch.is_cuda(x), candidates=candidates)


def _gather_final_states(x, seq_idx, varlen, segs, initial_states, init_per_doc, state_len, kernel):
    per_doc = varlen is not None
    slots_needed = initial_states is not None
    if kernel and per_doc and not slots_needed and not (torch.is_grad_enabled() and x.requires_grad):
        states = varlen_states_kernel(x, varlen.cu_seqlens, state_len)
        if states is not None:
            return states
    segs = segs if segs is not None else _segments(x, seq_idx, varlen)
    slots = _initial_slots(initial_states, segs, init_per_doc)
    final_slots = gather_final_slots(x, segs, state_len, slots)
    return _final_states(final_slots, segs, per_doc, initial_states if init_per_doc else None,
                         (x.shape[0], x.shape[2]))
