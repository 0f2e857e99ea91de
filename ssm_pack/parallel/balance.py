"""Cost-balanced contiguous shards for context parallelism: equal work per rank, not equal tokens.

    P = ranks, T = tokens of the physical row, p = a token's position inside its document

Equal-token shards balance tokens, not work. The linear mixers (conv, SSD, delta rule) and every
projection cost the same per token, but causal attention costs a token at position ``p`` about
``p + 1`` key reads (``min(p + 1, window)`` with a sliding window), so with one long document the
last rank holds the most expensive tokens: at P ranks it does ``(2P - 1) / P`` times the mean
attention work (15/8 at P = 8) and every step waits for it.

* :func:`token_costs`: the work of one token in one layer mix, ``linear + attention * min(p + 1,
  window)``, for every token of a packed row (per-document padding and the tail: ``linear``);
* :func:`balanced_bounds`: ``P + 1`` contiguous shard offsets whose per-rank work is as equal as
  contiguous cuts allow, what ``shard_for_context_parallel(..., bounds=)`` takes;
* :func:`work_imbalance`: max over ranks / mean of the per-rank work of given bounds;
* :func:`mixer_weights`: rough ``(linear, attention)`` weights of a ``HybridLM`` pattern.

Why contiguous and not zigzag (each rank holding chunk r and chunk 2P - 1 - r, Megatron's
load balancing for attention CP): the state passing of :mod:`ssm_pack.parallel.layout` sends one
state per document crossing a rank boundary, one hop from a rank to the next, and every mixer is
exact under any contiguous bounds unchanged. Zigzag gives every rank several chunks of the row,
so a recurrent state would have to pass through all of them in order (rank 0, 1, ..., P - 1, then
back P - 1, ..., 0), a chain twice as long with a hop per chunk, and every op would need a
multi-chunk CP version. Moving the cuts keeps one chunk per rank and balances the work instead.
"""

from __future__ import annotations

import bisect
import math

import torch

from ..checks import check_int, describe
from .layout import whole_row


def _weight(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number (work per token), got {describe(value)}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (work per token), got {value}; pass 0 to leave "
                         "that part out")
    return float(value)


def _check_weights(linear, attention, window) -> tuple:
    linear, attention = _weight("linear", linear), _weight("attention", attention)
    if linear == 0 and attention == 0:
        raise ValueError("linear=0 and attention=0 give every token zero work; pass linear=1.0 for an even token "
                         "split or attention > 0 for causal attention")
    window = check_int("window", window, minimum=1, allow_none=True)
    return linear, attention, window


def _row(params, total_tokens) -> tuple:
    """``(physical boundaries, real lengths, T)`` (int64, CPU) of a whole row's params or cu_seqlens."""
    physical, real, _, total = whole_row(params, total_tokens)
    return physical, real[1:] - real[:-1], total


def _token_costs(physical, lengths, total, linear, attention, window) -> torch.Tensor:
    costs = torch.full((total,), linear, dtype=torch.float64)
    if attention == 0 or lengths.numel() == 0:
        return costs
    starts = torch.repeat_interleave(physical[:-1], lengths)                         # per real token
    pos = torch.arange(starts.numel()) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    reads = pos + 1 if window is None else (pos + 1).clamp(max=window)
    costs[starts + pos] += attention * reads.to(torch.float64)
    return costs


def token_costs(params, total_tokens: int | None = None, *, linear: float, attention: float,
                window: int | None = None) -> torch.Tensor:
    """The work of every token of a packed row in one layer mix: ``[T]`` float64 (CPU).

    A real token at position ``p`` of its document costs ``linear + attention * min(p + 1, window)``
    (``window=None``: unbounded): ``linear`` for what every token pays alike (projections, the
    SSM / linear-attention scans), ``attention`` per key a causal attention query reads. A query
    with flash-attn's ``window_size=(left, 0)`` reads ``left + 1`` keys: pass ``window=left + 1``.
    Per-document padding and the padding tail cost ``linear`` (they run through the layers; a
    kernel given the real lengths attends for the real tokens only).

    Args:
        params: the whole row's :class:`~ssm_pack.PackedSeqParams` (padded boundaries are the
            physical layout) or its ``cu_seqlens``.
        total_tokens: T (default ``params.total_tokens``, else the last boundary).
        linear, attention: work per token and per key read (numbers >= 0, not both 0).
        window: keys a query reads at most (an int >= 1) or ``None``.
    """
    linear, attention, window = _check_weights(linear, attention, window)
    physical, lengths, total = _row(params, total_tokens)
    return _token_costs(physical, lengths, total, linear, attention, window)


def _starts_from_right(prefix, cap, parts):
    """``lowest[k]``: the smallest cut index from which ``parts - k`` pieces, each of work <= ``cap``
    and at least one index long, cover the rest (``None``: no cover from 0)."""
    m = len(prefix) - 1
    lowest = [0] * (parts + 1)
    lowest[parts] = m
    for k in range(parts - 1, -1, -1):
        j = max(k, bisect.bisect_left(prefix, prefix[lowest[k + 1]] - cap))
        if j > lowest[k + 1] - 1:
            return None
        lowest[k] = j
    return lowest if lowest[0] == 0 else None


def _smallest_cap(prefix, parts) -> float:
    """The least max piece work over contiguous cuts into ``parts`` pieces (bisection on the cap)."""
    total = prefix[-1]
    lo, hi = total / parts, total
    if _starts_from_right(prefix, lo, parts) is not None:
        return lo
    while hi - lo > 1e-12 * max(hi, 1e-300):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if _starts_from_right(prefix, mid, parts) is not None else (mid, hi)
    return hi


def _cuts(prefix, parts) -> list[int]:
    """Cut indices 0 = j_0 < ... < j_parts = m: each as near its quantile ``k / parts`` of the
    work as the least achievable max piece allows."""
    m, total = len(prefix) - 1, prefix[-1]
    cap = _smallest_cap(prefix, parts)
    lowest = _starts_from_right(prefix, cap, parts)
    assert lowest is not None
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        j = bisect.bisect_left(prefix, target)                       # the quantile: nearest prefix sum
        if j > 0 and (j > m or target - prefix[j - 1] <= prefix[j] - target):
            j -= 1
        lo = max(lowest[k], cuts[-1] + 1)
        reach = prefix[cuts[-1]] + cap * (1 + 1e-9)          # slack for the rounding of the sums
        hi = min(bisect.bisect_right(prefix, reach) - 1, m - (parts - k))
        assert lo <= hi, (k, lo, hi)
        cuts.append(min(max(j, lo), hi))
    cuts.append(m)
    return cuts


def balanced_bounds(params, cp_size: int, *, total_tokens: int | None = None, linear: float = 1.0,
                    attention: float = 0.0, window: int | None = None, align: int = 1) -> list[int]:
    """The cost-balanced contiguous layout: ``cp_size + 1`` shard offsets ``0 ... T`` whose per-rank
    work (:func:`token_costs`) is as equal as contiguous cuts allow.

    Pass them to ``shard_for_context_parallel(params, rank, cp_size, bounds=...)``; every rank
    computes the same bounds from the same row. The cuts are the prefix-sum quantiles of the
    work, moved where needed so that the largest shard's work is the least any contiguous cuts
    reach (bisection on that maximum); every shard holds at least one token. Contiguous rather
    than zigzag: the state passing stays one hop per rank boundary and every mixer is exact
    unchanged (see :mod:`ssm_pack.parallel.balance`). The defaults (``linear=1.0``,
    ``attention=0.0``) balance tokens.

    Args:
        params: the whole row's :class:`~ssm_pack.PackedSeqParams` or its ``cu_seqlens``.
        cp_size: P, the number of ranks (T >= P).
        total_tokens, linear, attention, window: as :func:`token_costs`.
        align: every inner bound is a multiple of ``align`` (e.g. a scan's chunk size); T itself
            need not be. Needs ``ceil(T / align) >= cp_size``.

    Returns:
        ``[0, b_1, ..., T]`` (``cp_size + 1`` ints).
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    align = check_int("align", align, minimum=1)
    costs = token_costs(params, total_tokens, linear=linear, attention=attention, window=window)
    total = costs.numel()
    if total < cp_size:
        raise ValueError(f"the row has {total} tokens, fewer than cp_size={cp_size}: every rank needs at least one "
                         "token; use fewer ranks or a longer row")
    points = list(range(0, total, align)) + [total]
    if len(points) - 1 < cp_size:
        raise ValueError(f"align={align} leaves {len(points) - 1} aligned pieces of the {total}-token row for "
                         f"cp_size={cp_size} ranks; use align <= {total // cp_size} or fewer ranks")
    prefix = torch.cat([costs.new_zeros(1), torch.cumsum(costs, 0)])[points].tolist()
    if prefix[-1] == 0:      # no work at all (attention only, no real token): the even split of the points
        return [points[k * (len(points) - 1) // cp_size] for k in range(cp_size + 1)]
    return [points[j] for j in _cuts(prefix, cp_size)]


def work_imbalance(costs: torch.Tensor, bounds) -> float:
    """Max over ranks / mean of the per-rank work ``costs[bounds[r]:bounds[r + 1]].sum()`` (1.0: even)."""
    if not isinstance(costs, torch.Tensor) or costs.dim() != 1:
        raise TypeError(f"costs must be a 1-D tensor of per-token work (token_costs), got {describe(costs)}")
    bounds = [check_int(f"bounds[{i}]", b) for i, b in enumerate(bounds)]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != costs.numel() or any(
            b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"bounds must be non-decreasing offsets from 0 to len(costs)={costs.numel()}, got {bounds}")
    prefix = torch.cat([costs.new_zeros(1), torch.cumsum(costs.to(torch.float64), 0)])
    work = prefix[bounds[1:]] - prefix[bounds[:-1]]
    mean = float(work.mean())
    if mean <= 0:
        raise ValueError("costs sum to zero: no work to balance")
    return float(work.max()) / mean


def mixer_weights(pattern: str, hidden: int, *, attention_letters: str = "A") -> tuple[float, float]:
    """Rough ``(linear, attention)`` multiply-adds of one token through a ``HybridLM`` pattern.

    Every block costs about ``12 * hidden**2`` per token whatever its mixer (the mixer's in and out
    projections ~4, the SwiGLU MLP ~8; the scans' state work is small beside them at usual sizes);
    each attention block (a letter of ``attention_letters``) adds ``2 * hidden`` per key read
    (``q . k`` and the weighted ``v`` over all heads). Good enough to place the cuts; measure
    and pass your own numbers when the sizes are unusual.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string of mixer letters (e.g. 'MGKPA'), got {pattern!r}")
    hidden = check_int("hidden", hidden, minimum=1)
    blocks = sum(letter in attention_letters for letter in pattern)
    return 12.0 * len(pattern) * hidden ** 2, 2.0 * blocks * hidden


__all__ = ["balanced_bounds", "mixer_weights", "token_costs", "work_imbalance"]
