"""The GPU check's result (``benchmarks/gpu_check/verdict.py``, ``report.py``, ``plan.py``): a check
that cannot pass empty. Each case writes the records a run would leave in ``OUT`` and asks for the
summary, so every rule is pinned without running a stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_check import plan as plan_mod
from benchmarks.gpu_check.plan import STAGES, Plan
from benchmarks.gpu_check.report import summarise
from ssm_pack.support.requirements import KERNELS

TRITON = [k for k, v in KERNELS.items() if v.triton]
CUDA_ONLY = [k for k, v in KERNELS.items() if not v.triton]


def case(name, status="passed", kernels=(), skip=None, missing=(), detail=""):
    missing = list(missing) or (list(kernels) if skip == "unavailable" else [])
    return {"name": name, "status": status, "detail": detail or (f"skipped: {name}" if skip else "ok"),
            "figures": {}, "seconds": 0.1, "kernels": list(kernels), "skip": skip, "missing": missing}


def kernels_record(unavailable=(), dry_run=False):
    cases = []
    for name, kernel in KERNELS.items():
        if name in unavailable:
            kind = "not applicable" if dry_run and not kernel.triton else "unavailable"
            cases.append(case(f"{name}: {kernel.label}", "skipped", (name,), kind, detail=f"skipped: {name} missing"))
        else:
            cases.append(case(f"{name}: {kernel.label}", "passed", (name,)))
    return cases


def correctness_record(skipped=(), dry_run=False):
    cases = []
    for name, kernel in KERNELS.items():
        if name in skipped or (dry_run and not kernel.triton):
            kind = "not applicable" if dry_run and not kernel.triton else "unavailable"
            cases.append(case(f"{name} packed", "skipped", (name,), kind))
        else:
            cases.append(case(f"{name} packed", "passed", (name,)))
    return cases


def write_run(out, plan: Plan | None, records: dict, rows=None):
    """``OUT`` as the runner leaves it: plan.json, stages.json, one record per stage."""
    out.mkdir(parents=True, exist_ok=True)
    if plan is not None:
        plan.out = str(out)
        plan.write()
    if rows is None:
        rows = [{"stage": s, "exit_code": 0, "seconds": 1.0, "limit_s": 60.0, "timed_out": False} for s in records]
    (out / "stages.json").write_text(json.dumps(rows))
    for stage, cases in records.items():
        if cases is not None:
            (out / f"{stage}.json").write_text(json.dumps({"stage": stage, "context": {}, "cases": cases}))
    code = summarise(out)
    return code, json.loads((out / "gpu_check.json").read_text()), (out / "summary.md").read_text()


def full(unavailable=(), dry_run=False):
    return {"support": [case("python -m ssm_pack")], "kernels": kernels_record(unavailable, dry_run),
            "correctness": correctness_record(unavailable, dry_run), "speed": [case("a layer, packed vs padded")]}


GPU = dict(stages=("support", "kernels", "correctness", "speed"))


def test_an_empty_folder_is_failed(tmp_path):
    """No plan, no stage recorded: FAILED and exit code 1, never "passed"."""
    code, report, summary = write_run(tmp_path / "out", None, {})
    assert code == 1 and report["result"] == "FAILED" and report["passed"] is False
    assert "Result: FAILED" in summary and "no plan.json" in summary


def test_a_plan_without_any_recorded_stage_is_failed(tmp_path):
    code, report, summary = write_run(tmp_path / "out", Plan(out="", **GPU), {}, rows=[])
    assert code == 1 and "Result: FAILED" in summary
    assert "- no stage ran" in summary
    assert {s["stage"]: s["why"] for s in report["stages"]}["correctness"].startswith("did not run")


def test_every_kernel_ran_passes(tmp_path):
    code, report, summary = write_run(tmp_path / "out", Plan(out="", **GPU), full())
    assert code == 0 and report["passed"], report["reasons"]
    assert summary.startswith("# GPU check\n\nResult: passed (partial: stages support,kernels,correctness,speed only)")
    assert all(k["verdict"] == "ran" for k in report["kernels"])
    assert "| setup | not selected |" in summary


@pytest.mark.parametrize("missing", [pytest.param(["flash_attn"], id="flash-attn"),
                                     pytest.param(["mamba_ssd", "mamba_decode", "fla"], id="triton-kernels")])
def test_a_kernel_that_should_run_and_did_not_fails_unless_allowed(tmp_path, missing):
    code, report, summary = write_run(tmp_path / "strict", Plan(out="", **GPU), full(missing))
    assert code == 1 and "Result: FAILED" in summary
    verdicts = {k["kernel"]: k for k in report["kernels"]}
    for name in missing:
        assert verdicts[name]["verdict"] == "failed" and "should run here" in verdicts[name]["reason"]
        assert f"- kernel {name}: should run here but the kernels stage found it unavailable" in summary
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["correctness"]["status"] == "failed" and "skipped for a kernel that should run here" in \
        stages["correctness"]["why"]

    code, report, summary = write_run(tmp_path / "allowed", Plan(out="", allow_skip=missing, **GPU), full(missing))
    assert code == 0 and report["passed"], report["reasons"]
    assert f"- allowed to skip: {', '.join(sorted(missing))}" in summary
    assert {k["kernel"]: k["verdict"] for k in report["kernels"] if k["kernel"] in missing} == \
        {name: "allowed" for name in missing}


def test_a_dry_run_needs_the_triton_kernels_and_not_the_cuda_ones(tmp_path):
    dry = Plan(out="", dry_run=True, **GPU)
    code, report, summary = write_run(tmp_path / "ok", dry, full(CUDA_ONLY, dry_run=True))
    assert code == 0, report["reasons"]
    rows = {k["kernel"]: k for k in report["kernels"]}
    for name in CUDA_ONLY:
        assert rows[name]["verdict"] == "not applicable" and "not applicable in a dry run" in rows[name]["reason"]
    code, report, _ = write_run(tmp_path / "no-fla", Plan(out="", dry_run=True, **GPU),
                                full(CUDA_ONLY + ["fla", "fla_conv"], dry_run=True))
    assert code == 1
    assert {k["kernel"] for k in report["kernels"] if k["verdict"] == "failed"} == {"fla", "fla_conv"}


def test_a_stage_with_no_case_fails(tmp_path):
    records = full()
    records["speed"] = []
    code, report, _ = write_run(tmp_path / "out", Plan(out="", **GPU), records)
    assert code == 1
    assert {s["stage"]: s["why"] for s in report["stages"]}["speed"].startswith("recorded no case")


def test_a_stage_without_its_record_or_stopped_by_its_limit_fails(tmp_path):
    records = full()
    records["speed"] = None                                         # crashed before writing anything
    rows = [{"stage": s, "exit_code": 0, "seconds": 1.0, "limit_s": 60.0, "timed_out": False} for s in records]
    rows[2].update(exit_code=124, timed_out=True, limit_note=": what was left of GPU_CHECK_BUDGET_TOTAL")
    code, report, _ = write_run(tmp_path / "out", Plan(out="", **GPU), records, rows)
    why = {s["stage"]: s["why"] for s in report["stages"]}
    assert code == 1
    assert why["correctness"] == "stopped by its limit (60 s: what was left of GPU_CHECK_BUDGET_TOTAL)"
    assert why["speed"].startswith("wrote no record")


def test_a_stage_not_run_for_lack_of_total_budget_fails(tmp_path):
    records = full()
    rows = [{"stage": s, "exit_code": 0, "seconds": 1.0, "limit_s": 60.0, "timed_out": False} for s in records]
    rows[-1] = {"stage": "speed", "exit_code": None, "seconds": 0.0, "limit_s": 0.0,
                "note": "not run: the total budget (480 s, GPU_CHECK_BUDGET_TOTAL) was spent"}
    code, report, summary = write_run(tmp_path / "out", Plan(out="", **GPU), records, rows)
    assert code == 1 and "stage speed failed: not run: the total budget (480 s" in summary


def test_a_kernel_whose_correctness_cases_all_skipped_fails_even_if_the_kernels_stage_found_it(tmp_path):
    records = full()
    records["correctness"] = [c if c["kernels"] != ["fla"] else
                              case("fla packed", "skipped", ("fla",), "refused", detail="skipped: fp32 refused")
                              for c in records["correctness"]]
    code, report, _ = write_run(tmp_path / "out", Plan(out="", **GPU), records)
    row = {k["kernel"]: k for k in report["kernels"]}["fla"]
    assert code == 1 and row["verdict"] == "failed" and "none of its 1 correctness case(s) passed" in row["reason"]


def test_an_unavailable_skip_counts_only_against_the_kernels_it_lacked(tmp_path):
    """A model case skipped on a dry run because attention has no CUDA device does not fail it; the
    same case lacking mamba-ssm does."""
    dry = dict(dry_run=True, **GPU)
    for missing, expected in ((["torch_varlen", "flash_attn"], 0), (["torch_varlen", "mamba_ssd"], 1)):
        records = full(CUDA_ONLY, dry_run=True)
        records["correctness"].append(case("HybridLM step", "skipped", list(KERNELS), "unavailable", missing))
        code, report, summary = write_run(tmp_path / "-".join(missing), Plan(out="", **dry), records)
        assert code == expected, report["reasons"]
    assert "(missing: torch_varlen (not applicable), mamba_ssd (expected))" in summary


def test_the_summary_states_stages_kernels_skips_and_the_run(tmp_path):
    plan = Plan(out="", dry_run=True, wheels="/w", allow_skip=["mamba_ssd"], cases="conv", **GPU)
    records = full(CUDA_ONLY + ["mamba_ssd"], dry_run=True)
    _, report, summary = write_run(tmp_path / "out", plan, records)
    for line in ("Result: passed (partial: stages support,kernels,correctness,speed only; cases matching 'conv' "
                 "only)", "- run: dry run (CPU, Triton interpreter)", "- wheelhouse: /w",
                 "- allowed to skip: mamba_ssd", "- cases filter: conv", "## Stages", "## Kernels",
                 "## Skipped cases, by kind", "### not applicable", "### unavailable", "| mamba_ssd | allowed |",
                 "| causal_conv1d | not applicable |",
                 "| fla | expected | available | 1 of 1 | ran: 1 of 1 correctness case(s) passed |"):
        assert line in summary, line
    assert "budgets (GPU_CHECK_BUDGET_<NAME> seconds): setup 120 s; build 0 s;" in summary
    assert report["plan"]["allow_skip"] == ["mamba_ssd"]


def test_budgets_read_the_environment_and_refuse_nonsense():
    assert plan_mod.budgets(False, {})["correctness"] == plan_mod.BUDGETS["correctness"][0]
    assert plan_mod.budgets(True, {})["correctness"] == plan_mod.BUDGETS["correctness"][1]
    assert plan_mod.budgets(False, {"GPU_CHECK_BUDGET_CORRECTNESS": "600"})["correctness"] == 600.0
    with pytest.raises(ValueError, match="GPU_CHECK_BUDGET_BUILD must be a number of seconds >= 0, got 'soon'"):
        plan_mod.budgets(False, {"GPU_CHECK_BUDGET_BUILD": "soon"})
    with pytest.raises(ValueError, match="GPU_CHECK_BUDGET_TOTAL"):
        plan_mod.budgets(False, {"GPU_CHECK_BUDGET_TOTAL": "-1"})


def test_the_gpu_budgets_fit_the_lent_machine():
    """The whole GPU run is capped at 8 minutes; no stage alone may exceed the cap."""
    gpu = plan_mod.budgets(False, {})
    assert gpu["total"] <= 480
    assert all(gpu[s] <= gpu["total"] for s in STAGES)


@pytest.mark.parametrize("text, expected", [
    pytest.param("", STAGES, id="default-all"),
    pytest.param("correctness", ("correctness",), id="one"),
    pytest.param("speed, setup", ("setup", "speed"), id="run-order"),
])
def test_stages_are_parsed_in_run_order(text, expected):
    assert plan_mod.parse_stages(text) == expected


def test_unknown_stage_or_kernel_names_the_choices():
    with pytest.raises(ValueError, match="unknown stage.*'speedy'.*choose from setup,support"):
        plan_mod.parse_stages("speedy")
    assert plan_mod.parse_allow_skip(["flash_attn", "causal_conv1d,fla", ""]) == {"flash_attn", "causal_conv1d", "fla"}
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['flash-attn'\]; the kernel table has"):
        plan_mod.parse_allow_skip(["flash-attn"])


def test_expectations():
    assert plan_mod.expectation("flash_attn", True, ())[0] == "not applicable"
    assert plan_mod.expectation("flash_attn", True, ("flash_attn",))[0] == "not applicable"
    assert plan_mod.expectation("flash_attn", False, ("flash_attn",))[0] == "allowed"
    assert all(plan_mod.expectation(k, True, ())[0] == "expected" for k in TRITON)
    assert all(plan_mod.expectation(k, False, ())[0] == "expected" for k in KERNELS)


def test_the_docs_state_the_budgets_the_check_uses():
    page = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ")}
    for stage in STAGES:
        gpu, dry, _ = plan_mod.BUDGETS[stage]
        assert f"| {gpu} s" in rows[stage] and f"({dry} s" in rows[stage], rows[stage]
    assert f"+ build {plan_mod.BUDGETS['build'][0]} s" in rows["setup"]
    assert f"`TOTAL` ({plan_mod.BUDGETS['total'][0]} s on a GPU)" in page
