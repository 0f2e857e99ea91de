"""What does Mamba-1's selective scan cost on its torch route, the one every device runs?

mamba-ssm's CUDA ``selective_scan_fn`` takes no ``seq_idx``, ``cu_seqlens`` or initial state, so
it cannot reset at packed documents; ssm-pack runs its own chunked torch backend everywhere
(docs/gpu.md). This script measures what that choice costs, side by side in one run:

    T = 4096 tokens, E = 256 channels (d_inner), Ns = 16 state, 256 documents, chunk 64, fp32

* packed (256 documents) vs one document of the same T, forward (target <= 1.25x: resets cost
  nothing extra);
* packed vs a Python loop calling the op once per document, and vs the specification
  (:mod:`mixers.ops.selective_scan.naive`, one token at a time, the shape of mamba-ssm's
  ``selective_scan_ref``), forward (informational: on CPU the chunked scan's ``log2 L`` doubling
  steps do more arithmetic than one pass, which the GPU's parallelism pays back);
* forward + backward vs forward (target <= 5x: each chunk's forward runs again in the backward);
* bytes autograd keeps for the backward per token, ours vs the specification's (counted, not
  timed: ``torch.autograd.graph.saved_tensors_hooks``), against the ``E * Ns * 4`` bytes of a
  materialised state per token (target: below it).

    python -m benchmarks.bench_selective_scan [--tokens 4096] [--docs 256] [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_metadata import random_lengths
from benchmarks.common import alternate, machine, ratio_result, results_table, settle, table, training_step
from mixers.ops import selective_scan_fn
from mixers.ops.selective_scan.naive import selective_scan_naive
from ssm_pack import lengths_to_cu_seqlens

GROUP = "selective scan"


def scan_inputs(tokens: int, channels: int, state: int, grad: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """``u, delta [1, E, T]``, ``A [E, Ns]``, ``B, C [1, Ns, T]``, ``D, delta_bias [E]``, ``z [1, E, T]``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(1, channels, tokens, generator=g)
    delta = torch.randn(1, channels, tokens, generator=g) * 0.5 - 1.0
    A = -torch.rand(channels, state, generator=g) - 0.5
    B, C = torch.randn(1, state, tokens, generator=g), torch.randn(1, state, tokens, generator=g)
    D, bias = torch.randn(channels, generator=g), torch.randn(channels, generator=g) * 0.1
    z = torch.randn(1, channels, tokens, generator=g)
    return [t.requires_grad_(grad) for t in (u, delta, A, B, C, D, z, bias)]


def _call(fn, inputs, cu):
    u, delta, A, B, C, D, z, bias = inputs
    return fn(u, delta, A, B, C, D, z, bias, True, cu_seqlens=cu)


def saved_bytes(fn, inputs, cu) -> int:
    """Bytes of the tensors autograd saves for the backward of one forward (each storage once)."""
    seen: dict[tuple, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(fn, inputs, cu)
    return sum(seen.values())


def _timed_rows(tokens, docs, repeat, channels, state) -> list:
    lengths = random_lengths(tokens, docs)
    cu, one = lengths_to_cu_seqlens(lengths), torch.tensor([0, tokens], dtype=torch.int32)
    x = scan_inputs(tokens, channels, state)
    bounds = cu.tolist()
    pieces = [[t[..., s:e] if t.dim() == 3 else t for t in x] for s, e in zip(bounds[:-1], bounds[1:])]
    grads = scan_inputs(tokens, channels, state, grad=True)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    fns = {"one": no_grad(lambda: _call(selective_scan_fn, x, one)),
           "packed": no_grad(lambda: _call(selective_scan_fn, x, cu)),
           "loop": no_grad(lambda: [_call(selective_scan_fn, p, None) for p in pieces]),
           "spec": no_grad(lambda: _call(selective_scan_naive, x, cu)),
           "fwd_bwd": training_step(lambda: _call(selective_scan_fn, grads, cu), grads)}
    t = alternate(fns, rounds=repeat)
    return [ratio_result(GROUP, f"fwd, {docs} documents vs one", t, "packed", "one", 1.25, False),
            ratio_result(GROUP, "fwd speed-up over a per-document loop", t, "packed", "loop",
                         note="(informational)"),
            ratio_result(GROUP, "fwd speed-up over the token-at-a-time specification", t, "packed", "spec",
                         note="(informational: the shape of mamba-ssm's selective_scan_ref)"),
            ratio_result(GROUP, "fwd+bwd vs fwd", t, "fwd_bwd", "packed", 5.0, False)]


def memory_rows(tokens, docs, channels, state) -> list[list[object]]:
    cu = lengths_to_cu_seqlens(random_lengths(tokens, docs))
    ours = saved_bytes(selective_scan_fn, scan_inputs(tokens, channels, state, grad=True), cu)
    spec = saved_bytes(selective_scan_naive, scan_inputs(tokens, channels, state, grad=True), cu)
    full = channels * state * 4
    return [["ours (chunked, recomputed in the backward)", f"{ours / tokens:,.0f}", f"{ours / tokens / full:.2f}",
             "below 1" if ours / tokens < full else "MISSED (>= 1)"],
            ["specification (every step kept)", f"{spec / tokens:,.0f}", f"{spec / tokens / full:.2f}",
             "(informational)"]]


def run(tokens, docs, repeat, channels=256, state=16, log=None):
    rows = settle(lambda: _timed_rows(tokens, docs, repeat, channels, state), log=log)
    return rows, memory_rows(tokens, docs, channels, state)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--state", type=int, default=16)
    args = parser.parse_args(argv)
    if not 1 <= args.docs <= args.tokens:
        raise ValueError(f"--docs must be between 1 and --tokens ({args.tokens}), got {args.docs}")
    results, memory = run(args.tokens, args.docs, args.repeat, args.channels, args.state, log=print)
    text = (f"Mamba-1 selective scan, torch route, T={args.tokens}, {args.docs} documents, E={args.channels} "
            f"Ns={args.state} chunk=64, fp32, {machine()}\n\n" + results_table(results) + "\n\n"
            f"Bytes kept for the backward per token (a materialised state is E * Ns * 4 = "
            f"{args.channels * args.state * 4:,} bytes):\n\n"
            + table(["route", "bytes per token", "vs one state per token", "verdict"], memory))
    print(text)
    return text


if __name__ == "__main__":
    main()
