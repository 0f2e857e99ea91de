"""The context-parallel cost model: bytes, work and activation memory per rank, in plain arithmetic.

    P = ranks, T = tokens of the physical row, r = a rank, [b_r, b_{r+1}) its shard, J = conv width - 1,
    S / M = elements of a layer's recurrent state / of its transition map, kv = elements of one
    key + value row, b = bytes per element, p = a token's position in its document

For one layer of one packed row, one training step (forward + backward), per rank:

* bytes sent, ours (state passing, ``mixers.ops.common.cp_exchange``): per layer kind, what the
  layout's plan sends, worked out here from the boundaries and the bounds alone (no torch): a conv
  sends its last ``J`` inputs (``J * channels``) across each rank boundary a document crosses (a
  recursive-doubling round where a shard is shorter than ``J``); a scan sends its state ``S`` per
  crossed boundary, plus ``ceil(log2 k)`` doubling rounds of ``S`` (``S + M`` while the sender's
  map still depends on what enters it) for a document crossing ``k`` boundaries; attention sends
  every earlier key and value of a continuing document (``kv`` per key, within the window). The
  backward sends the same bytes back (receiver to sender).
* bytes sent, all-to-all (Megatron-core's CP for Mamba, Ulysses for the others): the layer's
  inputs go sequence -> head sharded and its output back, each all-to-all keeping ``1/P`` of a
  rank's ``T/P`` rows and sending the rest, forward and backward (4 all-to-alls per layer, 2 of
  width ``W_in`` and 2 of ``W_out``): ``2 * (P-1)/P * T/P * (W_in + W_out) * b``. It needs the
  heads divisible by P, so it stops at ``P = heads`` (KV heads for attention).
* work (multiply-adds), forward + backward = ``3 *`` forward (a product's backward is two of its
  size), in three parts (``work_parts``):
  ``projections = proj * tokens``, ``proj`` the multiply-adds of every ``nn.Linear`` per token
  (``hidden * (W_in + W_out)`` where the projections are exactly the a2a widths; the geometry's
  ``proj`` otherwise), every token of the shard: exact, equal to the matmuls a real run dispatches
  (``benchmarks.op_counts``, checked per rank on gloo runs);
  ``attention = 2 * Hq * D * pairs``, ``pairs`` the query-key pairs of the causal mask a rank's
  queries see (exact for the mask: ``sum min(p + 1, window)`` over its real tokens; the reference
  kernel multiplies whole blocks, masked pairs included, so it dispatches more);
  ``scan = 2 * S * tokens`` (the state update and readout token by token): an estimate, the
  chunked backends dispatch more (intra-chunk products; the gap is measured by
  ``bench_cost_model``).
* activation memory: ``tokens * (hidden + W_in + W_out) * b`` kept for backward (an estimate of the
  layer's inputs and outputs, ``1/P`` of one process), plus, for ours, the keys and values received.
"""

from __future__ import annotations

import bisect
import math


def cover_of(boundaries, total: int) -> list[int]:
    """Physical document boundaries ``[0, ..., c_N]`` followed by T (segment N: the padding tail)."""
    boundaries = [int(c) for c in boundaries]
    if not boundaries or boundaries[0] != 0 or any(b < a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be non-decreasing offsets starting at 0, got {boundaries[:8]}")
    if total < boundaries[-1]:
        raise ValueError(f"total={total} is smaller than the last boundary {boundaries[-1]}; pass the row length")
    return boundaries + [int(total)]


def even_bounds(total: int, ranks: int) -> list[int]:
    """Equal-token shards, as ``shard_for_context_parallel`` cuts them by default."""
    return [r * total // ranks for r in range(ranks + 1)]


def rank_facts(cover: list[int], bounds) -> list[dict]:
    """Per rank: ``continues_in`` / ``continues_out`` (its first / last segment started before /
    goes on after it), ``last_len``, ``last_starts_here`` and ``first_seg_start``."""
    facts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first = bisect.bisect_right(cover, start) - 1
        last = bisect.bisect_right(cover, end - 1) - 1
        last_start = max(cover[last], start)
        cont_in = cover[first] < start
        facts.append(dict(continues_in=cont_in, continues_out=cover[last + 1] > end, last_len=end - last_start,
                          last_starts_here=last_start > start or not cont_in, first_seg_start=cover[first]))
    return facts


def chain(facts: list[dict], closed: list[bool]) -> tuple[list, list]:
    """The recursive-doubling plan: ``(rounds of (sender, receiver, with_m), shift pairs)``."""
    size = len(facts)
    done = [closed[j] or j == 0 or not facts[j]["continues_out"] for j in range(size)]
    rounds, d = [], 1
    while not all(done):
        rounds.append([(j - d, j, not done[j - d]) for j in range(size) if not done[j]])
        done = [done[j] or done[j - d] for j in range(size)]
        d *= 2
    return rounds, [(j - 1, j) for j in range(1, size) if facts[j]["continues_in"]]


def _chain_bytes(facts, closed, s: int, m: int, b: int) -> list[list[int]]:
    sent = [[0, 0] for _ in facts]                       # per rank: [forward, backward]
    rounds, shift = chain(facts, closed)
    for i, j, with_m in [p for rnd in rounds for p in rnd] + [(i, j, False) for i, j in shift]:
        n = (s + (m if with_m else 0)) * b
        sent[i][0] += n
        sent[j][1] += n
    return sent


def key_ranges(facts: list[dict], bounds, left: int) -> dict:
    """``{(sender, receiver): (lo, hi)}``: keys the receiver's first segment needs (``left < 0``: no window)."""
    plan = {}
    for j, f in enumerate(facts):
        if not f["continues_in"]:
            continue
        lo = f["first_seg_start"] if left < 0 else max(f["first_seg_start"], bounds[j] - left)
        for s in range(bisect.bisect_right(bounds[1:], lo), j):
            a, hi = max(bounds[s], lo), min(bounds[s + 1], bounds[j])
            if hi > a:
                plan[(s, j)] = (a, hi)
    return plan


def ours_bytes(cover: list[int], bounds, geo: dict, act_bytes: int, state_bytes: int) -> list[dict]:
    """Per rank ``{"conv", "state", "kv": (forward, backward)}``: bytes state passing sends for one
    layer of geometry ``geo`` (``benchmarks.bench_context_parallel.geometry``)."""
    facts = rank_facts(cover, bounds)
    size = len(facts)
    parts = {"conv": [[0, 0] for _ in range(size)], "state": [[0, 0] for _ in range(size)],
             "kv": [[0, 0] for _ in range(size)]}
    j = geo["width"] - 1
    for channels in geo["convs"]:
        closed = [f["last_starts_here"] or f["last_len"] >= j for f in facts]
        for r, (fw, bw) in enumerate(_chain_bytes(facts, closed, channels * j, j * j, act_bytes)):
            parts["conv"][r][0] += fw
            parts["conv"][r][1] += bw
    if "state" in geo:
        parts["state"] = _chain_bytes(facts, [f["last_starts_here"] for f in facts], geo["state"], geo["m"],
                                      state_bytes)
    if "kv" in geo:
        for (i, r), (a, hi) in key_ranges(facts, bounds, geo["left"]).items():
            parts["kv"][i][0] += (hi - a) * geo["kv"] * act_bytes
            parts["kv"][r][1] += (hi - a) * geo["kv"] * act_bytes
    return [{k: tuple(v[r]) for k, v in parts.items()} for r in range(size)]


def ours_total(cover, bounds, geo, act_bytes: int, state_bytes: int) -> list[int]:
    """Per rank: forward + backward bytes of every part."""
    return [sum(f + b for f, b in rank.values()) for rank in ours_bytes(cover, bounds, geo, act_bytes, state_bytes)]


def a2a_bytes(geo: dict, tokens: int, ranks: int, b: int) -> float:
    """The all-to-all design's bytes per rank for one layer, forward + backward."""
    return 2 * (ranks - 1) / ranks * (tokens / ranks) * (geo["w_in"] + geo["w_out"]) * b


def a2a_fits(geo: dict, ranks: int) -> bool:
    """Whether head sharding works at P ranks: the (KV) heads divisible by P."""
    return geo["heads"] % ranks == 0


def _pairs_prefix(n: int, window: int | None) -> int:
    """Query-key pairs of the first ``n`` queries of a document: ``sum_{p < n} min(p + 1, window)``."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def attention_pairs(boundaries, lengths, bounds, window: int | None = None) -> list[int]:
    """Per rank: causal query-key pairs of its real tokens (document i's ``lengths[i]`` real tokens
    open its physical slot ``[boundaries[i], boundaries[i + 1])``; a query sees ``window`` keys at most)."""
    pairs = [0] * (len(bounds) - 1)
    for start, n in zip(boundaries[:-1], lengths):
        for r in range(len(pairs)):
            a, hi = max(start, bounds[r]), min(start + n, bounds[r + 1])
            if hi > a:
                pairs[r] += _pairs_prefix(hi - start, window) - _pairs_prefix(a - start, window)
    return pairs


def projection_macs(geo: dict, hidden: int) -> int:
    """Multiply-adds per token of the layer's projections (every ``nn.Linear``), forward: the
    geometry's ``proj`` where it has one (``bench_context_parallel.geometry``), else
    ``hidden * (W_in + W_out)``. Exact: equal to what ``benchmarks.op_counts`` counts."""
    return geo["proj"] if "proj" in geo else hidden * (geo["w_in"] + geo["w_out"])


def scan_macs(geo: dict) -> int:
    """Multiply-adds per token of the recurrence, forward: ``2 S`` (the state update and its
    readout, token by token). An estimate: the chunked backends do more (intra-chunk products)."""
    return 2 * geo.get("state", 0)


def linear_macs(geo: dict, hidden: int) -> int:
    """Multiply-adds per token of one layer's forward outside attention's pairs (projections + scan)."""
    return projection_macs(geo, hidden) + scan_macs(geo)


def attention_macs(geo: dict) -> int:
    """Multiply-adds per query-key pair (``q . k`` and the weighted ``v`` over all query heads)."""
    return 2 * geo["w_out"] if "kv" in geo else 0


WORK_PARTS = ("projections", "attention", "scan")
EXACT_PARTS = ("projections",)          # equal to the matmuls a real run dispatches (tests/benchmarks)


def work_parts(geo: dict, hidden: int, boundaries, lengths, bounds, window: int | None = None) -> list[dict]:
    """Per rank ``{"projections", "attention", "scan"}``: multiply-adds of one forward + backward
    (3 forwards: a product's backward is two products of its size, the input and the weight
    gradient) of one layer. ``projections``: every token of the shard, padding included;
    ``attention``: the query-key pairs of the causal mask (``attention_pairs``), not what a
    blocked kernel multiplies; ``scan``: ``2 S`` per token, an estimate."""
    pairs = attention_pairs(boundaries, lengths, bounds, window) if "kv" in geo else [0] * (len(bounds) - 1)
    proj, att, scan = projection_macs(geo, hidden), attention_macs(geo), scan_macs(geo)
    return [{"projections": 3 * proj * (hi - a), "attention": 3 * att * n, "scan": 3 * scan * (hi - a)}
            for a, hi, n in zip(bounds[:-1], bounds[1:], pairs)]


def work(geo: dict, hidden: int, boundaries, lengths, bounds, window: int | None = None) -> list[int]:
    """Per rank: multiply-adds of one forward + backward (3 forwards) of one layer, all parts."""
    return [sum(parts.values()) for parts in work_parts(geo, hidden, boundaries, lengths, bounds, window)]


def activation_bytes(geo: dict, hidden: int, bounds, b: int, received_keys=None) -> list[int]:
    """Per rank: bytes of one layer's activations kept for backward; ``received_keys``: per rank,
    keys received from earlier ranks (ours, attention) kept too."""
    received = received_keys or [0] * (len(bounds) - 1)
    return [(hi - a) * (hidden + geo["w_in"] + geo["w_out"]) * b + k * geo.get("kv", 0) * b
            for a, hi, k in zip(bounds[:-1], bounds[1:], received)]


def received_keys(cover, bounds, left: int) -> list[int]:
    """Per rank: keys (rows) its first segment receives from earlier ranks."""
    got = [0] * (len(bounds) - 1)
    for (_, r), (a, hi) in key_ranges(rank_facts(cover, bounds), bounds, left).items():
        got[r] += hi - a
    return got


def ceil_log2(k: int) -> int:
    return 0 if k <= 1 else math.ceil(math.log2(k))


__all__ = ["a2a_bytes", "a2a_fits", "activation_bytes", "attention_pairs", "ceil_log2", "chain", "cover_of",
           "even_bounds", "key_ranges", "linear_macs", "ours_bytes", "ours_total", "projection_macs", "rank_facts",
           "received_keys", "scan_macs", "work", "work_parts"]
