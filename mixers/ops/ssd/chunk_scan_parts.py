"""The pieces the SSD chunk scan's forward (:mod:`.chunk_scan`) and backward
(:mod:`.chunk_scan_backward`) share: the block layout and the masked decay weights.

Notation and shapes as in :mod:`.chunk_scan`.
"""

from __future__ import annotations

import torch

_BLOCK_ELEMENTS = 1 << 20  # ~4 MB of fp32 per L x L buffer: stays in cache between steps


def exp_floor(dtype: torch.dtype) -> float:
    """Lowest exponent kept: ``exp`` below it is slow on CPUs (denormals) and the value < 1e-26."""
    return -60.0 if dtype in (torch.float32, torch.float16, torch.bfloat16) else -600.0


def _blocks(rows: int, chunks: int, per_chunk: int) -> list[tuple[int, int, int, int]]:
    """Blocks of about ``_BLOCK_ELEMENTS // per_chunk`` chunks as ``(r0, r1, c0, c1)``: rows
    ``r0 .. r1 - 1``, chunks ``c0 .. c1 - 1`` of each. A block is either whole rows or part of one
    row, so its chunks are the flat range ``r0 * C + c0 .. (r1 - 1) * C + c1`` and a state
    carried over its chunks is ``[r1 - r0, ...]``."""
    step = max(1, _BLOCK_ELEMENTS // max(per_chunk, 1))
    if not chunks:
        return []
    if chunks <= step:
        per = step // chunks
        return [(r0, min(r0 + per, rows), 0, chunks) for r0 in range(0, rows, per)]
    return [(r, r + 1, c0, min(c0 + step, chunks)) for r in range(rows) for c0 in range(0, chunks, step)]


def _span(block: tuple[int, int, int, int], chunks: int) -> tuple[int, int]:
    """The flat chunk range ``(q0, q1)`` of a block of :func:`_blocks`."""
    r0, r1, c0, c1 = block
    return r0 * chunks + c0, (r1 - 1) * chunks + c1


def _largest(blocks: list[tuple[int, int, int, int]]) -> int:
    """Chunks in the largest block of :func:`_blocks` (0 if none): the size of the block buffers."""
    return max([(r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks] + [0])


def _pass_factors(a: torch.Tensor, keep_state: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B * C, H]`` factor of the state passing, ``exp(a[L-1])`` where the entering state's
    segment reaches the chunk's end, else 0 (``a [B, T, H]``, ``keep_state [B, C]`` bool)."""
    b, t, h = a.shape
    last = a.reshape(b, t // chunk, chunk, h)[:, :, -1]
    return (torch.exp(last) * keep_state.unsqueeze(-1)).reshape(-1, h)


def _floats(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's ``[K, L, L]`` bool mask as ``[K, 1, L, L]`` floats (converted per block: the whole
    sequence's would be ``L`` floats per token, a fresh allocation every step)."""
    return keep.to(dtype).unsqueeze(1)


def _group_major(t: torch.Tensor) -> torch.Tensor:
    """``[K, L, G, X]`` -> ``[K, G, L, X]`` contiguous."""
    return t.transpose(1, 2).contiguous()


def _heads_to_cols(t: torch.Tensor, g: int) -> torch.Tensor:
    """``[K, L, H, P]`` -> ``[K, G, L, R*P]`` (the heads of a group side by side)."""
    k, L, h, p = t.shape
    return t.reshape(k, L, g, (h // g) * p).transpose(1, 2).contiguous()


def _cols_to_heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """``[K, G, L, R*P]`` -> ``[K, L, H, P]``."""
    k, g, L, rp = t.shape
    return t.transpose(1, 2).reshape(k, L, h, rp * g // h)


def _state_rows(s: torch.Tensor, g: int) -> torch.Tensor:
    """``[K, H, P, Ns]`` -> ``[K, G, R*P, Ns]`` (a view: a group's heads are adjacent). The
    products take it, or its transpose, as it is: no state-sized copy per block."""
    k, h, p, ns = s.shape
    return s.view(k, g, (h // g) * p, ns)


def _decay(a_hm: torch.Tensor, keepf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``[K, H, L, L]`` ``exp(a[l] - a[s])`` on kept pairs, exactly 0 elsewhere.

    Masked exponents are zeroed before ``exp`` and the results after (so no ``-inf`` reaches
    ``exp``'s slow path); exponents below :func:`exp_floor` are raised to it (an absolute change
    under 1e-26 of an already negligible decay).
    """
    torch.sub(a_hm.unsqueeze(-1), a_hm.unsqueeze(-2), out=out)
    out.mul_(keepf).clamp_(min=exp_floor(out.dtype)).exp_()
    return out.mul_(keepf)


def state_weights(a, last):
    """``[K, L, H]`` ``exp(a[L-1] - a[s])`` for the tokens of each chunk's last segment, else 0."""
    return torch.exp((a[:, -1:] - a).mul_(last).clamp_(min=exp_floor(a.dtype))).mul_(last)


def read_weights(a, reads):
    """``[K, L, H]`` ``exp(a[l])`` for the tokens that read the entering state, else 0."""
    return torch.exp((a * reads).clamp_(min=exp_floor(a.dtype))).mul_(reads)
