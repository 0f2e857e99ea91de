"""Does packing pay off per layer? Forward + backward real tokens/s, packed vs padded vs a loop.

Hidden 512, fp32, CPU. A batch of documents with log-normal lengths (median 300, capped at
2048), about half of the padded form being padding. Each layer runs the same real tokens three
ways: packed in one row with ``PackedSeqParams``, as a right-padded ``[B, S]`` batch, and one
document at a time. Target: packed >= 1.7x the padded throughput (2x is the ideal at 50%).

    python -m benchmarks.bench_layers [--docs 8] [--hidden 512] [--repeat 3]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import Result, alternate, machine, ratio_result, results_table, settle
from mixers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
from ssm_pack import PackedSeqParams, pack_padded

LAYERS = {"Mamba2": Mamba2Mixer, "GatedDeltaNet": GatedDeltaNetMixer, "KDA": KDAMixer,
          "GatedDeltaProduct": GatedDeltaProductMixer, "Attention": AttentionMixer}


def document_lengths(docs: int, seed: int = 0, median: float = 300.0, cap: int = 2048) -> list[int]:
    """Log-normal lengths around ``median``; sigma 0.6 gives ~50% padding for a handful of documents."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(docs, generator=g) * 0.6) * median
    return [int(min(cap, max(1, round(float(n))))) for n in draws]


def run(docs: int, hidden: int, repeat: int, names=None, log=None) -> tuple[list[Result], dict]:
    lengths = document_lengths(docs)
    width = max(lengths)
    padding = 1 - sum(lengths) / (len(lengths) * width)
    g = torch.Generator().manual_seed(1)
    padded = torch.randn(len(lengths), width, hidden, generator=g)
    packed = pack_padded(padded, lengths)
    params = PackedSeqParams.from_lengths(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rows = []
    for name in names or LAYERS:
        torch.manual_seed(0)
        layer = LAYERS[name](hidden)

        def packed_step():
            x = packed.detach().requires_grad_()
            layer(x, packed_seq_params=params).square().mean().backward()

        def padded_step():
            x = padded.detach().requires_grad_()
            out = layer(x)
            (out.square().mean(-1) * mask).sum().backward()    # padding positions carry no loss

        def loop_step():
            start = 0
            for n in lengths:
                x = packed[:, start:start + n].detach().requires_grad_()
                layer(x).square().mean().backward()
                start += n

        def measured() -> list[Result]:
            t = alternate({"packed": packed_step, "padded": padded_step, "loop": loop_step}, rounds=repeat)
            real = sum(lengths)
            return [ratio_result("layers", f"{name}: packed vs padded", t, "packed", "padded", 1.7, rate=real,
                                 unit="tok/s"),
                    ratio_result("layers", f"{name}: packed vs a per-document loop", t, "packed", "loop", rate=real,
                                 unit="tok/s", note="(informational)")]
        rows += settle(measured, log=log)
    meta = {"lengths": lengths, "padding": padding, "real_tokens": sum(lengths), "padded_tokens": len(lengths) * width}
    return rows, meta


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", nargs="*", choices=list(LAYERS))
    args = parser.parse_args(argv)
    rows, meta = run(args.docs, args.hidden, args.repeat, args.layers, log=print)
    text = (f"layers fwd+bwd, hidden {args.hidden}, fp32, {machine()}: "
            f"{len(meta['lengths'])} documents, {meta['real_tokens']} real tokens, "
            f"padded form {meta['padded_tokens']} tokens "
            f"({meta['padding']:.0%} padding)\n\n"
            + results_table(rows))
    print(text)
    return text


if __name__ == "__main__":
    main()
