"""The specification of ``causal_conv1d_fn``: a direct causal convolution, one document at a time.

    B = rows, D = channels, T = tokens, W = width, J = W - 1, N = documents

Written to be read, not to be fast: every document is convolved alone, from its own initial
state (or zeros), so nothing can reach it from its neighbours. The torch backend
(:mod:`.reference`) and the kernels must agree with it; the tests hold them to it in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.naive_documents import document_spans


def causal_conv1d_naive(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None,
                        *, cu_seqlens=None):
    """Causal depthwise conv1d with a reset at every document.

    Args:
        x: ``[B, D, T]``; weight: ``[D, W]``; bias: ``[D]`` or ``None``.
        initial_states: ``[N, D, J]`` per document with ``cu_seqlens`` (``B == 1``), else
            ``[B, D, J]`` per row: the J inputs seen before the document's first token.
        return_final_states: also return the last J inputs of every document (reaching into its
            initial state when it is shorter), ``[N, D, J]`` or ``[B, D, J]``.
        activation: ``None``, ``"silu"`` or ``"swish"``.
        cu_seqlens: ``[N+1]`` document boundaries of the single row; ``None``: each row is one document.

    Returns:
        ``out [B, D, T]``, or ``(out, final_states)``.
    """
    rows, dim, total = x.shape
    width = weight.shape[1]
    out = torch.zeros_like(x)
    finals = {}
    for row, start, end, doc in document_spans(cu_seqlens, rows, total):
        # 1. the document's history: its initial state, or zeros (a padding tail starts from zeros)
        if initial_states is not None and doc is not None:
            history = initial_states[doc]
        else:
            history = x.new_zeros(dim, width - 1)
        # 2. its inputs behind that history: padded[:, J + t] is token start + t
        padded = torch.cat([history, x[row, :, start:end]], dim=-1)
        # 3. out[t] = bias + sum_w weight[:, w] * padded[:, t + w]: the window ends at token t itself
        for t in range(end - start):
            y = (weight * padded[:, t:t + width]).sum(-1)
            if bias is not None:
                y = y + bias
            # 4. the activation, per token
            if activation in ("silu", "swish"):
                y = F.silu(y)
            out[row, :, start + t] = y
        # 5. the final state: the last J entries of the padded document
        if doc is not None:
            finals[doc] = padded[:, padded.shape[-1] - (width - 1):]
    if not return_final_states:
        return out
    count = rows if cu_seqlens is None else len(cu_seqlens) - 1
    final = torch.stack([finals[i] for i in range(count)]) if count else x.new_zeros(0, dim, width - 1)
    return out, final
