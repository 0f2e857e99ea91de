"""Does the cost grow with the work? Forward + backward time and peak memory per token, T = 4k .. 128k.

Every layer (Mamba2, GatedDeltaNet, KDA, GatedDeltaProduct, Attention) at hidden 128, fp32,
packed rows of 64-token documents, and ``HybridLM("MGKPA")`` (hidden 128, vocabulary 256,
documents of 16-127 tokens, next-token loss), on the reference path (CPU). Targets:

* forward + backward time per token at T = 65,536 within 1.2x of T = 8,192, for every layer and
  the model (the two sizes alternate in one process, round after round; graded on the fastest
  round of each, with the spread of the per-round ratios). Measured twice, in two processes: with
  the default allocator, and with glibc keeping freed memory in its heap
  (``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184``). By default glibc serves every block
  above 32 MB (a ``[65536, 128]`` fp32 tensor) with a fresh ``mmap`` and unmaps it on free, so a
  step at T = 65,536 pays a page fault and the kernel's zeroing per 4 KB touched, which a step at
  8,192 does not; the second measurement takes the allocator out of the comparison of the
  algorithms. Next to each, not graded: the user CPU per token (the computation) at the two
  sizes and the system CPU's share of each step (the kernel's page faults and zeroing);
* peak extra memory of one forward + backward <= 12 KB per token per layer at T = 65,536
  (measured in a fresh process per point as the peak resident set (``VmHWM``) above the resident
  set before the step; the inputs, i.e. the hidden state and its output gradient, and the
  parameters are in the baseline; a small warm-up step first loads every library).

Sizes that would not fit this machine's memory (predicted from the smaller sizes' per-token peak)
are skipped and said so. Writes ``scaling.png`` (time and memory per token against T).

    python -m benchmarks.bench_scaling [--sizes 4096 8192 ...] [--rounds 3] [--only Mamba2 Attention]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import Possible, Result, Timings, alternate, fill_with_documents, machine, results_table, table

HIDDEN = 128
# the second: glibc keeps freed memory in its heap (no mmap, no trim) instead of returning it
ALLOCATORS = {"default allocator": {},
              "glibc heap kept": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)}}
SIZES = [4096, 8192, 16384, 32768, 65536, 131072]
GRADED = (8192, 65536)                     # per-token time at the second within 1.2x of the first
TIME_TARGET, MEMORY_TARGET_KB = 1.2, 12.0
MODEL = "HybridLM(MGKPA)"
NAMES = ["Mamba2", "GatedDeltaNet", "KDA", "GatedDeltaProduct", "Attention", MODEL]
WARMUP_TOKENS = 1024
KB = 1024


# ------------------------------------------------------------------------------- one point (in-process)
def document_lengths(name: str, tokens: int) -> list[int]:
    """64-token documents for a layer; 16-127 tokens (seeded) for the model, the last one cut to fit."""
    if name != MODEL:
        return [64] * (tokens // 64) + ([tokens % 64] if tokens % 64 else [])
    return fill_with_documents(tokens, 16, 128)


def build(name: str):
    """The module (seeded) and ``step(tokens) -> callable``: one forward + backward at ``tokens``."""
    from benchmarks.bench_layers import LAYERS
    from mixers import HybridLM
    from ssm_pack import PackedSeqParams, VarlenBatch

    torch.manual_seed(0)
    module = HybridLM(256, HIDDEN, "MGKPA") if name == MODEL else LAYERS[name](HIDDEN)

    def inputs(tokens: int):
        params = VarlenBatch.build(PackedSeqParams.from_lengths(document_lengths(name, tokens)), tokens)
        g = torch.Generator().manual_seed(1)
        if name == MODEL:
            ids = torch.randint(0, 256, (1, tokens), generator=g)

            def step():
                module(ids, packed_seq_params=params, labels=ids)["loss"].backward()
                module.zero_grad(set_to_none=True)
            return step
        x0 = torch.randn(1, tokens, HIDDEN, generator=g)
        g_out = torch.randn(1, tokens, HIDDEN, generator=g)

        def step():
            x = x0.detach().requires_grad_()
            module(x, packed_seq_params=params).backward(g_out)
            module.zero_grad(set_to_none=True)
        return step
    return module, inputs


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_point(name: str, tokens: int) -> dict:
    """Peak resident memory of one forward + backward above the resident set before it (this process)."""
    _, inputs = build(name)
    inputs(WARMUP_TOKENS)()                        # loads every library and code path once
    step = inputs(tokens)
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    base = _status_kb("VmRSS")
    step()
    peak = _status_kb("VmHWM")
    return {"extra_kb": peak - base, "base_kb": base}


def time_points(name: str, sizes: list[int], rounds: int) -> dict:
    """Seconds of one forward + backward at each size, the sizes alternating round after round.

    In every round each size runs twice in a row and the second run is timed: the first puts the
    allocator in that size's steady state (what a training loop at one size sees), which a step
    of another size just before would otherwise disturb."""
    _, inputs = build(name)
    cpu: dict[str, list[tuple[float, float]]] = {str(t): [] for t in sizes}

    def metered(key, step):                # this process's user and system CPU seconds per call
        def run():
            before = resource.getrusage(resource.RUSAGE_SELF)
            step()
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu[key].append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))
        return run
    steps = {str(t): metered(str(t), inputs(t)) for t in sizes}
    timings = alternate(steps, rounds=rounds, warmup=0, untimed=1)
    timed = {key: calls[1::2] for key, calls in cpu.items()}       # each round: one untimed call, one timed
    return {"rounds": timings.rounds, "others": timings.others, "cpu": timed}


# ------------------------------------------------------------------------------- driver (subprocesses)
def _worker(args: list[str], timeout: float, env_extra: dict | None = None) -> tuple[dict | None, str]:
    env = dict(os.environ, **(env_extra or {}))
    cmd = [sys.executable, "-m", "benchmarks.bench_scaling", "--worker", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        why = "killed (out of memory?)" if out.returncode in (-9, 137) else f"failed: {tail}"
        return None, why
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1])
    return 0


def measure_memory(name: str, sizes: list[int], log) -> tuple[dict[int, float], dict[int, str]]:
    """KB/token at each size that fits; ``skipped[size]`` says why a size was not run."""
    per_token, skipped = {}, {}
    for tokens in sizes:
        if per_token:
            largest = max(per_token)
            need = per_token[largest] * tokens * 1.15 + 2 * tokens * HIDDEN * 4 / KB + 600 * KB
            if need > 0.85 * available_kb():
                skipped[tokens] = f"needs ~{need / KB ** 2:.1f} GB, {available_kb() / KB ** 2:.1f} GB available"
                continue
        point, why = _worker(["memory", name, str(tokens)], timeout=1800)
        if point is None:
            skipped[tokens] = why
            continue
        per_token[tokens] = point["extra_kb"] / tokens
        log(f"    {name} T={tokens}: {per_token[tokens]:.2f} KB/token")
    return per_token, skipped


def run(sizes: list[int], rounds: int, names=None, log=print) -> dict:
    """Every point of every curve: ``{name: {"memory": {T: KB/token}, "time": {T: [s...]}, "skipped"}}``."""
    data = {}
    for name in names or NAMES:
        memory, skipped = measure_memory(name, sizes, log)
        fits = [t for t in sizes if t in memory]
        data[name] = {"memory": memory, "skipped": skipped, "time": {}, "others": {}}
        for alloc, env in ALLOCATORS.items():
            got, why = _worker(["time", name, str(rounds), *map(str, fits)], 3600, env) if fits else (None, "")
            if got is None and fits:
                skipped.update({t: f"timing ({alloc}) {why}" for t in fits})
            got = got or {"rounds": {}, "others": {}, "cpu": {}}
            times = {int(k): v for k, v in got["rounds"].items()}
            log(f"    {name} ({alloc}): " + ", ".join(f"T={t} {min(v) / t * 1e6:.1f} us/token"
                                                    for t, v in times.items()))
            data[name]["time"][alloc] = times
            data[name]["others"][alloc] = {int(k): v for k, v in got["others"].items()}
            data[name].setdefault("cpu", {})[alloc] = {int(k): v for k, v in got["cpu"].items()}
    return data


def results(data: dict) -> list[Result]:
    """The graded figures: per-token time 64k vs 8k (each allocator), and KB/token at 64k (layers)."""
    small, large = GRADED
    out = []
    for name, d in data.items():
        for alloc in ALLOCATORS:
            times, others = d["time"].get(alloc, {}), d["others"].get(alloc, {})
            what = f"{name}: fwd+bwd per token, T={large:,} vs T={small:,} ({alloc})"
            if small in times and large in times:
                raw = Timings({"small": times[small], "large": times[large]},
                              {"small": others[small], "large": others[large]})
                t = raw.scaled({"small": 1 / small, "large": 1 / large})
                out.append(Result("scaling", what, t.best("large") * 1e6, t.best("small") * 1e6,
                                  t.best("large") / t.best("small"), TIME_TARGET, False, unit="us/token",
                                  rounds=t.ratios("large", "small"), load=raw.load(),
                                  possible=Possible(small / large, None, f"T={large:,} does {large // small}x the "
                                                    f"work of T={small:,}: it cannot take less time")))
            else:
                out.append(Result("scaling", what, float("nan"), None, float("nan"),
                                  note="not measured: " + "; ".join(f"T={k}: {v}" for k, v in d["skipped"].items())))
            cpu = d.get("cpu", {}).get(alloc, {})
            if small in cpu and large in cpu and cpu[small] and cpu[large]:
                out.append(cpu_split(name, alloc, cpu[small], cpu[large]))
        if name != MODEL and large in d["memory"]:
            kb = d["memory"][large]
            out.append(Result("scaling", f"{name}: peak extra memory of fwd+bwd at T={large:,}", kb, None, kb,
                              MEMORY_TARGET_KB, False, unit="KB/token", ratio_unit=" KB/token", bound=None))
    return out


def cpu_split(name: str, alloc: str, small_calls: list, large_calls: list) -> Result:
    """Not graded: where the time goes. The user CPU per token (the computation, all threads) at
    T=65,536 vs 8,192, and the system CPU's share of each step (the kernel mapping and zeroing
    fresh pages): a user ratio near 1 with a large system share at 65,536 says the algorithms are
    linear and the rest is the allocator's."""
    small, large = GRADED
    user = {t: min(u for u, _ in calls) / t for t, calls in ((small, small_calls), (large, large_calls))}
    share = {t: min(s / (u + s) for u, s in calls if u + s > 0)
             for t, calls in ((small, small_calls), (large, large_calls))}
    return Result("scaling", f"{name}: user CPU per token, T={large:,} vs T={small:,} ({alloc})",
                  user[large] * 1e6, user[small] * 1e6, user[large] / user[small], None, False,
                  unit="us/token", bound=None,
                  note=f"not graded: system CPU {share[small]:.0%} of the step at T={small:,}, "
                       f"{share[large]:.0%} at T={large:,} (fewest of the timed rounds)")


def curve_table(data: dict) -> str:
    sizes = sorted({t for d in data.values() for t in list(d["memory"]) + list(d["skipped"])
                    + [t for times in d["time"].values() for t in times]})
    rows = []
    measured_in = next(iter(ALLOCATORS))                 # memory is measured with the default allocator
    for name, d in data.items():
        for alloc in ALLOCATORS:
            times = d["time"].get(alloc, {})
            row = [f"{name} ({alloc})"]
            for t in sizes:
                if t in times:
                    cell = f"{min(times[t]) / t * 1e6:.1f} us"
                    if t in d["memory"] and alloc == measured_in:
                        cell += f", {d['memory'][t]:.1f} KB"
                elif t in d["skipped"]:
                    cell = "skipped"
                else:
                    cell = "-"
                row.append(cell)
            rows.append(row)
    notes = [f"- {name} T={t:,}: skipped, {why}" for name, d in data.items() for t, why in d["skipped"].items()]
    return (table(["per token: fwd+bwd time, peak extra memory"] + [f"T={t:,}" for t in sizes], rows)
            + ("\n\n" + "\n".join(notes) if notes else ""))


def plot(data: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, d) in enumerate(data.items()):
        for alloc, style in zip(ALLOCATORS, ("-", "--")):
            times = d["time"].get(alloc, {})
            ts = sorted(times)
            ax_t.plot(ts, [min(times[t]) / t * 1e6 for t in ts], marker="o", linestyle=style,
                      color=colors[i % len(colors)], label=f"{name} ({alloc})")
        ms = sorted(d["memory"])
        if ms:
            ax_m.plot(ms, [d["memory"][t] for t in ms], marker="o", color=colors[i % len(colors)], label=name)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the packed row (T)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("fwd+bwd microseconds per token (fastest round)")
    ax_t.set_title("time per token (flat = linear cost)")
    ax_m.axhline(MEMORY_TARGET_KB, color="#d62728", linestyle="--", linewidth=1, label="layer target 12 KB")
    ax_m.set_ylabel("peak extra KB per token (fwd+bwd)")
    ax_m.set_title("peak memory per token (fresh process per point)")
    ax_m.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> str:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:                       # one point in this (fresh) process
        kind, name, *rest = argv[1:]
        if kind == "memory":
            print(json.dumps(memory_point(name, int(rest[0]))))
        else:
            print(json.dumps(time_points(name, [int(t) for t in rest[1:]], int(rest[0]))))
        return ""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=NAMES)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    data = run(args.sizes, args.rounds, args.only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(data, out / "scaling.png")
    text = (f"scaling, hidden {HIDDEN}, fp32, {machine()}\n\n"
            + curve_table(data) + "\n\n" + results_table(results(data)) + f"\n\nwrote {png}")
    print(text)
    return text


if __name__ == "__main__":
    main()
