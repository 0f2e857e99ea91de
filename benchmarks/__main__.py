"""Run every benchmark, write a markdown report and PNG plots.

    python -m benchmarks                 # quick sizes: about 2 minutes on 2 cores (a smoke run)
    python -m benchmarks --full          # the sizes the targets are defined at: about 10 minutes
    python -m benchmarks --full --out docs/benchmarks/

The report goes to ``OUT/YYYY-MM-DD-<machine>.md`` (``-quick`` added at quick sizes), one dated
file per machine class (:func:`benchmarks.common.machine_slug`), its plots beside it, and
``OUT/index.md`` names the latest report of each machine class.

Every figure is a ratio measured side by side in one run; nothing here is asserted. Benchmarks
never run in CI.
"""

from __future__ import annotations

import argparse
import datetime
import re
import time
from pathlib import Path

from benchmarks import (
    bench_conv_ssd,
    bench_delta_rule,
    bench_inference,
    bench_layers,
    bench_metadata,
    bench_stream,
    bench_syncs,
)
from benchmarks.common import Result, machine, machine_slug, results_table

QUICK = dict(meta=(2**19, 5000), conv_ssd=(2048, 256), delta=(2048, [64], 1024), layers=(4, 256), repeat=3,
             syncs=((1024, 4096), (1, 64), 2048))
FULL = dict(meta=(2**21, 20000), conv_ssd=(8192, 1024), delta=(8192, [64, 128], 4096), layers=(8, 512), repeat=5,
            syncs=((4096, 32768), (1, 512), 4096))


def collect(sizes: dict, log) -> list[Result]:
    """Every group of figures; a group with an UNSTABLE figure is rerun (``common.settle``)."""
    results: list[Result] = []
    repeat = sizes["repeat"]
    log("metadata ...")
    results += bench_metadata.run(*sizes["meta"], repeat, log=log)
    log("conv + SSD ...")
    results += bench_conv_ssd.run(*sizes["conv_ssd"], repeat, log=log)
    tokens, dims, back_tokens = sizes["delta"]
    log("delta rule + attention ...")
    results += bench_delta_rule.run(tokens, dims, back_tokens, repeat, log=log)
    log("layers ...")
    layer_results, _ = bench_layers.run(*sizes["layers"], repeat, log=log)
    log("inference ...")
    inference_results = bench_inference.run(quick=sizes is QUICK, rounds=max(3, repeat + 2), log=log)
    log("stream packer ...")
    stream_results = bench_stream.run(quick=sizes is QUICK, repeat=repeat, log=log)
    return results + layer_results + inference_results + stream_results


def report_path(out: Path, machine_line: str, day: datetime.date, *, full: bool) -> Path:
    """``out/YYYY-MM-DD-<machine class>.md``; a quick run adds ``-quick`` so it never replaces a full one."""
    return Path(out) / f"{day.isoformat()}-{machine_slug(machine_line)}{'' if full else '-quick'}.md"


REPORT_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)\.md$")


def write_index(out: Path) -> Path:
    """``out/index.md``: the newest report of each machine class first, then every report, newest
    first, so the docs can link one page that always names the latest figures."""
    reports = sorted(((m.group(1), m.group(2), p.name) for p in Path(out).glob("*.md")
                      if (m := REPORT_NAME.match(p.name))), reverse=True)
    latest = {}
    for day, machine_class, name in reports:
        latest.setdefault(machine_class, (day, name))
    lines = ["# Benchmark reports", "", "Written by `python -m benchmarks --out DIR`; figures vary with the machine.",
             "", "## Latest per machine class", ""]
    lines += [f"- [{machine_class}]({name}) ({day})" for machine_class, (day, name) in latest.items()]
    lines += ["", "## All reports, newest first", ""] + [f"- [{name}]({name})" for _, _, name in reports]
    index = Path(out) / "index.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def plot(results: list[Result], stem: Path) -> list[Path]:
    """The plots, saved as ``<stem>-ops.png``, ``-layers.png`` and ``-roofline.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, path: Path) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    written = []
    timed = [r for r in results if r.unit == "s" and r.other is not None and r.ours == r.ours]
    fig, ax = plt.subplots(figsize=(13, 0.42 * len(timed) + 1.5))
    y = range(len(timed))
    ax.barh([i + 0.2 for i in y], [r.ours * 1e3 for r in timed], height=0.4, label="ssm-pack", color="#2ca02c")
    ax.barh([i - 0.2 for i in y], [r.other * 1e3 for r in timed], height=0.4, label="compared with", color="#7f7f7f")
    ax.set_yticks(list(y), [r.measure for r in timed], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log)")
    ax.set_title("ops: ssm-pack vs one document / per-document loop / fla naive / dense SDPA", fontsize=10)
    ax.legend()
    written.append(save(fig, stem.with_name(f"{stem.name}-ops.png")))
    layers = [r for r in results if r.group == "layers"]
    names = sorted({r.measure.split(":")[0] for r in layers}, key=[r.measure.split(":")[0] for r in layers].index)
    packed = [next(r.ours for r in layers if r.measure.startswith(n)) for n in names]
    padded = [next(r.other for r in layers if r.measure.startswith(n) and "padded" in r.measure) for n in names]
    loop = [next(r.other for r in layers if r.measure.startswith(n) and "loop" in r.measure) for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(names))
    for offset, values, label, color in ((-0.27, packed, "packed", "#2ca02c"), (0, padded, "padded", "#d62728"),
                                         (0.27, loop, "per-document loop", "#7f7f7f")):
        ax.bar([x + offset for x in xs], values, width=0.27, label=label, color=color)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("real tokens / s (fwd + bwd)")
    ax.set_title("layers: packed vs padded vs per-document loop")
    ax.legend()
    written.append(save(fig, stem.with_name(f"{stem.name}-layers.png")))
    roof = [r for r in results if r.unit == "GFLOP/s"]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r.measure for r in roof], [100 * r.ratio for r in roof], color="#1f77b4")
    for r in roof:
        ax.axvline(100 * r.target, color="#d62728", linestyle="--", linewidth=1)
    ax.set_xlabel("% of torch.matmul FLOP/s (dashed: target)")
    ax.set_title("fraction of the matmul roofline")
    written.append(save(fig, stem.with_name(f"{stem.name}-roofline.png")))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the target sizes (slow)")
    parser.add_argument("--out", default="bench_out", help="folder of the dated report and its plots")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = report_path(out, machine(), datetime.date.today(), full=args.full)
    started = time.perf_counter()
    print(f"{'full sizes: about 10' if args.full else 'quick sizes: about 2'} minutes on 2 cores (more when a group is "
          "UNSTABLE and rerun); the targets are defined at the full sizes", flush=True)
    results = collect(FULL if args.full else QUICK, lambda m: print(f"  {m}", flush=True))
    sections = []
    for group in dict.fromkeys(r.group for r in results):
        sections.append(f"## {group}\n\n" + results_table([r for r in results if r.group == group]))
    lengths, docs, guard_tokens = (FULL if args.full else QUICK)["syncs"]
    sections.append("## host syncs of a training step (`python -m benchmarks.bench_syncs`)\n\n"
                    + bench_syncs.report(lengths, docs, guard_tokens=guard_tokens,
                                         log=lambda m: print(f"  {m}", flush=True)))
    missed = [r.measure for r in results if r.passed is False]
    report = (f"# ssm-pack benchmarks ({'full' if args.full else 'quick'} sizes, {datetime.date.today()})\n\n"
              f"Machine: {machine()}\n\nCommand: `python -m benchmarks{' --full' if args.full else ''}`\n\n"
              + "\n\n".join(sections)
              + f"\n\n{sum(r.passed is True for r in results)} targets met, {len(missed)} missed"
              + (":\n" + "\n".join(f"- {m}" for m in missed) if missed else "") + "\n")
    pngs = plot(results, path.with_suffix(""))
    report += "\n" + "".join(f"![{p.stem}]({p.name})\n" for p in pngs)
    path.write_text(report)
    write_index(out)
    print(report)
    print(f"wrote {path} and {', '.join(str(p) for p in pngs)} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
