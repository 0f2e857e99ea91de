"""``varlen_attention``: attention inside each packed document, ``flash_attn_varlen_func``-style.

    T = packed tokens, Hq = query heads, Hk = key/value heads (dividing Hq), D = head dim

``q [T, Hq, D]``, ``k, v [T, Hk, D]``, ``cu_seqlens`` ``[N+1]`` (tokens after ``cu_seqlens[-1]``
form one more segment) or the forward's prebuilt :class:`ssm_pack.VarlenBatch`, ``max_seqlen``
(the longest document, as flash-attn wants it; optional with a ``VarlenBatch``), ``causal``,
``window_size=(left, right)`` (-1 = unbounded; flash-attn's sliding window) and
``softmax_scale`` (default ``D ** -0.5``). Returns ``[T, Hq, D]``. The CUDA kernels, in order:
PyTorch's own ``varlen_attn`` (:mod:`.torch_varlen`), flash-attn's varlen function; the torch
backend (``backend="reference"``) is :func:`.segment.blockwise_attention` (the same blockwise core
as :func:`mixers.ops.segment_attention`). The specification, softmax attention of each document
alone, is :mod:`.naive`.
"""

from __future__ import annotations

from ssm_pack.checks import check_int, check_tensor
from ssm_pack.formats.boundaries import max_seqlen_from_cu_seqlens

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.checks import varlen_of
from ..common.chunks import compute_dtype
from .kernel import flash_varlen, unsupported
from .segment import blockwise_attention
from .torch_varlen import torch_varlen_attention
from .torch_varlen import unsupported as torch_varlen_unsupported

__all__ = ["varlen_attention"]


def _check(q, k, v, window_size):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
    total, hq, d = q.shape
    if k.shape[0] != total or v.shape[:2] != k.shape[:2] or k.shape[2] != d:
        raise ValueError(f"k and v must be [T, Hk, D] matching q [T, Hq, D] = {list(q.shape)}, got "
                         f"{list(k.shape)} and {list(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hk={k.shape[1]}")
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and w >= -1 for w in window_size)):
            raise ValueError(f"window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")


def _check_max_seqlen(max_seqlen, varlen) -> int:
    """The ``max_seqlen`` the call runs with (padding tail included).

    flash-attn sizes its work by ``max_seqlen``: a value smaller than the longest document would
    silently truncate it, so it is checked against the boundaries (which hold the truth).
    """
    if max_seqlen is None:
        return varlen.max_seqlen
    max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
    if not varlen.validated or max_seqlen >= varlen.max_seqlen:
        return max_seqlen
    longest_document = max_seqlen_from_cu_seqlens(varlen.cu_seqlens)     # the tail is ours, not the user's
    if max_seqlen < longest_document:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest document of cu_seqlens "
                         f"({longest_document} tokens), which flash-attn would truncate; pass "
                         f"max_seqlen >= {longest_document} or None")
    return varlen.max_seqlen


def _choose(q, causal, window, scale, backend) -> str:
    """``"torch_varlen"`` (PyTorch's own kernel), else ``"flash_attn"``, else ``"reference"``."""
    if backend == "kernel" and unsupported(q) is not None:      # no attention kernel takes it, on any device
        raise ValueError(f"varlen_attention: the upstream kernels cannot do {unsupported(q)}; use "
                         "backend='reference' (or 'auto', which picks it)")
    candidates = (
        ("torch_varlen", "PyTorch's varlen_attn", torch_varlen_unsupported(q, causal, window, scale),
         lambda: dispatch.cached_support("torch_varlen")),
        ("flash_attn", "flash-attn", unsupported(q), lambda: dispatch.cached_support("flash_attn", ("varlen",))),
    )
    return dispatch.choose_kernel("varlen_attention", backend, on_cuda=dispatch.is_cuda(q), candidates=candidates)


@outside_autocast
def varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, window_size=None, softmax_scale=None,
                     backend="auto"):
    """Attention restricted to each document (see the module docstring)."""
    _check(q, k, v, window_size)
    varlen = varlen_of(cu_seqlens, 1, q.shape[0], q.device)
    longest = _check_max_seqlen(max_seqlen, varlen)
    window = (-1, -1) if window_size is None else tuple(window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if varlen.cp is not None:                                 # context parallelism: cp.py
        from .cp import varlen_attention_cp
        return varlen_attention_cp(q, k, v, varlen, causal, window, scale, backend, varlen_attention)
    choice = _choose(q, causal, window, scale, backend)
    if choice == "torch_varlen":
        return torch_varlen_attention(q, k, v, varlen.covering_cu_seqlens, longest, causal, window, scale)
    if choice == "flash_attn":
        return flash_varlen(q, k, v, varlen.covering_cu_seqlens, longest, causal, window, scale)
    compute = compute_dtype(q.dtype)
    out = blockwise_attention(q.to(compute), k.to(compute), v.to(compute), varlen.seq_idx[0], longest,
                              causal=causal, window=window, scale=scale)
    return out.to(q.dtype)
