"""``OUT/gpu_check.json`` and ``OUT/summary.md`` from a run's records (:mod:`.verdict` decides).

    python -m benchmarks.gpu_check summary OUT_DIR       # exit code 0 only when the check passed

The runner calls it after every stage, so an outer limit that stops the machine still leaves a
summary of what finished. The summary says: the result and every reason for a failure; how the run
was set up (dry run or GPU, wheelhouse, stages selected, kernels allowed to skip, cases filter,
budgets); one row per stage (status, seconds of its limit, case counts); one row per kernel
(expected here or not and why, what the kernels stage found, the correctness cases that passed on
it, the verdict); the skipped cases grouped by kind; then every case of every stage.
"""

from __future__ import annotations

import json
from pathlib import Path

from .plan import STAGES, Plan, expectation
from .record import SKIP_KINDS, STATUSES, read
from .verdict import result


def load(out: Path) -> tuple[Plan | None, list[dict], dict]:
    out = Path(out)
    plan = Plan.read(out)
    rows_path = out / "stages.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else []
    records = {stage: record for stage in STAGES if (record := read(out, stage)) is not None}
    return plan, rows, records


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _setup_lines(plan: Plan, records: dict) -> list[str]:
    context = {}
    for record in records.values():
        context.update(record.get("context") or {})
    lines = [f"- run: {'dry run (CPU, Triton interpreter)' if plan.dry_run else 'GPU'}",
             f"- wheelhouse: {plan.wheels or 'none (the installed packages are used)'}",
             f"- stages selected: {', '.join(plan.stages)}",
             f"- allowed to skip: {', '.join(plan.allow_skip) or 'none'}",
             f"- cases filter: {plan.cases or 'none (every case)'}",
             "- budgets (GPU_CHECK_BUDGET_<NAME> seconds): " + "; ".join(
                 f"{name} {seconds:g} s" for name, seconds in plan.budgets.items())]
    return lines + [f"- {k}: {v}" for k, v in context.items()]


def _stage_table(stages: list[dict]) -> list[str]:
    lines = ["| stage | status | seconds (limit) | passed / failed / skipped | why |", "|---|---|---|---|---|"]
    for s in stages:
        counts = " / ".join(str(sum(c["status"] == st for c in s["cases"])) for st in STATUSES)
        seconds = "" if s["seconds"] is None else f"{s['seconds']:.0f} ({s['limit_s']:g})"
        lines.append(f"| {s['stage']} | {s['status']} | {seconds} | {counts} | {_cell(s['why'])} |")
    return lines


def _kernel_table(kernels: list[dict]) -> list[str]:
    lines = ["| kernel | this run | kernels stage | correctness cases passed | verdict |", "|---|---|---|---|---|"]
    for k in kernels:
        found = {None: "not run", True: "available", False: k["available_detail"]}[k["available"]]
        verdict = k["reason"] if k["reason"].startswith(k["verdict"]) else f"{k['verdict']}: {k['reason']}"
        lines.append(f"| {k['kernel']} | {k['expected']} | {_cell(found)} | {len(k['ran'])} of {k['cases']} | "
                     f"{_cell(verdict)} |")
    return lines


def _missing(case: dict, plan: Plan) -> str:
    """`` (missing: mamba_ssd (expected), flash_attn (allowed))`` for an ``unavailable`` skip."""
    if not case.get("missing"):
        return ""
    names = [f"{k} ({expectation(k, plan.dry_run, plan.allow_skip)[0]})" for k in case["missing"]]
    return f" (missing: {', '.join(names)})"


def _skips(stages: list[dict], plan: Plan) -> list[str]:
    lines = []
    for kind in SKIP_KINDS:
        hits = [(s["stage"], c) for s in stages for c in s["cases"] if c.get("skip") == kind]
        if hits:
            lines += ["", f"### {kind} ({len(hits)})", ""]
            lines += [f"- {stage}: {c['name']}{_missing(c, plan)}: {_cell(c['detail'])}" for stage, c in hits]
    return lines


def result_line(passed: bool, plan: Plan | None) -> str:
    """``Result: passed`` / ``Result: FAILED``, saying so when only part of the check was asked for."""
    partial = []
    if plan is not None and plan.stages != STAGES:
        partial.append(f"stages {','.join(plan.stages)} only")
    if plan is not None and plan.cases:
        partial.append(f"cases matching {plan.cases!r} only")
    return f"Result: {'passed' if passed else 'FAILED'}" + (f" (partial: {'; '.join(partial)})" if partial else "")


def summarise(out: Path) -> int:
    """Write ``gpu_check.json`` and ``summary.md``; 0 only when the check passed."""
    out = Path(out)
    plan, rows, records = load(out)
    verdict = result(plan, rows, records)
    report = {"result": "passed" if verdict["passed"] else "FAILED", **verdict,
              "plan": None if plan is None else plan.__dict__}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = ["# GPU check", "", result_line(verdict["passed"], plan), ""]
    lines += [f"- {reason}" for reason in verdict["reasons"]]
    if plan is not None:
        lines += ["", "## Run", ""] + _setup_lines(plan, records)
        lines += ["", "## Stages", ""] + _stage_table(verdict["stages"])
        lines += ["", "## Kernels", ""] + _kernel_table(verdict["kernels"])
        lines += ["", "## Skipped cases, by kind"] + (_skips(verdict["stages"], plan) or ["", "none"])
    for stage in verdict["stages"]:
        if stage["cases"]:
            lines += ["", f"## {stage['stage']}: {stage['status']}", "", "| case | status | detail |", "|---|---|---|"]
            lines += [f"| {c['name']} | {c['status'] + (' (' + c['skip'] + ')' if c.get('skip') else '')} | "
                      f"{_cell(c['detail'])} |" for c in stage["cases"]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0 if verdict["passed"] else 1
