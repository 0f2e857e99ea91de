"""How fast are seq_idx and the conversions at 2^21 tokens and 20,000 documents?

Each vectorised function is timed against a naive per-document Python loop that computes the
same thing, and against one memory pass (``torch.cumsum`` over the same number of int32 tokens)
as the bandwidth yardstick. Targets: within 3x of the yardstick, >= 20x faster than the loop.

    python -m benchmarks.bench_metadata [--tokens 2097152] [--docs 20000]
"""

from __future__ import annotations

import argparse

import torch

import ssm_pack as sp
from benchmarks.common import Result, alternate, machine, ratio_result, results_table, settle


def random_lengths(tokens: int, docs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=g)[: docs - 1].sort().values + 1
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    return bounds[1:] - bounds[:-1]


def loop_seq_idx(cu: list[int], total: int) -> torch.Tensor:
    out = torch.empty(total, dtype=torch.int32)
    for i in range(len(cu) - 1):
        out[cu[i]: cu[i + 1]] = i
    out[cu[-1]:] = len(cu) - 1
    return out


def loop_positions(cu: list[int], total: int) -> torch.Tensor:
    out = torch.empty(total, dtype=torch.int64)
    for i in range(len(cu) - 1):
        out[cu[i]: cu[i + 1]] = torch.arange(cu[i + 1] - cu[i])
    return out


def loop_cu_from_positions(pos: torch.Tensor) -> torch.Tensor:
    starts = [i for i, p in enumerate(pos.tolist()) if p == 0]
    return torch.tensor(starts + [pos.numel()], dtype=torch.int32)


def loop_doc_ids_params(doc_ids: torch.Tensor) -> torch.Tensor:
    flat = doc_ids.reshape(-1).tolist()
    cols = doc_ids.shape[1]
    cu = [0]
    for i in range(1, len(flat)):
        if i % cols == 0 or flat[i] != flat[i - 1]:
            cu.append(i)
    cu.append(len(flat))
    return torch.tensor(cu, dtype=torch.int32)


def loop_cu_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    counts = {}
    for s in seq_idx.tolist():
        counts[s] = counts.get(s, 0) + 1
    cu = [0]
    for i in range(max(counts) + 1):
        cu.append(cu[-1] + counts.get(i, 0))
    return torch.tensor(cu, dtype=torch.int32)


def run(tokens: int, docs: int, repeat: int, log=None) -> list[Result]:
    lengths = random_lengths(tokens, docs)
    cu = sp.lengths_to_cu_seqlens(lengths)
    cu_list = cu.tolist()
    pos = sp.position_ids_from_cu_seqlens(cu)
    seq_idx = sp.seq_idx_from_cu_seqlens(cu, tokens)
    rows = 64 if tokens % 64 == 0 else 1
    doc_ids = (seq_idx.reshape(-1) + 1).reshape(rows, -1)
    ones = torch.ones(tokens, dtype=torch.int32)
    cases = [
        ("build_packed_seq_idx", lambda: sp.build_packed_seq_idx(cu, tokens), lambda: loop_seq_idx(cu_list, tokens),
         sp.build_packed_seq_idx(cu, tokens)[0], loop_seq_idx(cu_list, tokens)),
        ("position_ids_from_cu_seqlens", lambda: sp.position_ids_from_cu_seqlens(cu),
         lambda: loop_positions(cu_list, tokens), pos[0], loop_positions(cu_list, tokens)),
        ("cu_seqlens_from_position_ids", lambda: sp.cu_seqlens_from_position_ids(pos),
         lambda: loop_cu_from_positions(pos[0]), sp.cu_seqlens_from_position_ids(pos), cu),
        ("cu_seqlens_from_seq_idx", lambda: sp.cu_seqlens_from_seq_idx(seq_idx),
         lambda: loop_cu_from_seq_idx(seq_idx[0]), sp.cu_seqlens_from_seq_idx(seq_idx), cu),
        ("packed_seq_params_from_doc_ids", lambda: sp.packed_seq_params_from_doc_ids(doc_ids),
         lambda: loop_doc_ids_params(doc_ids), sp.packed_seq_params_from_doc_ids(doc_ids).cu_seqlens_q,
         loop_doc_ids_params(doc_ids)),
    ]
    results = []
    for name, fast, loop, got, want in cases:
        assert torch.equal(got.to(want.dtype), want), f"{name} disagrees with its loop"

        def measured(fast=fast, loop=loop, name=name) -> list[Result]:
            t = alternate({"fast": fast, "loop": loop, "cumsum": lambda: torch.cumsum(ones, 0, dtype=torch.int32)},
                          rounds=repeat)
            return [ratio_result("metadata", f"{name} vs torch.cumsum (one memory pass)", t, "fast", "cumsum", 3.0,
                                 False),
                    ratio_result("metadata", f"{name} speed-up over a per-document loop", t, "fast", "loop", 20.0)]
        results += settle(measured, log=log)
    return results


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2**21)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    results = run(args.tokens, args.docs, args.repeat, log=print)
    text = (f"metadata at {args.tokens} tokens, {args.docs} documents ({machine()})\n\n"
            + results_table(results))
    print(text)
    return text


if __name__ == "__main__":
    main()
