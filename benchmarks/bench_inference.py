"""Inference with per-slot caches: is decoding constant-time, how much does the cache save, and what
does packing the prefill give?

    python -m benchmarks.bench_inference           # the target sizes (~1-2 minutes on 2 cores)
    python -m benchmarks.bench_inference --quick   # smaller prefixes

1. Decode cost per token at a prefix of 4096 vs 64 tokens, for Mamba2, GDN, KDA and Gated
   DeltaProduct (target <= 1.3x: their state does not grow); attention for comparison (its KV
   cache does).
2. A cached decode step vs recomputing the whole sequence for the new token (``HybridLM("MGKPA")``,
   prefix 1024; target >= 20x); the decode side times 8 steps per call, as a generation loop runs
   them (decode steps above also run 48 per call).
3. Packed prefill of 16 prompts of mixed lengths (8-256 tokens) into 16 slots vs prefilling them
   one call each (``HybridLM("MGKPA")``, hidden 128; target >= 2x); at hidden 256 and 16-512
   tokens for comparison, where the projections' FLOPs (the same either way) dominate a CPU.

The compared functions alternate, round after round; each figure is the fastest of its rounds,
with the spread of the per-round ratios, graded only when stable (:mod:`benchmarks.common`).
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import Result, alternate, ratio_result, results_table, settle
from mixers import HybridLM
from mixers.layers.registry import MIXERS
from ssm_pack import PackedSeqParams

TARGETS = {"decode": 1.3, "recompute": 20.0, "prefill": 2.0}


def decode_rows(hidden: int, long: int, short: int, rows: int, steps: int, rounds: int):
    """Per mixer: ``steps`` decode steps of ``rows`` sequences at prefix ``long`` vs ``short``."""
    out = []
    for letter in "MGKPA":
        torch.manual_seed(0)
        layer = MIXERS[letter].mixer(hidden).eval()
        caches = {}
        with torch.no_grad():
            for name, prefix in (("long", long), ("short", short)):
                cache = layer.allocate_inference_cache(rows, prefix + steps * (rounds + 2))
                x = torch.randn(1, rows * prefix, hidden)
                layer(x, PackedSeqParams.from_lengths([prefix] * rows), cache=cache, cache_slots=list(range(rows)))
                caches[name] = cache
        token = torch.randn(rows, 1, hidden)
        slots = list(range(rows))

        def decode(name):
            with torch.no_grad():
                for _ in range(steps):
                    layer(token, cache=caches[name], cache_slots=slots)
        times = alternate({"long": lambda: decode("long"), "short": lambda: decode("short")}, rounds)
        times = times.scaled({"long": 1 / steps, "short": 1 / steps})
        target = None if letter == "A" else TARGETS["decode"]
        note = "(informational: attention's KV cache grows)" if letter == "A" else ""
        measure = f"{type(layer).__name__}: decode step ({rows} rows), prefix {long} vs {short}"
        out.append(ratio_result("inference", measure, times, "long", "short", target, False, note=note))
    return out


def small_model(hidden: int) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(256, hidden, "MGKPA").eval()


def recompute_row(hidden: int, prefix: int, rounds: int, steps: int = 8):
    """One new token: a cached decode step vs a forward over the whole sequence. The cached side
    runs ``steps`` decode steps per timed call (per step: the call's time / ``steps``), as a
    generation loop runs them back to back; one step alone, timed after the recompute and the
    collector's pass over the heap, found its weights and code evicted and cost ~1.6x as much."""
    model = small_model(hidden)
    ids = torch.randint(0, 256, (1, prefix + 1))
    cache = model.allocate_inference_cache(1, prefix + steps * (rounds + 2))
    with torch.no_grad():
        model(ids[:, :prefix], PackedSeqParams.from_lengths([prefix]), cache=cache, cache_slots=[0])

    def cached():
        with torch.no_grad():
            for _ in range(steps):
                model(ids[:, prefix:], cache=cache, cache_slots=[0])

    def recompute():
        with torch.no_grad():
            model(ids)
    times = alternate({"cached": cached, "recompute": recompute}, rounds).scaled({"cached": 1 / steps})
    return ratio_result("inference", f"cached decode vs full recompute, prefix {prefix} (MGKPA, hidden {hidden})",
                        times, "cached", "recompute", TARGETS["recompute"], True)


def prefill_row(hidden: int, prompts: int, shortest: int, longest: int, rounds: int, target=TARGETS["prefill"]):
    """``prompts`` prompts (log-uniform lengths): one packed call vs one call per prompt."""
    model = small_model(hidden)
    g = torch.Generator().manual_seed(0)
    lengths = [int(math.exp(torch.empty(1).uniform_(math.log(shortest), math.log(longest), generator=g)))
               for _ in range(prompts)]
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=g)
    params = PackedSeqParams.from_lengths(lengths)
    cache = model.allocate_inference_cache(prompts, longest)
    starts = params.cu_seqlens_q.tolist()

    def packed():
        cache.reset()
        with torch.no_grad():
            model(ids, params, cache=cache, cache_slots=list(range(prompts)))

    def one_at_a_time():
        cache.reset()
        with torch.no_grad():
            for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
                model(ids[:, a:b], cache=cache, cache_slots=[i])
    times = alternate({"packed": packed, "loop": one_at_a_time}, rounds)
    note = "" if target is not None else "(informational: the projections' FLOPs dominate both)"
    return ratio_result("inference", f"packed prefill of {prompts} prompts ({min(lengths)}-{max(lengths)} tokens, "
                        f"{sum(lengths)} in all; hidden {hidden}) vs one call each", times, "packed", "loop", target,
                        True, note=note)


def run(quick: bool = False, rounds: int = 7, log=None) -> list[Result]:
    hidden = 256
    long = 1024 if quick else 4096
    rows = settle(lambda: decode_rows(hidden, long, 64, rows=4, steps=48, rounds=rounds + 2), log=log)
    rows += settle(lambda: [recompute_row(hidden, 1024, rounds)], log=log)
    rows += settle(lambda: [prefill_row(128, 16, 8, 256, rounds), prefill_row(256, 16, 16, 512, rounds, target=None)],
                   log=log)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_inference", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode at prefix 1024 instead of 4096")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(results_table(run(args.quick, args.rounds, log=print)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
