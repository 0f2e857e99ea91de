"""``python -m benchmarks.gpu_check``: the GPU check's commands.

    python -m benchmarks.gpu_check wheelhouse DIR [--python-version 3.12] [--extra SPEC ...]
    python -m benchmarks.gpu_check [run] [--dry-run] [--stages S,...] [--allow-skip KERNEL ...] [--cases REGEX]
                                         [--results DIR] [WHEELS_DIR] OUT_DIR
    python -m benchmarks.gpu_check summary OUT_DIR
    python -m benchmarks.gpu_check stage NAME --out OUT ...        (one stage; the runner calls it)

``run`` options fall back to the environment: ``GPU_CHECK_STAGES``, ``GPU_CHECK_ALLOW_SKIP``,
``GPU_CHECK_CASES``, ``GPU_CHECK_RESULTS``; budgets are ``GPU_CHECK_BUDGET_<NAME>`` (:mod:`.plan`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .plan import STAGES


def parse_run(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh",
                                     description="the GPU check: setup, support, kernels, correctness, speed")
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU, Triton under its interpreter")
    parser.add_argument("--stages", default=os.environ.get("GPU_CHECK_STAGES", ""),
                        help=f"run only these stages, comma separated (of {','.join(STAGES)}); default all")
    parser.add_argument("--allow-skip", action="append", default=None, metavar="KERNEL",
                        help="a kernel of ssm_pack.support.requirements.KERNELS that may be skipped "
                             "(repeatable, or a comma list)")
    parser.add_argument("--cases", default=os.environ.get("GPU_CHECK_CASES", ""),
                        help="run only the correctness / speed cases whose name matches this regex")
    parser.add_argument("--results", default=os.environ.get("GPU_CHECK_RESULTS") or None,
                        help="also copy summary.md, gpu_check.json and logs.tar.gz here after every stage")
    parser.add_argument("paths", nargs="+", metavar="[WHEELS_DIR] OUT_DIR")
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error(f"expected [WHEELS_DIR] OUT_DIR, got {len(args.paths)} paths: {args.paths}")
    if args.allow_skip is None:
        args.allow_skip = [os.environ.get("GPU_CHECK_ALLOW_SKIP", "")]
    args.wheels = Path(args.paths[0]).resolve() if len(args.paths) == 2 else None
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"WHEELS_DIR {args.paths[0]} is not a folder")
    args.out = Path(args.paths[-1]).resolve()
    return args


def run(argv) -> int:
    from .plan import Plan, budgets, parse_allow_skip, parse_stages
    from .runner import run as run_check
    args = parse_run(argv)
    try:
        plan = Plan(out=str(args.out), dry_run=args.dry_run, wheels=None if args.wheels is None else str(args.wheels),
                    stages=parse_stages(args.stages), allow_skip=parse_allow_skip(args.allow_skip), cases=args.cases,
                    budgets=budgets(args.dry_run),
                    results=None if args.results is None else str(Path(args.results).resolve()))
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    return run_check(plan)


def stage(argv) -> int:
    if not argv or argv[0] not in STAGES:
        print(f"usage: python -m benchmarks.gpu_check stage {{{','.join(STAGES)}}} --out OUT ...", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name == "setup":
        from .setup_stage import main
        return main(rest)
    if name in ("support", "kernels"):
        from .machine import main
        return main(name, rest)
    if name == "correctness":
        from .correctness import main
        return main(rest)
    from .speed import main
    return main(rest)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else ""
    if command == "wheelhouse":
        from .wheelhouse import main as wheelhouse
        return wheelhouse(argv[1:])
    if command == "stage":
        return stage(argv[1:])
    if command == "summary":
        if len(argv) != 2:
            print("usage: python -m benchmarks.gpu_check summary OUT_DIR", file=sys.stderr)
            return 2
        from .report import summarise
        return summarise(Path(argv[1]))
    return run(argv[1:] if command == "run" else argv)


if __name__ == "__main__":
    raise SystemExit(main())
