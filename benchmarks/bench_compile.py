"""Does ``torch.compile`` pay off on the reference path? A packed ``HybridLM`` training step,
eager vs compiled (inductor), side by side.

The packing metadata is built before the step (``VarlenBatch.build(...).materialize()``), so the
compiled graph has no break; the step is forward, loss and backward of a packed row. The
compiled function is warmed up (compiled) before timing, and both run in alternating rounds,
fastest of the rounds kept, with the spread of the per-round ratios.

    python -m benchmarks.bench_compile [--tokens 2048] [--hidden 128] [--pattern MGKPA] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import Result, alternate, fill_with_documents, ratio_result, results_table, settle
from mixers import HybridLM
from ssm_pack import PackedSeqParams, VarlenBatch

OVERRIDES = {"M": {"head_dim": 32, "state_size": 32, "chunk_size": 64}, "G": {"head_dim": 32},
             "K": {"head_dim": 32}, "P": {"head_dim": 32}, "A": {"head_dim": 32}}


def document_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Documents of 16-399 tokens filling ``tokens``."""
    return fill_with_documents(tokens, 16, 400, seed)


def run(tokens: int, hidden: int, pattern: str, repeat: int) -> tuple[list[Result], dict]:
    torch.manual_seed(0)
    model = HybridLM(256, hidden, pattern, backend="reference", mixer_overrides=OVERRIDES)
    lengths = document_lengths(tokens)
    varlen = VarlenBatch.build(PackedSeqParams.from_lengths(lengths), tokens).materialize()
    ids = torch.randint(0, 256, (1, tokens))

    def step(ids):
        loss = model(ids, packed_seq_params=varlen, labels=ids)["loss"]
        loss.backward()
        return loss

    compiled = torch.compile(step)
    start = time.perf_counter()
    try:
        compiled(ids)
    except Exception as error:  # noqa: BLE001 - a compiler failure is this benchmark's finding, not a crash
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        why = f"torch.compile failed ({type(error).__name__}: {first[:160]})"
        name = f"HybridLM({pattern}) train step: compiled vs eager ({tokens} tokens, {len(lengths)} documents)"
        return [Result("compile", name, float("nan"), None, float("nan"), note=why)], {"compile_seconds": None}
    compile_s = time.perf_counter() - start
    def measured() -> list[Result]:
        t = alternate({"eager": lambda: step(ids), "compiled": lambda: compiled(ids)}, rounds=repeat)
        return [ratio_result("compile", f"HybridLM({pattern}) train step: compiled vs eager ({tokens} tokens, "
                             f"{len(lengths)} documents)", t, "compiled", "eager",
                             note="(informational: speed-up of the compiled step)")]
    return settle(measured), {"compile_seconds": compile_s}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--pattern", default="MGKPA")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    results, info = run(args.tokens, args.hidden, args.pattern, args.repeat)
    print(results_table(results))
    if info["compile_seconds"] is not None:
        print(f"\ncompiling took {info['compile_seconds']:.1f} s (once per layout size class)")


if __name__ == "__main__":
    main()
