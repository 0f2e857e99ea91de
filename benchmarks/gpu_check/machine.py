"""The support and kernels stages of the GPU check.

    python -m benchmarks.gpu_check stage support --out OUT
    python -m benchmarks.gpu_check stage kernels --out OUT [--dry-run]

* support: ``python -m ssm_pack`` as a user would run it (no loading help: mamba-ssm's sources
  without their CUDA extension show as such), its report kept in the stage log;
* kernels: each kernel of :data:`ssm_pack.support.requirements.KERNELS` once the sources are loaded
  (:func:`.loading.prepare`): available, or skipped with ssm-pack's reason (``not applicable`` for a
  CUDA C++ kernel on a dry run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .loading import prepare
from .record import Recorder


def support(out: Path) -> int:
    recorder = Recorder(out, "support", {})
    done = subprocess.run([sys.executable, "-m", "ssm_pack"], capture_output=True, text=True)
    print(done.stdout + done.stderr, flush=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        recorder.add("python -m ssm_pack", "failed", f"exit code {done.returncode}: "
                     + " / ".join((done.stdout + done.stderr).strip().splitlines()[-3:]))
    else:
        recorder.add("python -m ssm_pack", "passed", f"{len(lines)} report lines (in support.log); first: {lines[0]}")
    return recorder.exit_code()


def kernels(out: Path, dry_run: bool) -> int:
    """One case per kernel of the table: available here, or why not."""
    lines = prepare(dry_run)
    recorder = Recorder(out, "kernels", {"loading": "; ".join(lines)})
    from mixers.ops import dispatch
    from ssm_pack.support.requirements import KERNELS
    for name, kernel in KERNELS.items():
        ok, reason = dispatch.cached_support(name)
        if ok:
            recorder.add(f"{name}: {kernel.label}", "passed", "available", kernels=(name,))
        else:
            kind = "not applicable" if dry_run and not kernel.triton else "unavailable"
            recorder.add(f"{name}: {kernel.label}", "skipped", f"skipped: {reason}", kernels=(name,), skip=kind)
    return recorder.exit_code()


def main(stage: str, argv) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.gpu_check stage {stage}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    return support(Path(args.out)) if stage == "support" else kernels(Path(args.out), args.dry_run)
