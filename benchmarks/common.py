"""Timing, grading and table helpers shared by the benchmark scripts.

How a figure is graded (the rules every ``bench_*.py`` follows):

* The compared functions run in **alternating rounds** (:func:`alternate`): every round runs
  each function once, in turn, so both see the same machine state.
* A ratio is reported three ways: **best** (fastest run of one vs fastest of the other: on a
  shared machine noise only ever adds time, so this is the headline figure), and the **min /
  median / max of the per-round ratios** (the spread).
* A figure is **UNSTABLE**, never PASS or MISS, when

  1. its repeats disagree: the median per-round ratio differs from the best ratio by more than
     ``bound`` (relative; :data:`BOUND` = 15% unless the figure states its own), or the best
     and the median ratio fall on opposite sides of the target (the verdict would depend on which
     repeat is believed);
  2. it is physically impossible: outside the figure's ``possible`` interval, whose reason is
     printed next to it (e.g. forward + backward faster than the forward alone);
  3. the machine was busy: other processes kept more than :data:`BUSY` cores busy on average
     during its timed runs (:class:`LoadMeter`; on 2 cores a third thread stalls every parallel
     region of ours, by up to 30x);

  and the benchmark reruns it (:func:`settle`, at most :data:`RETRIES` more times). Each figure
  keeps its first stable attempt; one still unstable after the reruns is reported as UNSTABLE
  with its reason.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BOUND = 0.15          # default: the median per-round ratio within 15% of the best ratio
RETRIES = 2           # default: an UNSTABLE group is rerun at most twice
BUSY = 0.3            # a measurement during which other processes kept > 0.3 cores busy is UNSTABLE
TICK = 0.01           # seconds per clock tick of /proc/stat (USER_HZ = 100 on Linux)
LOAD_RESOLUTION = 0.1  # the load is not stated when it cannot be told to 0.1 cores


class PausableMode(TorchDispatchMode):
    """A dispatch mode that counts what runs inside it, except while :meth:`pause` is held (a fake
    kernel's own work is not the step's). Subclasses read ``self.paused`` before counting."""

    paused = 0

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def caches(root: str = "/sys/devices/system/cpu/cpu0/cache") -> str:
    """The first CPU's data caches as sysfs lists them (``"L1d 48K, L2 2048K, L3 491520K"``; a VM
    may report its host's L3), or ``""`` where they cannot be read. The same code is memory-bound
    on one machine and not on another: a block of ~1 MB tensors fits the L3 of one 2-core VM and
    spills the 2 MB L2 of another, so reports are compared with their caches."""
    parts = []
    for index in sorted(Path(root).glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            parts.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return ", ".join(parts)


def machine() -> str:
    """One line naming what the figures were measured on: CPU model, the vector ISA torch's CPU
    kernels dispatch to, the caches, threads, Python, torch (and the GPU, when there is one)."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()
    cache = caches()
    return (f"{cpu} ({isa}{', ' + cache if cache else ''}), {torch.get_num_threads()} threads, "
            f"Python {platform.python_version()}, torch {torch.__version__}"
            + (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))



def machine_slug(line: str | None = None) -> str:
    """The machine class of a :func:`machine` line as a file-name slug: the CPU, ISA, caches,
    threads and GPU, without the Python and torch versions (``"intel-xeon-...-2-threads"``)."""
    line = machine() if line is None else line
    line = re.sub(r", (Python|torch) [^,]*", "", line)
    line = re.sub(r"\((R|TM)\)", "", line)
    return re.sub(r"[^a-z0-9]+", "-", line.lower()).strip("-")

def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class LoadMeter:
    """CPU time other processes use while we measure: ``/proc/stat``'s busy time of all CPUs minus
    this process's own (and its waited-for children's) CPU time. Linux only; elsewhere 0."""

    def __init__(self):
        self.ok = os.path.exists("/proc/stat")
        self.tick = os.sysconf("SC_CLK_TCK") if self.ok else 100

    def _busy(self) -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
        return (sum(fields[:8]) - idle) / self.tick

    def snapshot(self) -> tuple[float, float]:
        if not self.ok:
            return 0.0, 0.0
        own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return self._busy(), own

    @staticmethod
    def others(before: tuple[float, float], after: tuple[float, float]) -> float:
        """Other processes' CPU seconds between two snapshots: signed (the system-wide figure counts
        clock ticks, so each value is off by up to a tick or two either way; clamping each one at
        zero would bias a sum of many short runs upwards: :meth:`Timings.load` sums them first)."""
        return (after[0] - before[0]) - (after[1] - before[1])


@dataclass
class Timings:
    """Seconds of every round, per function (rounds alternate the functions), the CPU seconds
    other processes used during each timed run (``others``) and the pages this process touched for
    the first time during it (``faults``: minor page faults, each a fresh 4 KB page the kernel
    mapped and zeroed)."""

    rounds: dict[str, list[float]]
    others: dict[str, list[float]] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=dict)

    def best(self, name: str) -> float:
        return min(self.rounds[name])

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def ratios(self, num: str, den: str) -> list[float]:
        """Per-round ``num / den`` (the two ran back to back in each round)."""
        return [a / b for a, b in zip(self.rounds[num], self.rounds[den])]

    def load(self, *names: str) -> float | None:
        """Mean number of cores other processes kept busy during the timed runs of ``names``;
        ``None`` when the runs were too short to tell (the tick counts' error, about two ticks per
        run, would be more than :data:`LOAD_RESOLUTION` cores)."""
        names = names or tuple(self.rounds)
        wall = sum(sum(self.rounds[n]) for n in names)
        runs = [v for n in names for v in self.others.get(n, [])]
        if not runs or wall <= 0 or 2 * len(runs) * TICK / wall > LOAD_RESOLUTION:
            return None
        return max(0.0, sum(runs)) / wall

    def fresh_mb(self, name: str) -> float | None:
        """MB of pages first touched during the fastest run of ``name`` (``None``: not counted)."""
        counts = self.faults.get(name)
        if not counts:
            return None
        fastest = min(range(len(self.rounds[name])), key=self.rounds[name].__getitem__)
        return counts[fastest] * resource.getpagesize() / 1e6

    def scaled(self, factors: dict[str, float]) -> Timings:
        """Every round of ``name`` multiplied by ``factors[name]`` (e.g. 1 / tokens: per token); the
        other processes' seconds scale with them, so :meth:`load` is unchanged."""
        return Timings({k: [t * factors.get(k, 1.0) for t in v] for k, v in self.rounds.items()},
                       {k: [t * factors.get(k, 1.0) for t in v] for k, v in self.others.items()}, self.faults)


def alternate(fns: dict[str, Callable[[], object]], rounds: int = 3, warmup: int = 1, untimed: int = 0) -> Timings:
    """Every round runs each function once, in turn; returns every round's seconds per function.

    ``untimed``: runs of each function right before its timed run, every round (to put the
    allocator and caches in that function's steady state when the others disturb it)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync()
    meter = LoadMeter()
    times: dict[str, list[float]] = {name: [] for name in fns}
    others: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(untimed):
                fn()
            _sync()
            gc.collect()
            before = meter.snapshot()
            touched = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - touched)
            others[name].append(LoadMeter.others(before, meter.snapshot()))
    return Timings(times, others, faults)


def training_step(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A timed forward + backward: ``forward()``, then the backward of its output with an output
    gradient made once (at the first call, outside every later timing: in training an upstream
    layer hands it over, and a fresh full-size tensor per step would time the allocator's page
    faults, not the backward), then the inputs' gradients cleared."""
    grad: list[torch.Tensor] = []

    def run():
        out = forward()
        if not grad:
            grad.append(torch.ones_like(out))
        out.backward(grad[0])
        for t in inputs:
            t.grad = None
    return run


def fill_with_documents(tokens: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Document lengths drawn uniformly from ``[low, high)`` (seeded) until they fill ``tokens``;
    the last one is cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(low, high, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


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


@dataclass(frozen=True)
class Possible:
    """The interval a ratio can physically take, and why (``None``: unbounded on that side)."""

    low: float | None = None
    high: float | None = None
    why: str = ""

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            span = f"{self.low:g}-{self.high:g}x"
        else:
            span = f">= {self.low:g}x" if self.low is not None else f"<= {self.high:g}x"
        return f"{span} ({self.why})" if self.why else span

    def violated(self, value: float) -> bool:
        return (self.low is not None and value < self.low) or (self.high is not None and value > self.high)


@dataclass
class Result:
    """One measured comparison: ``ours`` vs ``other`` (seconds, or a rate when ``unit`` is one).

    ``rounds``: the per-round ratios behind ``ratio`` (same orientation); with them the figure
    carries its spread and is checked against ``bound`` and ``possible`` (see the module
    docstring): ``unstable`` says why it is not graded. ``attempts``: the run it comes from.
    """

    group: str
    measure: str
    ours: float
    other: float | None
    ratio: float
    target: float | None = None
    higher_is_better: bool = True
    unit: str = "s"
    note: str = ""
    rounds: list[float] | None = None
    bound: float | None = BOUND
    possible: Possible | None = None
    ratio_unit: str = "x"
    load: float | None = None          # cores other processes kept busy while this was measured
    attempts: int = 1
    unstable: str | None = field(default=None, init=False)

    def __post_init__(self):
        self.unstable = self._instability()

    def _grade(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target

    @property
    def median(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None

    def _instability(self) -> str | None:
        values = [self.ratio] + ([self.median] if self.rounds else [])
        if self.possible is not None:
            bad = [v for v in values if self.possible.violated(v)]
            if bad:
                return f"impossible: {bad[0]:.3g}{self.ratio_unit}, possible {self.possible.text()}"
        if self.load is not None and self.load > BUSY:
            return f"machine busy: other processes used {self.load:.2f} cores"
        if not self.rounds or len(self.rounds) < 2:
            return None
        med = self.median
        if self.bound is not None and abs(med / self.ratio - 1) > self.bound:
            u = self.ratio_unit
            return f"median {med:.3g}{u} vs best {self.ratio:.3g}{u}: differ > {self.bound:.0%}"
        if self.target is not None and self._grade(med) != self._grade(self.ratio):
            return f"best {self.ratio:.3g}{self.ratio_unit} and median {med:.3g}{self.ratio_unit} straddle the target"
        return None

    @property
    def passed(self) -> bool | None:
        if self.target is None or self.unstable is not None:
            return None
        return self._grade(self.ratio)

    def spread(self) -> str:
        if not self.rounds:
            return "(one measurement)"
        r = sorted(self.rounds)
        load = "" if self.load is None else f", others {self.load:.2f} cores"
        return f"{r[0]:.2f} / {statistics.median(r):.2f} / {r[-1]:.2f} ({len(r)}{load})"

    def stable_if(self) -> str:
        parts = []
        if self.rounds and len(self.rounds) >= 2 and self.bound is not None:
            parts.append(f"median within {self.bound:.0%} of best")
        if self.possible is not None:
            parts.append(self.possible.text())
        if self.load is not None:
            parts.append(f"others < {BUSY:g} cores")
        return "; ".join(parts) or "-"

    def row(self) -> list[str]:
        if math.isnan(self.ours):                         # not measured: the note says why
            return [self.measure, "-", "-", "-", self.note, "-"]
        if self.unit == "s":
            times = fmt_ms(self.ours) + ("" if self.other is None else f" vs {fmt_ms(self.other)}")
        elif self.other is None:
            times = f"{self.ours:,.1f} {self.unit}"
        else:
            times = f"{self.ours:,.1f} vs {self.other:,.1f} {self.unit}"
        if self.unstable is not None:
            grade = f"UNSTABLE ({self.unstable}; {self.attempts} run{'s' * (self.attempts > 1)})"
        elif self.target is None:
            grade = self.note
        else:
            grade = verdict(self.ratio, self.target, higher_is_better=self.higher_is_better)
            if self.attempts > 1:
                grade += f", run {self.attempts}"
            if self.note:
                grade += f"; {self.note}"
        return [self.measure, times, f"{self.ratio:.2f}{self.ratio_unit}", self.spread(), grade, self.stable_if()]


HEADERS = ["measure", "ours vs other", "ratio (best)", "per-round min / median / max (rounds)", "verdict",
           "graded only if"]


def results_table(results: list[Result]) -> str:
    return table(HEADERS, [r.row() for r in results])


def ratio_result(group: str, measure: str, timings: Timings, ours: str, other: str, target: float | None = None,
                 higher_is_better: bool = True, *, bound: float | None = BOUND, possible: Possible | None = None,
                 note: str = "", rate: float | None = None, unit: str | None = None) -> Result:
    """``Result`` of two alternating functions: the best-vs-best ratio and the per-round ratios.

    ``higher_is_better``: the ratio is ``other / ours`` (a speed-up); else ``ours / other``.
    ``rate``: show ``rate / seconds`` (e.g. tokens) in ``unit`` instead of the times.
    """
    best_ours, best_other = timings.best(ours), timings.best(other)
    if higher_is_better:
        ratio, rounds = best_other / best_ours, timings.ratios(other, ours)
    else:
        ratio, rounds = best_ours / best_other, timings.ratios(ours, other)
    shown_ours, shown_other, shown_unit = best_ours, best_other, "s"
    if rate is not None:
        shown_ours, shown_other, shown_unit = rate / best_ours, rate / best_other, unit or "/s"
    return Result(group, measure, shown_ours, shown_other, ratio, target, higher_is_better, shown_unit, note,
                  rounds=rounds, bound=bound, possible=possible, load=timings.load(ours, other))


ROOFLINE = 1024        # the square matmul whose FLOP/s is the roofline yardstick


def roofline_matmul(n: int = ROOFLINE) -> Callable[[], object]:
    """The yardstick to alternate with the measured function: one ``n x n`` fp32 matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return lambda: a @ b


def matmul_rate(timings: Timings, yardstick: str = "matmul", n: int = ROOFLINE) -> float:
    """FLOP/s of the yardstick ``n x n`` matmul in its fastest round."""
    return 2 * n ** 3 / timings.best(yardstick)


def roofline_result(group: str, measure: str, timings: Timings, ours: str, flops: float, target: float | None,
                    *, yardstick: str = "matmul", n: int = ROOFLINE) -> Result:
    """Achieved FLOP/s of ``ours`` (``flops`` per run) as a fraction of the yardstick matmul's, from
    the same alternating rounds: ``(F / t_ours) / (M / t_mm) = t_mm * (F / M) / t_ours``."""
    mm_flops = 2 * n ** 3
    r = ratio_result(group, measure, timings.scaled({yardstick: flops / mm_flops}), ours, yardstick, target,
                     possible=Possible(None, 1.0, "the algorithm's matmuls cannot beat a large matmul's rate"))
    r.ours, r.other = flops / timings.best(ours) / 1e9, matmul_rate(timings, yardstick, n) / 1e9
    r.unit, r.ratio_unit = "GFLOP/s", ""
    r.unstable = r._instability()                      # its reason worded in the fraction's unit
    return r


def settle(run: Callable[[], list[Result]], *, retries: int = RETRIES, log: Callable[[str], None] | None = None
           ) -> list[Result]:
    """Run a group of figures; while any is UNSTABLE, rerun the group (at most ``retries`` times).

    ``run`` returns the same figures in the same order every time. Each figure keeps its first
    stable attempt (its ``attempts`` says which); one never stable keeps its last, UNSTABLE.
    """
    kept = run()
    for attempt in range(2, retries + 2):
        shaky = [r for r in kept if r.unstable is not None]
        if not shaky:
            break
        if log is not None:
            log(f"    rerun {attempt - 1}/{retries}: UNSTABLE {'; '.join(r.measure for r in shaky)}")
        fresh = run()
        assert len(fresh) == len(kept), "a rerun must give the same figures"
        for i, r in enumerate(fresh):
            if kept[i].unstable is not None:
                r.attempts = attempt
                kept[i] = r
    return kept
