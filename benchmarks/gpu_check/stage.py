"""The command line every measuring stage of the GPU check shares (correctness, speed):

    python -m benchmarks.gpu_check stage NAME --out OUT [--dry-run] [--cases REGEX]

It loads the kernels (:func:`.loading.prepare`), then runs each :class:`.record.Case` whose name
matches ``REGEX`` through one :class:`.record.Recorder`. On a dry run a case whose every kernel is a
CUDA C++ one is recorded as ``not applicable`` without running; without ``--dry-run`` a machine
with no CUDA device fails at once.
"""

from __future__ import annotations

import argparse
import os
import re

from .grading import missing_kernels
from .loading import first_configs, prepare
from .plan import NOT_APPLICABLE, expectation
from .record import Case, Recorder, Skip


def not_applicable(case: Case, dry_run: bool) -> str | None:
    """Why ``case`` cannot run on a dry run (every kernel it needs is a CUDA C++ one), else ``None``."""
    if not dry_run or not case.kernels:
        return None
    if all(expectation(k, True, ())[0] == NOT_APPLICABLE for k in case.kernels):
        verb = "needs" if len(case.kernels) == 1 else "need"
        return (f"not applicable in a dry run: {', '.join(case.kernels)} {verb} a CUDA device "
                "(no Triton kernel to interpret)")
    return None


def _naming_missing(case: Case):
    """``case.function`` whose ``unavailable`` skip names the case's kernels that are missing here."""
    def call(*args):
        try:
            return case.function(*args)
        except Skip as why:
            if why.kind == "unavailable" and not why.missing:
                why.missing = missing_kernels(case.kernels)
            raise
    return call


def run_cases(recorder: Recorder, cases, dry_run: bool, pattern: str = "") -> None:
    for case in cases:
        if not re.search(pattern, case.name):
            continue
        why = not_applicable(case, dry_run)
        if why is not None:
            recorder.add(case.name, "skipped", f"skipped: {why}", kernels=case.kernels, skip="not applicable")
            continue
        recorder.run(case.name, _naming_missing(case), *case.args, kernels=case.kernels)


def stage_main(stage: str, description: str, argv, cases) -> int:
    """Parse the shared command line, load the kernels and run ``cases(dry_run)``; the recorder's exit
    code (1 without a CUDA device unless ``--dry-run``)."""
    import torch

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.gpu_check stage {stage}", description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--cases", default="", help="run only the cases whose name matches this regex")
    args = parser.parse_args(argv)
    context = {"loading": "; ".join(prepare(args.dry_run))}
    if stage == "correctness" and os.environ.get("GPU_CHECK_AUTOTUNE") == "first" and not args.dry_run:
        context["autotune"] = first_configs()
    if not args.dry_run and torch.cuda.is_available():
        context["device"] = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    recorder = Recorder(args.out, stage, context)
    if not args.dry_run and not torch.cuda.is_available():
        recorder.add("CUDA device", "failed", "torch.cuda.is_available() is False (use --dry-run on a CPU)")
        return 1
    run_cases(recorder, cases(args.dry_run), args.dry_run, args.cases)
    return recorder.exit_code()
