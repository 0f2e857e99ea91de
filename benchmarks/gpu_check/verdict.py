"""The rules of the GPU check's result, as pure functions of the plan, the runner's stage rows and the
stage records (so the tests state every case without running a stage).

A stage passes when it was run, exited 0 within its limit, recorded at least one case, and none of
its cases failed or was skipped for a missing kernel that this run expects (:func:`.plan.expectation`).
A kernel that this run expects fails when the kernels stage found it unavailable, or when the
correctness stage ran cases on it and none passed. The check passes when at least one stage ran,
every selected stage passed and no expected kernel failed; anything else, including an empty
output folder, is FAILED.
"""

from __future__ import annotations

from .plan import EXPECTED, STAGES, Plan, expectation

PASSED, FAILED, NOT_SELECTED = "passed", "failed", "not selected"


def blocking_skips(cases, plan: Plan) -> list[dict]:
    """The ``unavailable`` skips among ``cases`` that name a kernel this run expects."""
    return [c for c in cases if c.get("skip") == "unavailable"
            and any(expectation(k, plan.dry_run, plan.allow_skip)[0] == EXPECTED for k in c.get("missing") or ())]


def stage_status(plan: Plan, stage: str, row: dict | None, record: dict | None) -> tuple[str, str]:
    """``(PASSED | FAILED | NOT_SELECTED, why)`` of one stage."""
    if not plan.selected(stage):
        return NOT_SELECTED, plan.why_not(stage)
    if row is None:
        return FAILED, "did not run: the run stopped before this stage"
    if row.get("note"):
        return FAILED, row["note"]
    code = row.get("exit_code")
    if row.get("timed_out"):
        return FAILED, f"stopped by its limit ({row['limit_s']:g} s{row.get('limit_note', '')})"
    if record is None:
        return FAILED, f"wrote no record (exit code {code}): see {stage}.log"
    cases = record.get("cases") or []
    if not cases:
        return FAILED, f"recorded no case (exit code {code})" + (
            f"; cases filter {plan.cases!r}" if plan.cases and stage in ("correctness", "speed") else "")
    failed = [c["name"] for c in cases if c["status"] == "failed"]
    blocking = [c["name"] for c in blocking_skips(cases, plan)]
    problems = ([f"exit code {code}"] if code != 0 else []) + ([f"{len(failed)} failed: {failed}"] if failed else [])
    if blocking:
        problems.append(f"{len(blocking)} skipped for a kernel that should run here: {blocking}")
    return (FAILED, "; ".join(problems)) if problems else (PASSED, "")


def kernel_rows(plan: Plan, records: dict) -> list[dict]:
    """One row per kernel of the table: what this run expected, what the kernels stage found, which
    correctness cases ran on it, and the verdict (``ran`` / ``FAILED`` / a neutral word)."""
    from ssm_pack.support.requirements import KERNELS
    found = {c["kernels"][0]: c for c in (records.get("kernels") or {}).get("cases", []) if c.get("kernels")}
    correctness = records.get("correctness")
    rows = []
    for name, kernel in KERNELS.items():
        kind, why = expectation(name, plan.dry_run, plan.allow_skip)
        own = [c for c in (correctness or {}).get("cases", []) if c.get("kernels") == [name]]
        ran = [c["name"] for c in own if c["status"] == "passed"]
        stage_case = found.get(name)
        available = None if stage_case is None else stage_case["status"] == "passed"
        detail = "" if stage_case is None else stage_case["detail"].removeprefix("skipped: ")
        if stage_case is not None and stage_case.get("skip"):
            detail = f"{stage_case['skip']}: {detail}"
        row = {"kernel": name, "label": kernel.label, "expected": kind, "why": why, "available": available,
               "available_detail": detail, "ran": ran, "cases": len(own)}
        row["verdict"], row["reason"] = _kernel_verdict(kind, why, available, row, own, correctness is not None, plan)
        rows.append(row)
    return rows


def _kernel_verdict(kind, why, available, row, own, correctness_ran, plan) -> tuple[str, str]:
    if row["ran"]:
        return ("ran", f"{len(row['ran'])} of {len(own)} correctness case(s) passed"
                + ("" if kind == EXPECTED else f" ({why})"))
    if kind != EXPECTED:
        return kind, why
    if available is False:
        return FAILED, f"should run here but the kernels stage found it {row['available_detail']}"
    if correctness_ran and own:
        reasons = sorted({c["detail"] for c in own})
        return FAILED, f"should run here but none of its {len(own)} correctness case(s) passed: {reasons[0]}"
    if correctness_ran and plan.cases:
        return "no case", f"no correctness case selected (cases filter {plan.cases!r})"
    if correctness_ran:
        return FAILED, "should run here but the correctness stage recorded no case on it (stopped before them?)"
    if available:
        return "available", "available (the correctness stage did not run)"
    return "not checked", "neither the kernels nor the correctness stage ran"


def result(plan: Plan | None, rows: list[dict], records: dict) -> dict:
    """``{"passed": bool, "reasons": [...], "stages": [...], "kernels": [...]}`` for the whole run."""
    if plan is None:
        return {"passed": False, "reasons": ["no plan.json: no GPU check ran in this folder"], "stages": [],
                "kernels": []}
    by_name = {r["stage"]: r for r in rows}
    stages = []
    for stage in STAGES:
        status, why = stage_status(plan, stage, by_name.get(stage), records.get(stage))
        row = by_name.get(stage) or {}
        stages.append({"stage": stage, "status": status, "why": why, "exit_code": row.get("exit_code"),
                       "seconds": row.get("seconds"), "limit_s": row.get("limit_s"),
                       "cases": (records.get(stage) or {}).get("cases", [])})
    kernels = kernel_rows(plan, records)
    reasons = [f"stage {s['stage']} failed: {s['why']}" for s in stages if s["status"] == FAILED]
    reasons += [f"kernel {k['kernel']}: {k['reason']}" for k in kernels if k["verdict"] == FAILED]
    ran = [s for s in stages if s["status"] != NOT_SELECTED and by_name.get(s["stage"])]
    if not ran:
        reasons.insert(0, "no stage ran")
    return {"passed": not reasons, "reasons": reasons, "stages": stages, "kernels": kernels}
