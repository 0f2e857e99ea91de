"""``varlen_attention``: attention inside each packed document, ``flash_attn_varlen_func``-style.

    T = packed tokens, Hq = query heads, Hk = key/value heads (dividing Hq), D = head dim

``q [T, Hq, D]``, ``k, v [T, Hk, D]``, ``cu_seqlens`` ``[N+1]`` (tokens after ``cu_seqlens[-1]``
form one more segment), ``max_seqlen`` (the longest document, as flash-attn wants it),
``causal``, ``window_size=(left, right)`` (-1 = unbounded; flash-attn's sliding window) and
``softmax_scale`` (default ``D ** -0.5``). Returns ``[T, Hq, D]``. The CUDA kernel is
flash-attn's varlen function; the reference is SDPA over blocks of queries.
"""

from __future__ import annotations

from ssm_pack._checks import check_int, check_tensor

from .. import _dispatch
from .._checks import check_cu_seqlens
from .._chunks import compute_dtype
from .._segments import segments_from_cu_seqlens
from .kernel import flash_varlen, unsupported
from .reference import varlen_attention_reference

__all__ = ["varlen_attention"]


def _check(q, k, v, cu_seqlens, max_seqlen, window_size):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
    total, hq, d = q.shape
    if k.shape[0] != total or v.shape[:2] != k.shape[:2] or k.shape[2] != d:
        raise ValueError(f"k and v must be [T, Hk, D] matching q [T, Hq, D] = {list(q.shape)}, got "
                         f"{list(k.shape)} and {list(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hk={k.shape[1]}")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, integer=True)
    check_cu_seqlens(cu_seqlens, 1, total)
    check_int("max_seqlen", max_seqlen, minimum=0)
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and w >= -1 for w in window_size)):
            raise ValueError(f"window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, window_size=None, softmax_scale=None,
                     backend="auto"):
    """Attention restricted to each document (see the module docstring)."""
    _check(q, k, v, cu_seqlens, max_seqlen, window_size)
    window = (-1, -1) if window_size is None else tuple(window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    choice = _dispatch.select_backend("varlen_attention", backend, on_cuda=_dispatch.is_cuda(q),
                                      support_state=lambda: _dispatch.cached_support("flash_attn"),
                                      missing_feature=unsupported(q))
    if choice == "kernel":
        return flash_varlen(q, k, v, cu_seqlens, int(max_seqlen), causal, window, scale)
    total = q.shape[0]
    segs = segments_from_cu_seqlens(cu_seqlens, total)
    seg = segs.seg_id[0]
    starts = segs.starts[seg] if total else seg
    ends = segs.ends[seg] if total else seg
    compute = compute_dtype(q.dtype)
    out = varlen_attention_reference(q.to(compute), k.to(compute), v.to(compute), seg, starts, ends,
                                     causal=causal, window=window, scale=scale)
    return out.to(q.dtype)
