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

from ssm_pack.seq_idx import seq_idx_from_cu_seqlens

from .. import _dispatch
from .._segments import Segments, segments_from_cu_seqlens, segments_from_seq_idx
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
        cu_seqlens: keyword-only ``[N+1]`` document boundaries of the single row (``B == 1``);
            ``seq_idx`` is derived from it when not given.
        backend: ``"auto"``, ``"kernel"`` (causal-conv1d, CUDA) or ``"reference"``.

    Returns:
        ``out`` ``[B, D, T]``, or ``(out, final_states)``.
    """
    init_per_doc = check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states,
                                     final_states_out, activation, cu_seqlens)
    batch, dim, length = x.shape
    state_len = weight.shape[1] - 1
    user_seq_idx = seq_idx is not None
    if cu_seqlens is not None:
        segs = segments_from_cu_seqlens(cu_seqlens, length)
    else:
        seq_idx = seq_idx if seq_idx is not None else torch.zeros(batch, length, dtype=torch.int32,
                                                                   device=x.device)
        segs = segments_from_seq_idx(seq_idx)
    slots = _initial_slots(initial_states, segs, init_per_doc)
    doc_init = initial_states if init_per_doc else None
    choice = _choose(x, weight, initial_states, init_per_doc, backend, seq_idx, user_seq_idx)
    pad_mask = seq_idx < 0 if user_seq_idx else None
    fla_final = None
    if choice == "causal_conv1d":
        if seq_idx is None:                          # only this kernel reads seq_idx for cu_seqlens
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, length)
        out = causal_conv1d_kernel(x, weight, bias, seq_idx, initial_states, activation)
    elif choice == "fla":
        out, fla_final = fla_kernel.fla_conv(x, weight, bias, segs, slots, activation, pad_mask,
                                             return_final_states)
    else:
        out = causal_conv1d_reference(x, weight, bias, segs, slots, activation, pad_mask=pad_mask)
    if not return_final_states:
        return out
    if fla_final is not None:
        final = _final_states(fla_final, segs, cu_seqlens is not None, doc_init, (batch, length))
    else:
        final = _gather_final_states(x, cu_seqlens, segs, slots, state_len, doc_init, choice == "causal_conv1d")
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _choose(x, weight, initial_states, init_per_doc, backend, seq_idx, user_seq_idx) -> str:
    """``"causal_conv1d"`` (CUDA kernel), else ``"fla"`` (Triton kernel), else ``"reference"``."""
    on_cuda = _dispatch.is_cuda(x)
    if init_per_doc:
        missing = "per-document initial states"
    else:
        missing = unsupported_shape(x, weight) if on_cuda else None
    features = ("seq_idx",) + (("initial_states_with_seq_idx",) if initial_states is not None else ())

    def support_state():
        padded = user_seq_idx and bool((seq_idx < 0).any())       # one device sync, kernel path only
        return _dispatch.cached_support("causal_conv1d", features + (("padding_seq_idx",) if padded else ()))

    first = _dispatch.select_backend("causal_conv1d_fn", "auto" if backend == "kernel" else backend,
                                     on_cuda=on_cuda, support_state=support_state, missing_feature=missing)
    if first == "kernel":
        return "causal_conv1d"
    if backend == "reference":
        return "reference"
    second = _dispatch.select_backend("causal_conv1d_fn", "auto", on_cuda=on_cuda,
                                      support_state=lambda: _dispatch.cached_support("fla_conv"),
                                      missing_feature=fla_kernel.unsupported(x))
    if second == "kernel":
        return "fla"
    if backend == "kernel":
        _raise_no_conv_kernel(on_cuda, missing, support_state, x)
    return "reference"


def _raise_no_conv_kernel(on_cuda, missing, support_state, x):
    """``backend="kernel"`` and neither kernel can run: say why for each."""
    if not on_cuda:
        raise ValueError("causal_conv1d_fn: backend='kernel' needs CUDA tensors; use backend='reference' on CPU")
    fla_missing = fla_kernel.unsupported(x)
    reasons = [f"causal-conv1d cannot do {missing}" if missing else f"causal-conv1d: {support_state()[1]}",
               f"fla's Triton conv cannot do {fla_missing}" if fla_missing else
               f"fla's Triton conv: {_dispatch.cached_support('fla_conv')[1]}"]
    error = ValueError if missing and fla_missing else RuntimeError
    raise error(f"causal_conv1d_fn: backend='kernel' is unavailable ({'; '.join(reasons)}); "
                "use backend='reference' (or 'auto', which picks it)")


def _gather_final_states(x, cu_seqlens, segs, slots, state_len, doc_init, kernel):
    per_doc = cu_seqlens is not None
    if kernel and per_doc and slots is None and not (torch.is_grad_enabled() and x.requires_grad):
        states = varlen_states_kernel(x, cu_seqlens, state_len)
        if states is not None:
            return states
    final_slots = gather_final_slots(x, segs, state_len, slots)
    return _final_states(final_slots, segs, per_doc, doc_init, (x.shape[0], x.shape[2]))
