"""flash-linear-attention's Triton ``causal_conv1d``: the second kernel of ``causal_conv1d_fn``.

It runs where causal-conv1d's CUDA kernel cannot (no compiled extension: causal-conv1d must be
built against the installed torch, fla is pure Python; or a feature that kernel lacks, such as
per-document initial states, widths above 4, channel counts that are not multiples of 8).

Upstream contract (``fla.modules.causal_conv1d.causal_conv1d``, flash-linear-attention 0.6.0,
each point checked against the reference in the interpreter lane, ``tests/interpret``):

* ``x [B, T, D]`` token-major with any strides, ``weight [D, W]`` (any width), ``bias [D]``;
  ``activation`` ``None`` / ``"silu"`` / ``"swish"``. The output is a new contiguous
  ``[B, T, D]`` in ``x.dtype``, accumulated in fp32 (weights and states are read as fp32);
  float64 fails in its output cast, so ``unsupported`` refuses it and the op takes the reference.
* Varlen: ``B == 1`` and ``cu_seqlens`` (int64) with no ``seq_idx``. Tokens after
  ``cu_seqlens[-1]`` are not computed at all (their outputs and input gradients are left
  uninitialised), so a padding tail must be a sequence of its own. Empty sequences are
  handled, but ssm-pack never passes them.
* States are ``[N, D, W]``: the last W inputs of each sequence, oldest first. The output reads
  only the last W-1 slots; slot 0 holds the input that has just left the window. ssm-pack's
  state ``[N, D, W-1]`` is slots ``1..W-1``: a zero slot 0 is prepended to the initial state
  and dropped from the final state. A sequence shorter than W-1 reads its initial state for the
  missing inputs and its final state reaches into it, as in the reference. Final states are
  differentiable (their gradient reaches ``x`` and the initial state).
* No padding marker: outputs of tokens with a negative ``seq_idx`` are zeroed after the call
  (the reference zeroes them too, and no gradient reaches their inputs through them).

So ssm-pack cuts every row into its segments (one per non-empty document, per ``seq_idx`` run,
per padding tail, per row of a batch), hands them to fla as one varlen row whose boundaries end
at ``B * T``, gives every segment its initial state (the document's, or the row's for its first
segment, or zeros), and maps the per-segment final states back (``causal_conv1d_fn``).
"""

from __future__ import annotations

import torch

from ssm_pack.formats.segments import Segments
from ssm_pack.support import installed

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_upstream():
    """fla's function (imported only when a kernel call is really made, fla pinned to Triton)."""
    installed.pin_fla_triton()
    from fla.modules.causal_conv1d import causal_conv1d
    return causal_conv1d


def unsupported(x: torch.Tensor) -> str | None:
    """Why fla's conv cannot take ``x``, or ``None``."""
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (fla's Triton conv takes float32, float16, bfloat16)"
    return None


def fla_conv(x, weight, bias, segs: Segments, slots, activation, pad_mask, final: bool, layout=None):
    """Run fla over the segments of ``x [B, D, T]``.

    Args:
        slots: ``[S, D, W-1]`` initial state of every segment, or ``None`` (zeros).
        pad_mask: ``[B, T]`` bool, outputs to zero (negative ``seq_idx``), or ``None``.
        final: also return the segments' final states.
        layout: ``(cu, chunk_indices)`` of these segments, built once per forward
            (:attr:`ssm_pack.VarlenBatch.fla_conv_layout`), or ``None``: the boundaries are built
            here and fla builds its chunk indices (two host reads per call on a GPU).

    Returns ``(out [B, D, T]`` channel-last in ``x.dtype``, ``[S, D, W-1]`` final slots or ``None)``.
    """
    batch, dim, length = x.shape
    state_len = weight.shape[1] - 1
    if segs.count == 0:                                    # no token: nothing for the kernel to do
        out = x.new_zeros(batch, length, dim).transpose(1, 2)
        return out, (x.new_zeros(0, dim, state_len) if final else None)
    conv = load_upstream()
    tokens = x.transpose(1, 2).reshape(1, batch * length, dim)        # a view when B == 1
    cu, chunk_indices = layout if layout is not None else (
        torch.cat([segs.starts, segs.starts.new_tensor([batch * length])]).to(torch.int64), None)
    init = None
    if slots is not None:
        init = torch.cat([slots.new_zeros(slots.shape[0], dim, 1), slots], dim=2)
    out, states = conv(tokens, weight, bias, initial_state=init, output_final_state=final,
                       activation=activation, backend="triton", cu_seqlens=cu, chunk_indices=chunk_indices)
    out = out.reshape(batch, length, dim).transpose(1, 2)
    if pad_mask is not None:
        out = out.masked_fill(pad_mask.unsqueeze(1), 0.0)
    return out, (states[..., 1:] if final else None)
