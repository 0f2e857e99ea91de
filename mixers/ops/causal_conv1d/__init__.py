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
``causal_conv1d`` (``kernel_fla.py``: no compilation needed; also takes per-document initial
states, any width and channel count); ``backend="kernel"`` takes the first that can run and
raises when neither can, ``"auto"`` falls back to the exact reference.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from . import kernel_fla
from ._validate import ConvCall, checked_call
from .kernel import causal_conv1d_kernel, unsupported_shape
from .reference import causal_conv1d_reference
from .states import empty_result, final_states, gather_final_states, initial_slots, segments, zeros_seq_idx

__all__ = ["causal_conv1d_fn"]


def _choose(call: ConvCall) -> str:
    """``"causal_conv1d"`` (CUDA kernel), else ``"fla_conv"`` (Triton kernel), else ``"reference"``."""
    x = call.x
    # padding needs no kernel feature: the kernel never sees a negative seq_idx (kernel.py)
    features = ("seq_idx",) + (("initial_states_with_seq_idx",) if call.initial_states is not None else ())
    candidates = (
        ("causal_conv1d", "causal-conv1d",
         "per-document initial states" if call.per_doc else unsupported_shape(x, call.weight),
         lambda: dispatch.cached_support("causal_conv1d", features)),
        ("fla_conv", "fla's Triton conv", kernel_fla.unsupported(x), lambda: dispatch.cached_support("fla_conv")),
    )
    return dispatch.choose_kernel("causal_conv1d_fn", call.backend, on_cuda=dispatch.is_cuda(x), candidates=candidates)


def _run(call: ConvCall):
    """Context parallelism (:mod:`.cp`), else the first kernel that can run, else the reference."""
    if call.varlen is not None and call.varlen.cp is not None:
        from .cp import causal_conv1d_cp
        return causal_conv1d_cp(call, causal_conv1d_fn)
    if no_tokens(call.x.shape[0], call.x.shape[2]):
        return empty_result(call)
    x, weight, bias, seq_idx, varlen = call.x, call.weight, call.bias, call.seq_idx, call.varlen
    choice = _choose(call)
    pad_mask = seq_idx < 0 if seq_idx is not None else None
    segs = final = None
    if choice == "causal_conv1d":     # reads seq_idx only: no segment structure is built
        if seq_idx is not None:       # the caller's: renumbered, padding runs as segments, zeroed after
            out = causal_conv1d_kernel(x, weight, bias, seq_idx, call.initial_states, call.activation,
                                       pad_mask=pad_mask)
        else:                         # the forward's (built once, already normal) or one segment per row
            normal = varlen.renumbered_seq_idx if varlen is not None else zeros_seq_idx(x)
            out = causal_conv1d_kernel(x, weight, bias, normal, call.initial_states, call.activation, normal=True)
    else:
        segs = segments(call)
        slots = initial_slots(call, segs)
        if choice == "fla_conv":
            out, final_slots = kernel_fla.fla_conv(x, weight, bias, segs, slots, call.activation, pad_mask,
                                                   call.return_final_states,
                                                   varlen.fla_conv_layout if varlen is not None else None)
            if call.return_final_states:
                final = final_states(call, final_slots, segs)
        else:
            out = causal_conv1d_reference(x, weight, bias, segs, slots, call.activation, pad_mask=pad_mask)
    if not call.return_final_states:
        return out
    if final is None:
        final = gather_final_states(call, segs, choice == "causal_conv1d")
    if call.final_states_out is not None:
        call.final_states_out.copy_(final)
        final = call.final_states_out
    return out, final


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
    return _run(checked_call(x, weight, bias, seq_idx, initial_states, return_final_states=return_final_states,
                             final_states_out=final_states_out, activation=activation, cu_seqlens=cu_seqlens,
                             backend=backend))
