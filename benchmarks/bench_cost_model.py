"""Where does each context-parallel scheme stop scaling? The cost model's table, 32K to 4M tokens, 2 to 256 ranks.

    P = ranks, T = tokens of the row (one document spanning it: the long-context case CP is for)

For a hybrid at hidden 4096 (Mamba2 and GatedDeltaNet at the production configs of
``bench_context_parallel``, attention with 32 query heads, 8 KV heads of 128), per rank and layer,
forward + backward, from :mod:`benchmarks.cost_model` (plain arithmetic; bytes and projection
work checked exactly against gloo runs, attention pairs against the mask, by
``tests/benchmarks/test_cost_model.py``; tables 1-2 project the ideal scan and attention work, the
algorithm's, and table 3 sets it next to what our reference backends dispatch, modelled exactly):

1. bytes sent by the busiest rank: ours (state passing) per layer kind, and the all-to-all design
   (``-`` where the heads are not divisible by P: it cannot run);
2. work imbalance of the hybrid (max over ranks / mean multiply-adds) with equal-token shards and
   with ``ssm_pack.balanced_bounds``'s contiguous shards, and activation memory per rank;
3. per kind at the hybrid's head sizes and chunk sizes (hidden 256: fewer heads, the same per-head
   work; KDA and Gated DeltaProduct, not in the hybrid, at their default sizes) on one
   ``--count-tokens`` document, one process, each work part three ways: ideal
   (``cost_model.work_parts``: ``(u + 1) S`` per token for a scan, ``2 Hq D`` per causal pair), the
   dispatched model (``cost_model.dispatched_parts``: the products of the chunked SSD scan, the
   chunked delta rule (GatedDeltaNet; KDA's per-channel gate; Gated DeltaProduct's sub-steps) and
   the blockwise attention, shape by shape) and the count of a real
   forward + backward (:mod:`benchmarks.op_counts`); the dispatched model equals the count for
   every part (asserted), and ``dispatched / ideal`` is our reference backends' overhead.

    python -m benchmarks.bench_cost_model [--tokens 32768 131072 ...] [--ranks 2 8 ...] [--count-tokens 2048]
                                          [--out DIR]

``--out DIR`` writes ``DIR/cost-model.md`` and, when matplotlib is installed, ``DIR/cost-model.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import cost_model as cm
from benchmarks.common import table
from ssm_pack import balanced_bounds

MIB, GIB = 2 ** 20, 2 ** 30
HIDDEN = 4096
TOKENS = (2 ** 15, 2 ** 17, 2 ** 19, 2 ** 20, 2 ** 22)
RANKS = (2, 8, 32, 64, 256)
PATTERN = {"Mamba2": 3, "GatedDeltaNet": 3, "Attention": 1}     # layers of each kind in the hybrid
ACT, STATE = 2, 4                                                 # bytes: bf16 activations, fp32 states


def hybrid_geometry(hidden: int = HIDDEN) -> dict:
    from benchmarks.bench_context_parallel import geometry
    from mixers.layers import AttentionConfig, GatedDeltaNetConfig, Mamba2Config
    configs = {"Mamba2": Mamba2Config(hidden), "GatedDeltaNet": GatedDeltaNetConfig(hidden),
               "Attention": AttentionConfig(hidden, head_dim=128, num_heads=32, num_kv_heads=8)}
    return {name: geometry(name, cfg) for name, cfg in configs.items()}


def hybrid_work(geos: dict, total: int, bounds) -> list[int]:
    per_rank = [0] * (len(bounds) - 1)
    for name, count in PATTERN.items():
        for r, w in enumerate(cm.work(geos[name], HIDDEN, [0, total], [total], bounds)):
            per_rank[r] += count * w
    return per_rank


def imbalance(work: list[int]) -> float:
    return max(work) * len(work) / sum(work)


def rows_for(geos: dict, total: int, ranks: int) -> tuple[list, list, dict]:
    cover, bounds = cm.cover_of([0, total], total), cm.even_bounds(total, ranks)
    parts = {name: cm.ours_bytes(cover, bounds, geo, ACT, STATE) for name, geo in geos.items()}
    busiest = {name: max(sum(f + b for f, b in rank.values()) for rank in per) for name, per in parts.items()}
    conv = max(sum(rank["conv"]) for rank in parts["Mamba2"])
    ssd = max(sum(rank["state"]) for rank in parts["Mamba2"])
    delta = max(sum(rank["state"]) for rank in parts["GatedDeltaNet"])
    kv = max(sum(rank["kv"]) for rank in parts["Attention"])
    a2a = {name: cm.a2a_bytes(geo, total, ranks, ACT) if cm.a2a_fits(geo, ranks) else None
           for name, geo in geos.items()}
    mib = lambda v: "-" if v is None else f"{v / MIB:,.3f}"  # noqa: E731
    bytes_row = [f"{total:,}", ranks, mib(conv), mib(ssd), mib(delta), mib(kv),
                 mib(a2a["Mamba2"]), mib(a2a["GatedDeltaNet"]), mib(a2a["Attention"])]
    lin = sum(c * cm.linear_macs(geos[n], HIDDEN) for n, c in PATTERN.items())
    att = sum(c * cm.attention_macs(geos[n]) for n, c in PATTERN.items())
    balanced = balanced_bounds([0, total], ranks, linear=float(lin), attention=float(att))
    received = cm.received_keys(cover, bounds, -1)
    mem_ours, mem_a2a = [0] * ranks, [0] * ranks
    for name, count in PATTERN.items():
        keys = received if name == "Attention" else None
        for r, (ours, other) in enumerate(zip(cm.activation_bytes(geos[name], HIDDEN, bounds, ACT, keys),
                                              cm.activation_bytes(geos[name], HIDDEN, bounds, ACT))):
            mem_ours[r] += count * ours
            mem_a2a[r] += count * other
    mem_ours, mem_a2a = max(mem_ours), max(mem_a2a)
    work_row = [f"{total:,}", ranks, f"{imbalance(hybrid_work(geos, total, bounds)):.3f}",
                f"{imbalance(hybrid_work(geos, total, balanced)):.3f}", f"{mem_ours / GIB:,.2f}",
                f"{mem_a2a / GIB:,.2f}"]
    series = dict(ours=busiest, a2a=a2a)
    return bytes_row, work_row, series


COUNT_HIDDEN = 256


def counted_rows(tokens: int, hidden: int = COUNT_HIDDEN) -> list[list]:
    """Per kind and part (projections, then the scan or attention): the ideal work
    (``cost_model.work_parts``), the dispatched model (``cost_model.dispatched_parts``) and the
    multiply-adds one fwd + bwd really dispatches (``benchmarks.op_counts``), one document of
    ``tokens``; raises ``AssertionError`` where the dispatched model and the count differ."""
    import torch

    from benchmarks.bench_context_parallel import geometry
    from benchmarks.op_counts import count_training_step
    from mixers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
    from mixers.layers import AttentionConfig, GatedDeltaNetConfig, GatedDeltaProductConfig, KDAConfig, Mamba2Config
    from ssm_pack import PackedSeqParams
    kinds = {"Mamba2": (Mamba2Mixer, Mamba2Config(hidden)), "GatedDeltaNet": (GatedDeltaNetMixer,
                                                                              GatedDeltaNetConfig(hidden)),
             "KDA": (KDAMixer, KDAConfig(hidden)),
             "GatedDeltaProduct": (GatedDeltaProductMixer, GatedDeltaProductConfig(hidden)),
             "Attention": (AttentionMixer, AttentionConfig(hidden, head_dim=128, num_heads=hidden // 128,
                                                           num_kv_heads=1))}
    params = PackedSeqParams.from_lengths([tokens], total_tokens=tokens)
    rows = []
    for name, (cls, config) in kinds.items():
        torch.manual_seed(0)
        macs = count_training_step(cls(config=config), params, tokens)
        geo = geometry(name, config)
        (ideal,) = cm.work_parts(geo, hidden, [0, tokens], [tokens], [0, tokens])
        model = cm.dispatched_parts(geo, hidden, [0, tokens], tokens)
        rest = "attention" if name == "Attention" else "scan"
        counted = {"projections": macs["projections"], rest: macs["other"]}
        for part in ("projections", rest):
            if model[part] != counted[part]:
                raise AssertionError(f"{name}: {part} dispatched model {model[part]} != counted {counted[part]}")
            rows.append([name, part, f"{ideal[part]:,}", f"{model[part]:,}", f"{counted[part]:,}",
                         f"{model[part] / ideal[part]:.2f}x"])
    return rows


def report(tokens=TOKENS, ranks=RANKS, count_tokens: int = 2048) -> tuple[str, dict]:
    geos = hybrid_geometry()
    bytes_rows, work_rows, series = [], [], {}
    for total in tokens:
        for p in ranks:
            if p > total:
                continue
            b, w, s = rows_for(geos, total, p)
            bytes_rows.append(b)
            work_rows.append(w)
            series[(total, p)] = s
    heads = {name: geo["heads"] for name, geo in geos.items()}
    text = [f"## bytes sent per rank per layer (busiest rank, fwd + bwd, MiB; bf16 activations, fp32 states), "
            f"one document spanning the row; hidden {HIDDEN}; all-to-all needs the heads divisible by P "
            f"(heads: {heads})", "",
            table(["T", "P", "ours conv (Mamba2)", "ours SSD", "ours delta (GDN)", "ours attention KV",
                   "a2a Mamba2", "a2a GDN", "a2a attention"], bytes_rows), "",
            f"## hybrid {PATTERN}: work imbalance (max / mean multiply-adds over ranks: projections exact, "
            "ideal: attention pairs of the mask, scans (u + 1) S per token) and activation memory per rank "
            "(GiB; ours keeps the received keys too)", "",
            table(["T", "P", "imbalance equal tokens", "imbalance balanced cuts", "memory ours", "memory a2a"],
                  work_rows), ""]
    if count_tokens:
        text += [f"## work parts: ideal, dispatched model and counted (multiply-adds of one fwd + bwd, "
                 f"`benchmarks.op_counts`): one {count_tokens:,}-token document, one process, hidden "
                 f"{COUNT_HIDDEN} at the hybrid's head and chunk sizes, fp32, the torch reference backends. "
                 "The dispatched model equals the count (asserted); dispatched / ideal is what the chunked scans "
                 "(intra-chunk products) and the blocked attention (whole 128-query blocks, masked keys and "
                 "the recomputed scores) do over the algorithm", "",
                 table(["layer", "part", "ideal", "dispatched model", "counted", "dispatched / ideal"],
                       counted_rows(count_tokens)), ""]
    return "\n".join(text), series


def plot(series: dict, path: Path, total: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = sorted(p for t, p in series if t == total)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in series[(total, ranks[0])]["ours"]:
        ax.plot(ranks, [series[(total, p)]["ours"][name] / MIB for p in ranks], marker="o", label=f"ours {name}")
        fit = [p for p in ranks if series[(total, p)]["a2a"][name] is not None]
        ax.plot(fit, [series[(total, p)]["a2a"][name] / MIB for p in fit], ls="--", marker="x", label=f"a2a {name}")
    ax.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="MiB per rank per layer (fwd+bwd)",
           title=f"context-parallel bytes, one {total:,}-token document")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--count-tokens", type=int, default=2048,
                        help="document length of the counted run (0: skip it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name, values in (("--tokens", args.tokens), ("--ranks", args.ranks)):
        if any(v < 2 for v in values):
            parser.error(f"{name} must be integers >= 2, got {values}")
    if args.count_tokens < 0:
        parser.error(f"--count-tokens must be >= 0, got {args.count_tokens}")
    text, series = report(args.tokens, args.ranks, args.count_tokens)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cost-model.md").write_text(text + "\n")
        total = 2 ** 20 if any(t == 2 ** 20 for t, _ in series) else max(t for t, _ in series)
        if plot(series, args.out / "cost-model.png", total):
            print(f"wrote {args.out / 'cost-model.png'}")
    return text


if __name__ == "__main__":
    main()
