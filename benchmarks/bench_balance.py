"""Work per context-parallel rank: equal-token shards against cost-balanced contiguous shards.

    python -m benchmarks.bench_balance            # pure arithmetic on the cost model, seconds
    python -m benchmarks.bench_balance --rows 64  # more packed rows per corpus

Prints max over ranks / mean of the per-rank work (:func:`ssm_pack.parallel.balance.work_imbalance`;
1.0 = even, the step waits for the max) for

* one 1,048,576-token document at 8 ranks: causal attention only, and a hybrid of 4 linear-cost
  blocks to 1 attention block at hidden 1024 (:func:`~ssm_pack.parallel.balance.mixer_weights`
  ``("GGGGA", 1024)``: 12 * hidden^2 multiply-adds per token per block, 2 * hidden per key read);
* packed rows of 32,768 tokens filled in order (next fit, a document longer than a row cut to it)
  with the lengths (UTF-8 bytes) of the standard library's docstrings and function / class
  sources, the demo's corpus, at 2, 4 and 8 ranks.

Target: balanced <= 1.05. Nothing is timed: the figures follow from the cost model and the
lengths, the same on every machine.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import table
from ssm_pack import PackedSeqParams, balanced_bounds
from ssm_pack.parallel.balance import mixer_weights, token_costs, work_imbalance

ROW = 32_768
LONG = 1 << 20
TARGET = 1.05
HYBRID = ("GGGGA", 1024)


def mixes() -> dict[str, dict]:
    linear, attention = mixer_weights(*HYBRID)
    return {"attention": dict(linear=0.0, attention=1.0),
            f"hybrid {HYBRID[0]} h{HYBRID[1]}": dict(linear=linear, attention=attention)}


def even(total: int, world: int) -> list[int]:
    return [r * total // world for r in range(world + 1)]


def compare(params, world: int, weights: dict) -> tuple[float, float]:
    """``(equal tokens, balanced)`` max / mean of one row at ``world`` ranks."""
    costs = token_costs(params, **weights)
    return (work_imbalance(costs, even(costs.numel(), world)),
            work_imbalance(costs, balanced_bounds(params, world, **weights)))


def long_document_rows() -> list[list[object]]:
    rows = []
    for name, weights in mixes().items():
        before, after = compare([0, LONG], 8, weights)
        rows.append([f"one {LONG:,}-token document", name, 8, f"{before:.4f}", f"{after:.4f}",
                     "met" if after <= TARGET else "missed"])
    return rows


def packed_rows(lengths: list[int], limit: int) -> list[list[int]]:
    """Rows of ``ROW`` tokens filled in order (next fit); the last row keeps a padding tail."""
    rows, row, room = [], [], ROW
    for n in (min(n, ROW) for n in lengths if n):
        if n > room:
            rows.append(row)
            if len(rows) == limit:
                return rows
            row, room = [], ROW
        row.append(n)
        room -= n
    return rows + ([row] if row else [])


def corpus_lengths(limit: int) -> dict[str, list[int]]:
    from benchmarks.bench_stream import stdlib_corpora
    docstrings, functions = stdlib_corpora(limit)
    return {"stdlib docstrings": [len(d) for d in docstrings], "stdlib functions": [len(d) for d in functions]}


def corpus_table_rows(corpora: dict[str, list[int]], rows_per_corpus: int) -> list[list[object]]:
    out = []
    for corpus, lengths in corpora.items():
        packs = packed_rows(lengths, rows_per_corpus)
        params = [PackedSeqParams.from_lengths(p, total_tokens=ROW) for p in packs]
        for name, weights in mixes().items():
            for world in (2, 4, 8):
                pairs = [compare(p, world, weights) for p in params]
                before = [b for b, _ in pairs]
                after = [a for _, a in pairs]
                out.append([f"{corpus} ({len(packs)} rows)", name, world,
                            f"{sum(before) / len(before):.4f} (worst {max(before):.4f})",
                            f"{sum(after) / len(after):.4f} (worst {max(after):.4f})",
                            "met" if max(after) <= TARGET else "missed"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="packed rows per corpus")
    parser.add_argument("--documents", type=int, default=40_000, help="documents read per corpus")
    args = parser.parse_args()
    start = time.perf_counter()
    linear, attention = mixer_weights(*HYBRID)
    print(f"cost model: a token at position p of its document costs linear + attention * (p + 1); hybrid "
          f"{HYBRID[0]} at hidden {HYBRID[1]}: linear = {linear:,.0f}, attention = {attention:,.0f} per key read")
    headers = ["row", "work", "ranks", "equal tokens: max / mean", "balanced: max / mean", f"<= {TARGET}"]
    print("\none long document")
    print(table(headers, long_document_rows()))
    corpora = corpus_lengths(args.documents)
    for name, lengths in corpora.items():
        ordered = sorted(lengths)
        print(f"\n{name}: {len(lengths):,} documents, median {ordered[len(ordered) // 2]:,} tokens, "
              f"longest {ordered[-1]:,}")
    print(f"\npacked rows of {ROW:,} tokens (mean over rows, worst row)")
    print(table(headers, corpus_table_rows(corpora, args.rows)))
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
