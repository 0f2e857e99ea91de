"""Argument checks of ``varlen_attention`` and ``attention_with_kvcache`` (shapes in their modules'
docstrings), and the checked calls their backends take (:class:`AttentionCall`, :class:`KVCacheCall`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssm_pack.checks import check_int, check_tensor, describe
from ssm_pack.formats.boundaries import max_seqlen_from_cu_seqlens
from ssm_pack.varlen import VarlenBatch

from ..common.checks import varlen_of


@dataclass(frozen=True)
class AttentionCall:
    """One checked call of ``varlen_attention``: ``max_seqlen`` is the one the call runs with (the
    padding tail included), ``window`` is ``window_size`` as a tuple, ``scale`` is resolved."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    varlen: VarlenBatch
    max_seqlen: int
    causal: bool
    window: tuple[int, int]
    scale: float
    backend: str


@dataclass(frozen=True)
class KVCacheCall:
    """One checked call of ``attention_with_kvcache``: ``cache_seqlens`` as int64 ``[N]``,
    ``window`` as a tuple, ``scale`` resolved."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cache_seqlens: torch.Tensor
    cache_batch_idx: torch.Tensor | None
    scale: float
    causal: bool
    window: tuple[int, int]
    backend: str


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


def checked_call(q, k, v, cu_seqlens, max_seqlen, *, causal, window_size, softmax_scale, backend) -> AttentionCall:
    """Every argument of ``varlen_attention`` checked, as one :class:`AttentionCall`."""
    _check(q, k, v, window_size)
    varlen = varlen_of(cu_seqlens, 1, q.shape[0], q.device)
    longest = _check_max_seqlen(max_seqlen, varlen)
    window = (-1, -1) if window_size is None else tuple(window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return AttentionCall(q, k, v, varlen, longest, causal, window, scale, backend)


def _check_kvcache(q, k_cache, v_cache, k, v, cache_batch_idx, window_size):
    check_tensor("q", q, ndim=4)
    check_tensor("k_cache", k_cache, ndim=4)
    rows, _, hq, d = q.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[3] != d or hq % max(k_cache.shape[2], 1):
        raise ValueError(f"k_cache and v_cache must be [S, L, Hk, D] with D={d} and Hk dividing Hq={hq}, got "
                         f"{describe(k_cache)} and {describe(v_cache)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or both be None")
    if k is not None:
        check_tensor("k", k, ndim=4)
        want = (rows, k.shape[1], k_cache.shape[2], d)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=4)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be [N, t_new, Hk, D] = {list(want)}, got {list(t.shape)}")
    if cache_batch_idx is None:
        if k_cache.shape[0] < rows:
            raise ValueError(f"the cache has {k_cache.shape[0]} slots for {rows} rows; pass cache_batch_idx")
    else:
        check_tensor("cache_batch_idx", cache_batch_idx, ndim=1, integer=True)
        if cache_batch_idx.shape[0] != rows:
            raise ValueError(f"cache_batch_idx must be [N] = [{rows}], got {describe(cache_batch_idx)}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")


def _seqlens(cache_seqlens, rows, device) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((rows,), cache_seqlens, dtype=torch.int64, device=device)
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, integer=True)
    if cache_seqlens.shape[0] != rows:
        raise ValueError(f"cache_seqlens must be an int or [N] = [{rows}], got {describe(cache_seqlens)}")
    return cache_seqlens.to(device=device, dtype=torch.int64)


def checked_kvcache(q, k_cache, v_cache, k, v, *, cache_seqlens, cache_batch_idx, softmax_scale, causal, window_size,
                    backend) -> KVCacheCall:
    """Every argument of ``attention_with_kvcache`` checked, as one :class:`KVCacheCall`."""
    window = (-1, -1) if window_size is None else window_size
    _check_kvcache(q, k_cache, v_cache, k, v, cache_batch_idx, window)
    lens = _seqlens(cache_seqlens, q.shape[0], q.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return KVCacheCall(q, k_cache, v_cache, k, v, lens, cache_batch_idx, scale, causal, tuple(window), backend)
