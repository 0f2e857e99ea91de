"""How fast are the packed conv and SSD references on CPU, measured side by side?

T = 8192, H = 16, P = 64, N = 64, G = 1, chunk 128, fp32 (the Mamba2 conv has
``H * P + 2 * G * N`` channels, width 4). Targets:

* packed (1024 documents) vs one document of the same T: forward <= 1.25x the time;
* packed vs a Python loop over the same 1024 documents: >= 10x faster;
* forward + backward vs forward: <= 3.5x;
* achieved FLOP/s of the SSD forward vs a plain ``torch.matmul`` in the same run: >= 20%;
* varlen conv vs a plain depthwise ``F.conv1d`` over the same tensor: <= 1.5x (the varlen conv
  gets the channel-last layout the mixers produce, ``F.conv1d`` its own channel-first layout).

    python -m benchmarks.bench_conv_ssd [--tokens 8192] [--docs 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_metadata import random_lengths
from benchmarks.common import Result, matmul_flops_per_s, measure, measure_side_by_side, results_table
from mixers.ops import causal_conv1d_fn, mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens


def ssd_inputs(tokens, heads, headdim, state, groups, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, heads, headdim, generator=g)
    dt = torch.rand(1, tokens, heads, generator=g) * 0.1
    A = -torch.rand(heads, generator=g) - 0.5
    B = torch.randn(1, tokens, groups, state, generator=g)
    C = torch.randn(1, tokens, groups, state, generator=g)
    return [t.requires_grad_(grad) for t in (x, dt, A, B, C)]


def ssd_flops(tokens, heads, headdim, state, groups, chunk):
    """Matmul FLOPs of the SSD forward: C B^T, the intra-chunk product, chunk states, state read."""
    return 2 * tokens * chunk * (groups * state + heads * headdim) + 2 * 2 * tokens * heads * headdim * state


def run(tokens, docs, repeat, heads=16, headdim=64, state=64, groups=1, chunk=128):
    lengths = random_lengths(tokens, docs)
    cu = lengths_to_cu_seqlens(lengths)
    one = torch.tensor([0, tokens], dtype=torch.int32)
    x, dt, A, B, C = ssd_inputs(tokens, heads, headdim, state, groups)

    def scan(cu_seqlens, *args):
        return mamba_chunk_scan_combined(*args, chunk, cu_seqlens=cu_seqlens)

    with torch.no_grad():
        t = measure_side_by_side({"one": lambda: scan(one, x, dt, A, B, C),
                                  "packed": lambda: scan(cu, x, dt, A, B, C)}, repeat=repeat)
        t_one, t_packed = t["one"], t["packed"]
        bounds = cu.tolist()
        t_loop = measure(lambda: [scan(torch.tensor([0, e - s], dtype=torch.int32), x[:, s:e], dt[:, s:e], A,
                                       B[:, s:e], C[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])],
                         repeat=1, warmup=0)
    grads = ssd_inputs(tokens, heads, headdim, state, groups, grad=True)

    def fwd_bwd():
        out = scan(cu, *grads)
        out.backward(torch.ones_like(out))

    t_fwd_bwd = measure(fwd_bwd, repeat=repeat)
    peak = matmul_flops_per_s(2048)
    flops = ssd_flops(tokens, heads, headdim, state, groups, chunk)
    frac = flops / t_packed / peak

    channels = heads * headdim + 2 * groups * state
    xc = torch.randn(1, channels, tokens)                       # channel-first: F.conv1d's own layout
    xl = xc.transpose(1, 2).contiguous().transpose(1, 2)        # the same values, channel-last (as mixers feed it)
    w, b = torch.randn(channels, 4), torch.randn(channels)
    with torch.no_grad():
        def plain():
            return F.silu(F.conv1d(xc, w.unsqueeze(1), b, padding=3, groups=channels)[..., :tokens])

        t = measure_side_by_side({
            "plain": plain, "last": lambda: causal_conv1d_fn(xl, w, b, activation="silu", cu_seqlens=cu),
            "first": lambda: causal_conv1d_fn(xc, w, b, activation="silu", cu_seqlens=cu)}, repeat=repeat)
        t_conv_plain, t_conv, t_conv_cf = t["plain"], t["last"], t["first"]
    g = "conv + SSD"
    return [
        Result(g, f"SSD fwd, {docs} documents vs one", t_packed, t_one, t_packed / t_one, 1.25, False),
        Result(g, "SSD fwd speed-up over a per-document loop", t_packed, t_loop, t_loop / t_packed, 10),
        Result(g, "SSD fwd+bwd vs fwd", t_fwd_bwd, t_packed, t_fwd_bwd / t_packed, 3.5, False),
        Result(g, "SSD fwd GFLOP/s vs torch.matmul", flops / t_packed / 1e9, peak / 1e9, frac, 0.20,
               unit="GFLOP/s"),
        Result(g, "varlen conv (channel-last) vs plain F.conv1d", t_conv, t_conv_plain, t_conv / t_conv_plain, 1.5,
               False),
        Result(g, "varlen conv (channel-first input) vs plain F.conv1d", t_conv_cf, t_conv_plain,
               t_conv_cf / t_conv_plain, note="(informational: one transposing copy)"),
    ]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    results = run(args.tokens, args.docs, args.repeat)
    text = (f"conv + SSD references, T={args.tokens}, {args.docs} documents, H=16 P=64 N=64 G=1 chunk=128, "
            f"fp32, CPU {torch.get_num_threads()} threads\n\n" + results_table(results))
    print(text)
    return text


if __name__ == "__main__":
    main()
