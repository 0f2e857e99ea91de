"""How fast are the packed conv and SSD references on CPU, measured side by side?

T = 8192, H = 16, P = 64, N = 64, G = 1, chunk 128, fp32 (the Mamba2 conv has
``H * P + 2 * G * N`` channels, width 4). Targets:

* packed (1024 documents) vs one document of the same T: forward <= 1.25x the time;
* packed vs a Python loop over the same 1024 documents: >= 10x faster;
* forward + backward vs forward: <= 3.5x (the output gradient made once, outside the timing,
  as an upstream layer hands it over: :func:`benchmarks.common.training_step`);
* achieved FLOP/s of the SSD forward vs a plain ``torch.matmul`` in the same run: >= 20%;
* (informational) one document vs mamba-ssm's ``ssd_minimal_discrete`` (the paper's listing;
  measured when mamba-ssm is installed, :mod:`benchmarks.peers`);
* varlen conv vs a plain depthwise ``F.conv1d`` over the same tensor: <= 1.5x (the varlen conv
  gets the channel-last layout the mixers produce, ``F.conv1d`` its own channel-first layout).

    python -m benchmarks.bench_conv_ssd [--tokens 8192] [--docs 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks import peers
from benchmarks.bench_metadata import random_lengths
from benchmarks.common import (
    ROOFLINE,
    Possible,
    Result,
    alternate,
    machine,
    ratio_result,
    results_table,
    roofline_matmul,
    roofline_result,
    settle,
    training_step,
)
from mixers.ops import causal_conv1d_fn, mamba_chunk_scan_combined
from ssm_pack import lengths_to_cu_seqlens

GROUP = "conv + SSD"


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


def _ssd_rows(tokens, docs, repeat, heads, headdim, state, groups, chunk) -> list[Result]:
    lengths = random_lengths(tokens, docs)
    cu = lengths_to_cu_seqlens(lengths)
    one = torch.tensor([0, tokens], dtype=torch.int32)
    x, dt, A, B, C = ssd_inputs(tokens, heads, headdim, state, groups)
    bounds = cu.tolist()
    pieces = [(torch.tensor([0, e - s], dtype=torch.int32), x[:, s:e], dt[:, s:e], B[:, s:e], C[:, s:e])
              for s, e in zip(bounds[:-1], bounds[1:])]
    grads = ssd_inputs(tokens, heads, headdim, state, groups, grad=True)

    def scan(cu_seqlens, *args):
        return mamba_chunk_scan_combined(*args, chunk, cu_seqlens=cu_seqlens)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    fns = {"one": no_grad(lambda: scan(one, x, dt, A, B, C)), "packed": no_grad(lambda: scan(cu, x, dt, A, B, C)),
           "loop": no_grad(lambda: [scan(c, xs, ds, A, bs, cs) for c, xs, ds, bs, cs in pieces]),
           "fwd_bwd": training_step(lambda: scan(cu, *grads), grads), "matmul": roofline_matmul()}
    minimal = peers.mamba_ssd_minimal()
    if minimal is not None:                      # one document, B and C per head, x and A already times dt
        xd, ad = x * dt.unsqueeze(-1), A * dt
        bh, ch = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
        fns["minimal"] = no_grad(lambda: minimal(xd, ad, bh, ch, chunk))
    t = alternate(fns, rounds=repeat)
    frac = roofline_result(GROUP, f"SSD fwd GFLOP/s vs torch.matmul {ROOFLINE}^3", t, "packed",
                           ssd_flops(tokens, heads, headdim, state, groups, chunk), 0.20)
    rows = [ratio_result(GROUP, f"SSD fwd, {docs} documents vs one", t, "packed", "one", 1.25, False),
            ratio_result(GROUP, "SSD fwd speed-up over a per-document loop", t, "packed", "loop", 10),
            ratio_result(GROUP, "SSD fwd+bwd vs fwd", t, "fwd_bwd", "packed", 3.5, False,
                         possible=Possible(1.0, None, "forward + backward contains the forward")),
            frac]
    if minimal is not None:
        rows.append(ratio_result(GROUP, "SSD fwd (one document) speed-up over mamba ssd_minimal_discrete", t, "one",
                                 "minimal", note="(informational: the paper's listing)"))
    else:
        rows.append(Result(GROUP, "peer not measured: mamba ssd_minimal_discrete", float("nan"), None, float("nan"),
                           note=peers.MISSING.get("mamba ssd_minimal", "")))
    return rows


def _conv_rows(tokens, docs, repeat, channels) -> list[Result]:
    cu = lengths_to_cu_seqlens(random_lengths(tokens, docs))
    xc = torch.randn(1, channels, tokens)                       # channel-first: F.conv1d's own layout
    xl = xc.transpose(1, 2).contiguous().transpose(1, 2)        # the same values, channel-last (as mixers feed it)
    w, b = torch.randn(channels, 4), torch.randn(channels)

    def plain():
        return F.silu(F.conv1d(xc, w.unsqueeze(1), b, padding=3, groups=channels)[..., :tokens])

    with torch.no_grad():
        t = alternate({"plain": plain, "last": lambda: causal_conv1d_fn(xl, w, b, activation="silu", cu_seqlens=cu),
                       "first": lambda: causal_conv1d_fn(xc, w, b, activation="silu", cu_seqlens=cu)}, rounds=repeat)
    return [ratio_result(GROUP, "varlen conv (channel-last) vs plain F.conv1d", t, "last", "plain", 1.5, False),
            ratio_result(GROUP, "varlen conv (channel-first input) vs plain F.conv1d", t, "first", "plain", None, False,
                         note="(informational: one transposing copy)")]


def run(tokens, docs, repeat, heads=16, headdim=64, state=64, groups=1, chunk=128, log=None) -> list[Result]:
    rows = settle(lambda: _ssd_rows(tokens, docs, repeat, heads, headdim, state, groups, chunk), log=log)
    return rows + settle(lambda: _conv_rows(tokens, docs, repeat, heads * headdim + 2 * groups * state), log=log)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    results = run(args.tokens, args.docs, args.repeat, log=print)
    text = (f"conv + SSD references, T={args.tokens}, {args.docs} documents, H=16 P=64 N=64 G=1 chunk=128, "
            f"fp32, {machine()}\n\n" + results_table(results))
    print(text)
    return text


if __name__ == "__main__":
    main()
