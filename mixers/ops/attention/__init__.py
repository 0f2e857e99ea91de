"""``varlen_attention``: attention inside each packed document, ``flash_attn_varlen_func``-style.

    T = packed tokens, Hq = query heads, Hk = key/value heads (dividing Hq), D = head dim

``q [T, Hq, D]``, ``k, v [T, Hk, D]``, ``cu_seqlens`` ``[N+1]`` (tokens after ``cu_seqlens[-1]``
form one more segment) or the forward's prebuilt :class:`ssm_pack.VarlenBatch`, ``max_seqlen``
(the longest document, as flash-attn wants it; optional with a ``VarlenBatch``), ``causal``,
``window_size=(left, right)`` (-1 = unbounded; flash-attn's sliding window) and
``softmax_scale`` (default ``D ** -0.5``). Returns ``[T, Hq, D]``. The CUDA kernels, in order:
PyTorch's own ``varlen_attn`` (:mod:`.kernel_torch`), flash-attn's varlen function; the torch
backend (``backend="reference"``) is :func:`.reference.blockwise_attention` (the same blockwise core
as :func:`mixers.ops.segment_attention`). The specification, softmax attention of each document
alone, is :mod:`.naive`.
"""

from __future__ import annotations

from ..common.autocast import outside_autocast
from ..common.empty import empty_output, no_tokens
from ._validate import AttentionCall, checked_call
from .choice import choose
from .kernel import flash_varlen
from .kernel_torch import torch_varlen_attention
from .reference import varlen_attention_reference

__all__ = ["varlen_attention"]


def _choose(call: AttentionCall) -> str:
    """``"torch_varlen"`` (PyTorch's own kernel), else ``"flash_attn"``, else ``"reference"`` (:mod:`.choice`)."""
    return choose("varlen_attention", call.q, call.causal, call.window, call.scale, call.backend)


def _run(call: AttentionCall):
    """Context parallelism (:mod:`.cp`), else PyTorch's kernel, flash-attn's or the reference (one choice)."""
    if call.varlen.cp is not None:
        from .cp import varlen_attention_cp
        return varlen_attention_cp(call, varlen_attention)
    if no_tokens(call.q.shape[0]):       # (mixers.ops.common.empty)
        return empty_output(call.q, (0, call.q.shape[1], call.v.shape[2]))
    choice = _choose(call)
    if choice == "torch_varlen":
        return torch_varlen_attention(call)
    if choice == "flash_attn":
        return flash_varlen(call)
    return varlen_attention_reference(call)


@outside_autocast
def varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, window_size=None, softmax_scale=None,
                     backend="auto"):
    """Attention restricted to each document (see the module docstring)."""
    return _run(checked_call(q, k, v, cu_seqlens, max_seqlen, causal=causal, window_size=window_size,
                             softmax_scale=softmax_scale, backend=backend))
