"""The GPU check's report never says "passed" (nor exits 0) when no stage recorded anything: whatever
the plan selected, a run that left no stage record is FAILED, through ``summarise`` and through
``python -m benchmarks.gpu_check summary OUT``."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_check.__main__ import main
from benchmarks.gpu_check.plan import Plan
from benchmarks.gpu_check.report import summarise

PLANS = [
    pytest.param(dict(stages=("setup",)), [], id="only-setup-without-wheelhouse"),
    pytest.param(dict(stages=("support", "kernels")), [], id="selected-never-started"),
    pytest.param(dict(stages=("correctness",)),
                 [{"stage": "correctness", "exit_code": 0, "seconds": 1.0, "limit_s": 60.0, "timed_out": False}],
                 id="exit-0-without-record"),
    pytest.param(dict(dry_run=True), [], id="dry-run-every-stage"),
]


def _folder(tmp_path, plan_kwargs, rows):
    out = tmp_path / "out"
    out.mkdir()
    Plan(out=str(out), **plan_kwargs).write()
    (out / "stages.json").write_text(json.dumps(rows))
    return out


@pytest.mark.parametrize("plan_kwargs,rows", PLANS)
def test_no_stage_record_is_failed(tmp_path, plan_kwargs, rows):
    out = _folder(tmp_path, plan_kwargs, rows)
    assert summarise(out) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["result"] == "FAILED" and report["passed"] is False and report["reasons"]
    summary = (out / "summary.md").read_text()
    assert "Result: FAILED" in summary and "Result: passed" not in summary


@pytest.mark.parametrize("plan_kwargs,rows", PLANS)
def test_the_summary_command_exits_non_zero(tmp_path, plan_kwargs, rows):
    out = _folder(tmp_path, plan_kwargs, rows)
    assert main(["summary", str(out)]) == 1


def test_a_recorded_stage_can_pass(tmp_path):
    """Negative control: the same kind of folder with the stage's record passes (exit 0)."""
    out = _folder(tmp_path, dict(stages=("support",)),
                  [{"stage": "support", "exit_code": 0, "seconds": 1.0, "limit_s": 60.0, "timed_out": False}])
    case = {"name": "python -m ssm_pack", "status": "passed", "detail": "ok", "figures": {}, "seconds": 0.1,
            "kernels": [], "skip": None, "missing": []}
    (out / "support.json").write_text(json.dumps({"stage": "support", "context": {}, "cases": [case]}))
    assert main(["summary", str(out)]) == 0
    assert "Result: passed" in (out / "summary.md").read_text()
