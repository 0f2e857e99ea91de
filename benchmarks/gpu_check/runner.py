"""The whole GPU check: each selected stage in its own process under its limit, then the report.

    python -m benchmarks.gpu_check run [--dry-run] [--stages S,...] [--allow-skip KERNEL ...] [--cases REGEX]
                                       [--results DIR] [WHEELS_DIR] OUT_DIR

A stage's limit is its budget (the setup stage's plus the build's), cut to what is left of the
total budget; a stage that cannot get 5 s is recorded as not run. A stage that fails or runs out of
time does not stop the next. After every stage ``OUT/stages.json``, ``gpu_check.json`` and
``summary.md`` are rewritten and, with ``--results DIR``, copied there with ``logs.tar.gz`` (every
stage's log and record): three files, so a run stopped from outside still hands back what finished.
``OUT/site`` and ``OUT/build`` are kept for the next run (a causal-conv1d built once is reused).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import report
from .build import stop
from .plan import STAGES, Plan

ROOT = Path(__file__).resolve().parents[2]
MIN_START_S = 5.0
RESULT_FILES = ("summary.md", "gpu_check.json", "logs.tar.gz")


def stage_env(plan: Plan) -> dict:
    """The environment of every stage process: ``OUT/site`` first on the path, fla pinned to Triton,
    IEEE fp32 in Triton dots (fp32 kernels are compared at 1e-5), the interpreter on a dry run."""
    from ssm_pack.support.installed import FLA_TRITON_PIN
    env = dict(os.environ)
    site = str(Path(plan.out) / "site")
    env["PYTHONPATH"] = os.pathsep.join([site, str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(PYTHONUNBUFFERED="1", TRITON_F32_DEFAULT="ieee")
    for name, value in FLA_TRITON_PIN.items():
        env.setdefault(name, value)
    if plan.dry_run:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def stage_argv(plan: Plan, stage: str) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "stage", stage, "--out", plan.out]
    if plan.dry_run and stage != "support":
        argv.append("--dry-run")
    if stage == "setup":
        argv += ["--wheels", str(plan.wheels), "--build-budget", f"{plan.budgets['build']:g}"]
    if stage in ("correctness", "speed") and plan.cases:
        argv += ["--cases", plan.cases]
    return argv


def stage_budget(plan: Plan, stage: str) -> float:
    return plan.budgets[stage] + (plan.budgets["build"] if stage == "setup" else 0.0)


def run_stage(argv: list[str], env: dict, limit: float, log: Path) -> tuple[int, float, bool]:
    """``(exit code, seconds, timed out)`` of one stage process; its whole process group is stopped at
    ``limit`` (exit code 124)."""
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            stop(process)
            code, timed_out = 124, True
    return code, time.monotonic() - start, timed_out


def clean(out: Path) -> None:
    """Remove the records, logs and summaries at the top of ``out`` (``site`` and ``build`` stay)."""
    for path in out.iterdir():
        if path.is_file() and (path.suffix in (".json", ".log") or path.name in ("summary.md", "stages.tsv")):
            path.unlink()


def publish(plan: Plan) -> None:
    """Copy the summary, the JSON and a tarball of the logs and records into ``plan.results``."""
    if not plan.results:
        return
    out, results = Path(plan.out), Path(plan.results)
    results.mkdir(parents=True, exist_ok=True)
    for name in RESULT_FILES[:2]:
        if (out / name).exists() and results.resolve() != out.resolve():
            shutil.copyfile(out / name, results / f".{name}.part")
            os.replace(results / f".{name}.part", results / name)
    part = results / ".logs.tar.gz.part"
    with tarfile.open(part, "w:gz") as archive:
        for path in sorted(out.glob("*.log")) + sorted(out.glob("*.json")) + sorted((out / "build").glob("*.log")):
            archive.add(path, arcname=str(path.relative_to(out)))
    os.replace(part, results / RESULT_FILES[2])


def run(plan: Plan, echo=print) -> int:
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "site").mkdir(exist_ok=True)
    clean(out)
    plan.write()
    log = open(out / "gpu_check.log", "a")
    start = time.monotonic()

    def say(line: str) -> None:
        line = f"[{time.monotonic() - start:.0f}s] {line}"
        echo(line, flush=True)
        log.write(line + "\n")
        log.flush()

    say(f"gpu_check: Python {sys.version.split()[0]}, {'dry run' if plan.dry_run else 'GPU'}, "
        f"wheels {plan.wheels or 'none (installed packages)'}, output {out}")
    say(f"stages {','.join(plan.stages)}; allowed to skip: {','.join(plan.allow_skip) or 'none'}; "
        f"cases filter: {plan.cases or 'none'}")
    for line in plan.budget_lines():
        say(f"budget {line}")
    say("budgets are seconds; GPU_CHECK_BUDGET_<NAME> sets one (e.g. GPU_CHECK_BUDGET_CORRECTNESS=600)")
    env, rows, total = stage_env(plan), [], plan.budgets["total"]
    for stage in STAGES:
        if not plan.selected(stage):
            say(f"stage {stage}: {plan.why_not(stage)}")
            continue
        left = total - (time.monotonic() - start)
        own = stage_budget(plan, stage)
        if left < MIN_START_S:
            rows.append({"stage": stage, "exit_code": None, "seconds": 0.0, "limit_s": 0.0,
                         "note": f"not run: the total budget ({total:g} s, GPU_CHECK_BUDGET_TOTAL) was spent"})
            say(f"stage {stage}: {rows[-1]['note']}")
        else:
            limit = min(own, left)
            argv = stage_argv(plan, stage)
            say(f"stage {stage} (limit {limit:.0f} s): {' '.join(argv[1:])}")
            code, seconds, timed_out = run_stage(argv, env, limit, out / f"{stage}.log")
            rows.append({"stage": stage, "exit_code": code, "seconds": round(seconds, 1), "limit_s": round(limit, 2),
                         "timed_out": timed_out,
                         "limit_note": "" if limit >= own else ": what was left of GPU_CHECK_BUDGET_TOTAL"})
            tail = (out / f"{stage}.log").read_text(errors="replace").splitlines()[-15:]
            for line in tail:
                log.write(f"    {line}\n")
            say(f"stage {stage}: exit code {code} after {seconds:.0f} s"
                + (" (stopped at its limit)" if timed_out else ""))
        (out / "stages.json").write_text(json.dumps(rows, indent=1) + "\n")
        report.summarise(out)
        publish(plan)
    code = report.summarise(out)
    publish(plan)
    summary = (out / "summary.md").read_text()
    log.write(summary)
    log.close()
    echo(summary.split("\n## Skipped cases")[0], flush=True)          # the cases are in summary.md
    echo(f"gpu_check: exit code {code}" + (f"; results in {plan.results}" if plan.results else ""), flush=True)
    return code
