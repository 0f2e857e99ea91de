"""Timing and table helpers shared by the benchmark scripts."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def measure(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1, min_time: float = 0.0) -> float:
    """Best wall time of ``fn()`` over ``repeat`` runs, in seconds (CUDA synchronised when available).

    The minimum, not the median: on a shared machine the noise only ever adds time.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    start_all = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start_all < min_time:
        gc.collect()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        if len(times) >= 50:
            break
    return min(times)


def measure_side_by_side(fns: dict[str, Callable[[], object]], *, repeat: int = 3,
                         warmup: int = 1) -> dict[str, float]:
    """Best wall time of each function, in seconds, running them in alternating rounds.

    A ratio of two timings taken minutes apart on a shared machine measures the noise as much
    as the code; alternating puts both under the same conditions, and the minimum of each keeps
    only the undisturbed runs.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            gc.collect()
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul_flops_per_s(n: int = 1024, dtype=torch.float32, device="cpu") -> float:
    """Achieved FLOP/s of a plain square ``torch.matmul``, the roofline yardstick."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = measure(lambda: a @ b, repeat=5)
    return 2 * n**3 / seconds


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda items: "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def verdict(value: float, target: float, *, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"{'PASS' if ok else 'MISS'} (target {sign} {target:g})"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclass
class Result:
    """One measured comparison: ``ours`` vs ``other`` (seconds, or a rate when ``unit`` is one)."""

    group: str
    measure: str
    ours: float
    other: float
    ratio: float
    target: float | None = None
    higher_is_better: bool = True
    unit: str = "s"
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target

    def row(self) -> list[str]:
        if self.unit == "s":
            times = f"{fmt_ms(self.ours)} vs {fmt_ms(self.other)}"
        else:
            times = f"{self.ours:,.1f} vs {self.other:,.1f} {self.unit}"
        target = self.note if self.target is None else verdict(self.ratio, self.target,
                                                               higher_is_better=self.higher_is_better)
        return [self.measure, times, f"{self.ratio:.2f}x", target]


def results_table(results: list[Result]) -> str:
    return table(["measure", "ours vs other", "ratio", "target"], [r.row() for r in results])
