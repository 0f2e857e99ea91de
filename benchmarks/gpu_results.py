"""Results of the GPU check (``benchmarks/gpu_check.sh``): one file per stage, then one JSON and one
markdown summary.

Each stage process writes ``OUT/<stage>.json`` after every case (so a stage stopped by its time
budget keeps what it finished); the script appends one line per stage to ``OUT/stages.tsv``
(``name``, exit code, seconds, budget). ``python -m benchmarks.gpu_results OUT`` merges both into
``OUT/gpu_check.json`` and ``OUT/summary.md`` and exits 0 only when every stage passed.

A case is ``passed``, ``failed`` or ``skipped`` (with the reason: a package missing here, a kernel
that refuses the inputs, no CUDA device); a stage passes when its process exited 0 within its
budget and none of its cases failed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

STATUSES = ("passed", "failed", "skipped")


class Skip(Exception):
    """A case that cannot run here; the message says why."""


class Recorder:
    """Collects one stage's cases and rewrites ``OUT/<stage>.json`` after each."""

    def __init__(self, out: Path, stage: str, context: dict):
        self.path = Path(out) / f"{stage}.json"
        self.data = {"stage": stage, "context": context, "cases": []}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def _write(self):
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")

    def add(self, name: str, status: str, detail: str = "", figures: dict | None = None, seconds: float = 0.0):
        assert status in STATUSES, status
        self.data["cases"].append({"name": name, "status": status, "detail": detail, "figures": figures or {},
                                   "seconds": round(seconds, 3)})
        self._write()
        print(f"{status:7s} {name}  {detail}", flush=True)

    def run(self, name: str, case, *args) -> None:
        """Run ``case(*args)`` -> ``(detail, figures, ok)``; a :class:`Skip` or an exception is recorded too."""
        start = time.perf_counter()
        try:
            detail, figures, ok = case(*args)
            status = "passed" if ok else "failed"
        except Skip as why:
            detail, figures, status = f"skipped: {why}", {}, "skipped"
        except Exception as err:  # noqa: BLE001 - a case's error is its result; the next case still runs
            detail, figures, status = f"{type(err).__name__}: {err}", {}, "failed"
        self.add(name, status, detail, figures, time.perf_counter() - start)

    def exit_code(self) -> int:
        return 1 if any(c["status"] == "failed" for c in self.data["cases"]) else 0


def stage_main(stage: str, description: str, argv, cases) -> int:
    """The command line every measuring stage shares: ``--out DIR [--dry-run] [--cases REGEX]``.
    Loads the kernels (:func:`benchmarks.gpu_loading.prepare`), then runs each ``(name, case, args)``
    of ``cases(dry_run)`` whose name matches through one :class:`Recorder`; returns its exit code
    (1 without a CUDA device unless ``--dry-run``)."""
    import argparse
    import re

    import torch

    from benchmarks import gpu_loading

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--cases", default="", help="run only the cases whose name matches this regex")
    args = parser.parse_args(argv)
    context = {"loading": "; ".join(gpu_loading.prepare(args.dry_run))}
    if not args.dry_run and torch.cuda.is_available():
        context["device"] = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    recorder = Recorder(args.out, stage, context)
    if not args.dry_run and not torch.cuda.is_available():
        recorder.add("CUDA device", "failed", "torch.cuda.is_available() is False (use --dry-run on a CPU)")
        return 1
    for name, case, case_args in cases(args.dry_run):
        if re.search(args.cases, name):
            recorder.run(name, case, *case_args)
    return recorder.exit_code()


def _stage_rows(out: Path) -> list[dict]:
    rows = []
    table = out / "stages.tsv"
    for line in table.read_text().splitlines() if table.exists() else []:
        name, code, seconds, budget = line.split("\t")
        part = out / f"{name}.json"
        cases = json.loads(part.read_text())["cases"] if part.exists() else []
        code = int(code)
        failed = [c for c in cases if c["status"] == "failed"]
        if code in (124, 137):
            status = f"failed: stopped by its {budget} s budget"
        elif code != 0 or failed:
            status = f"failed: exit code {code}, {len(failed)} failed case(s)"
        else:
            status = "passed"
        rows.append({"stage": name, "status": status, "exit_code": code, "seconds": int(seconds),
                     "budget_s": float(budget), "cases": cases})
    return rows


def summarise(out: Path) -> int:
    """Write ``gpu_check.json`` and ``summary.md``; 0 when every stage passed."""
    out = Path(out)
    stages = _stage_rows(out)
    context = {}
    for part in sorted(out.glob("*.json")):
        if part.name != "gpu_check.json":
            context.update(json.loads(part.read_text()).get("context", {}))
    ok = bool(stages) and all(s["status"] == "passed" for s in stages)
    report = {"passed": ok, "context": context, "stages": stages}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# GPU check", "", f"Result: {'passed' if ok else 'FAILED'}", ""]
    lines += [f"- {k}: {v}" for k, v in context.items()]
    for stage in stages:
        counts = {s: sum(c["status"] == s for c in stage["cases"]) for s in STATUSES}
        lines += ["", f"## {stage['stage']}: {stage['status']} ({stage['seconds']} s of {stage['budget_s']:g} s; "
                      + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")", ""]
        if stage["cases"]:
            lines += ["| case | status | detail |", "|---|---|---|"]
            lines += [f"| {c['name']} | {c['status']} | {c['detail'].replace('|', '/')} |" for c in stage["cases"]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m benchmarks.gpu_results OUT_DIR", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(summarise(Path(sys.argv[1])))
