"""The GPU check's wheelhouse and setup stage (``benchmarks/gpu_check/wheelhouse.py``, ``build.py``,
``setup_stage.py``), without a network or a compiler: local fake wheels and source archives, a fake
pip and a fake nvcc, and machine facts stated per case."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu_check import build, setup_stage, wheelhouse
from benchmarks.gpu_check.record import Recorder

ROOT = Path(__file__).resolve().parents[2]
GPU = {"torch": "2.11.0+cu130", "cuda": "13.0", "device": True, "sm": "90", "nvcc": "/cuda/bin/nvcc",
       "cuda_home": "/cuda", "path": "/usr/bin", "ninja": None, "cpus": 16, "bdist_wheel": None, "pip": None}


def make_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", scripts=()) -> Path:
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n"
                                                                   f"Version: {version}\n")
        for script in scripts:
            info = zipfile.ZipInfo(f"{dist}-{version}.data/scripts/{script}")
            info.external_attr = 0o100755 << 16
            archive.writestr(info, "#!/bin/sh\necho tool\n")
    return path


def make_sdist(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    path = folder / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for member, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{member}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def wheelhouse_with(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    make_wheel(folder, "demo-kernels", "1.0", scripts=("demo-tool",))
    make_sdist(folder, "mamba_ssm", "9.8.7", {"mamba_ssm/__init__.py": "import selective_scan_cuda\n",
                                              "mamba_ssm/ops/__init__.py": "", "mamba_ssm/ops/triton/__init__.py": "",
                                              "mamba_ssm/ops/triton/ssd_combined.py": "KERNEL = 'ssd'\n",
                                              "csrc/selective_scan.cpp": ""})
    make_sdist(folder, "causal_conv1d", "1.7.0", {"setup.py": "", "causal_conv1d/__init__.py": ""})
    wheelhouse.write_manifest(folder, "3.11", "manylinux_2_28_x86_64")
    return folder


# ---------------------------------------------------------------------------- the manifest
def test_the_manifest_lists_every_file_with_its_hash(tmp_path):
    folder = wheelhouse_with(tmp_path / "w")
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = {(e["name"], e["version"], e["kind"]) for e in manifest["files"]}
    assert rows == {("demo-kernels", "1.0", "wheel"), ("mamba-ssm", "9.8.7", "sdist"),
                    ("causal-conv1d", "1.7.0", "sdist")}
    assert all(re.fullmatch(r"[0-9a-f]{64}", e["sha256"]) for e in manifest["files"])
    good, problems = wheelhouse.verify(folder)
    assert len(good) == 3 and problems == []


def test_verify_names_a_changed_a_missing_and_an_unlisted_file(tmp_path):
    folder = wheelhouse_with(tmp_path / "w")
    (folder / "mamba_ssm-9.8.7.tar.gz").write_bytes(b"truncated")
    (folder / "causal_conv1d-1.7.0.tar.gz").unlink()
    make_wheel(folder, "stowaway", "0.1")
    good, problems = wheelhouse.verify(folder)
    assert [e["name"] for e in good] == ["demo-kernels"]
    assert "mamba_ssm-9.8.7.tar.gz: sha256 differs from the manifest (a changed or truncated copy)" in problems
    assert "causal_conv1d-1.7.0.tar.gz: listed in the manifest but missing" in problems
    assert "stowaway-0.1-py3-none-any.whl: not in the manifest (ignored)" in problems


def test_verify_without_a_manifest_says_how_to_make_one(tmp_path):
    good, problems = wheelhouse.verify(tmp_path)
    assert good == [] and "python -m benchmarks.gpu_check wheelhouse" in problems[0]


def test_the_wanted_versions_are_the_ones_the_interpreter_lane_checks():
    ci = (ROOT / ".ci" / "run").read_text()
    pinned = dict(re.findall(r'"([a-z0-9-]+)==([0-9a-z.]+)"', ci))
    wanted = {w.name: w.version for w in wheelhouse.WANTED}
    assert pinned["mamba-ssm"] == wanted["mamba-ssm"] and pinned["causal-conv1d"] == wanted["causal-conv1d"]
    from ssm_pack.support.requirements import strictest_minimums
    assert wanted["flash-linear-attention"] == wanted["fla-core"] == strictest_minimums()["fla"]


def test_platform_tags_take_older_glibc_levels():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "manylinux2014_x86_64"
    assert wheelhouse.platform_tags("linux_x86_64") == ["linux_x86_64"]


FAKE_PIP = """import sys, pathlib
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("--dest") + 1])
specs = [a for a in args if "==" in a]
sdist = "--no-binary=:all:" in args
for spec in specs if "{mode}" == "ok" else []:
    name, version = spec.split("==")
    dist = name.replace("-", "_")
    (dest / (f"{{dist}}-{{version}}.tar.gz" if sdist else f"{{dist}}-{{version}}-py3-none-any.whl")).write_bytes(b"x")
print(" ".join(args))
"""


@pytest.mark.parametrize("mode", ["ok", "nothing"])
def test_prepare_downloads_the_wanted_files_and_writes_the_manifest(tmp_path, mode):
    pip = tmp_path / "pip.py"
    pip.write_text(FAKE_PIP.format(mode=mode))
    folder = tmp_path / "w"
    if mode == "nothing":
        with pytest.raises(RuntimeError, match="pip reported success but .*flash-linear-attention==0.6.0"):
            wheelhouse.prepare(folder, pip=[sys.executable, str(pip)], log=lambda line: None)
        return
    lines = []
    manifest = wheelhouse.prepare(folder, "3.12", pip=[sys.executable, str(pip)], log=lines.append)
    assert {e["name"] for e in manifest["files"]} == {w.name for w in wheelhouse.WANTED}
    assert manifest["python_version"] == "3.12"
    wheels_cmd = next(line for line in lines if "--only-binary=:all:" in line)
    assert "--python-version 3.12" in wheels_cmd and "--no-deps" in wheels_cmd
    sdist_cmd = next(line for line in lines if "--no-binary=:all:" in line)
    assert "mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0" in sdist_cmd


def test_a_prebuilt_wheel_is_recorded_with_what_it_was_built_for(tmp_path):
    wheel = make_wheel(tmp_path, "causal-conv1d", "1.7.0", "cp312-cp312-linux_x86_64")
    manifest = wheelhouse.add_prebuilt(tmp_path / "w", wheel, "2.11", "13.0", "90", "3.12", "manylinux_2_28_x86_64")
    assert manifest["files"][0]["built_for"] == {"torch": "2.11", "cuda": "13.0", "sm": "90"}
    again = wheelhouse.write_manifest(tmp_path / "w", "3.12", "manylinux_2_28_x86_64")         # kept on a rewrite
    assert again["files"][0]["built_for"]["torch"] == "2.11"
    with pytest.raises(ValueError, match="--torch and --cuda take major.minor"):
        wheelhouse.add_prebuilt(tmp_path / "w", wheel, "2.11.0", "13", None, "3.12", "x")


# ---------------------------------------------------------------------------- causal-conv1d
def test_local_versions_are_read():
    assert build.local_tags("1.7.0+cu130torch2.11sm90") == {"cuda": "13", "torch": "2.11", "sm": "90"}
    assert build.local_tags("1.5.0.post8+cu12torch2.6cxx11abiTRUE") == {"cuda": "12", "torch": "2.6"}
    assert build.local_tags("1.7.0") == {}


@pytest.mark.parametrize("name, built_for, fits", [
    pytest.param("causal_conv1d-1.7.0+cu130torch2.11sm90-cp312-cp312-linux_x86_64.whl", None, None, id="fits"),
    pytest.param("causal_conv1d-1.7.0+cu13torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl", None, None,
                 id="upstream-name"),
    pytest.param("causal_conv1d-1.7.0+cu130torch2.10-cp312-cp312-linux_x86_64.whl", None, "built against torch 2.10",
                 id="other-torch"),
    pytest.param("causal_conv1d-1.7.0+cu126torch2.11-cp312-cp312-linux_x86_64.whl", None, "built against CUDA 12",
                 id="other-cuda"),
    pytest.param("causal_conv1d-1.7.0+cu130torch2.11sm100-cp312-cp312-linux_x86_64.whl", None, "compiled for sm_100",
                 id="other-device"),
    pytest.param("causal_conv1d-1.7.0+cu130torch2.11-cp311-cp311-linux_x86_64.whl", None, "not this interpreter",
                 id="other-python"),
    pytest.param("causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl", None, "--prebuilt WHEEL --torch", id="unsaid"),
    pytest.param("causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl", {"torch": "2.11", "cuda": "13.0"}, None,
                 id="manifest-says"),
])
def test_a_prebuilt_wheel_is_used_only_on_the_machine_it_was_built_for(name, built_for, fits):
    from packaging.tags import Tag
    tags = {Tag("cp312", "cp312", "linux_x86_64"), Tag("py3", "none", "any")}
    why = build.wheel_fits(name, GPU, tags, built_for)
    assert (why is None) if fits is None else (fits in why), why


@pytest.mark.parametrize("facts, dry_run, reason", [
    pytest.param({}, False, None, id="buildable"),
    pytest.param({}, True, "planned, not compiled: a dry run has no CUDA device", id="dry-run"),
    pytest.param({"device": False}, False, "no CUDA device", id="no-device"),
    pytest.param({"cuda": None}, False, "is a CPU build", id="cpu-torch"),
    pytest.param({"nvcc": None}, False, "no nvcc", id="no-nvcc"),
    pytest.param({"bdist_wheel": "No module named 'wheel'"}, False, "--extra wheel==", id="no-bdist-wheel"),
])
def test_the_build_decision_names_its_first_blocker(tmp_path, facts, dry_run, reason):
    plan = build.plan_build(tmp_path / "causal_conv1d-1.7.0.tar.gz", tmp_path, 240, {**GPU, **facts}, dry_run=dry_run)
    assert plan.reason is None if reason is None else reason in plan.reason
    assert plan.env["TORCH_CUDA_ARCH_LIST"] == "9.0" and plan.env["MAX_JOBS"] == "16"
    assert plan.env["CAUSAL_CONV1D_FORCE_BUILD"] == "TRUE"
    assert plan.env["CAUSAL_CONV1D_LOCAL_VERSION"] == ("cu<CUDA>torch2.11sm90" if "cuda" in facts else
                                                       "cu130torch2.11sm90")
    assert plan.argv[1:4] == ["-m", "pip", "wheel"] and "--no-build-isolation" in plan.argv
    assert "budget 240 s" in plan.describe()


def test_a_zero_build_budget_is_a_reason(tmp_path):
    plan = build.plan_build(tmp_path / "causal_conv1d-1.7.0.tar.gz", tmp_path, 0, GPU, dry_run=False)
    assert "the build budget is 0 s (GPU_CHECK_BUDGET_BUILD)" in plan.reason


def test_nvcc_compiles_for_the_device_alone():
    args = ["-c", "a.cu", "-gencode", "arch=compute_75,code=sm_75", "-gencode", "arch=compute_90,code=sm_90",
            "-gencode=arch=compute_100,code=sm_100", "-O3"]
    assert build.device_only(args, "90") == ["-c", "a.cu", "-O3", "-gencode", "arch=compute_90,code=sm_90"]
    assert build.device_only(["-V"], "90") == ["-V"]


BUILDERS = {
    "ok": "import os, pathlib, sys\nout = pathlib.Path(sys.argv[1])\n"
          "(out / f\"causal_conv1d-1.7.0+{os.environ['CAUSAL_CONV1D_LOCAL_VERSION']}-cp312-cp312-linux_x86_64.whl\")"
          ".write_bytes(b'wheel')\nimport subprocess\n"
          "print(subprocess.run([os.environ['CUDA_HOME'] + '/bin/nvcc', '-gencode', 'arch=compute_75,code=sm_75', "
          "'-c', 'x.cu'], capture_output=True, text=True).stdout)\n",
    "error": "print('csrc/causal_conv1d_bwd.cu(12): error: identifier undefined'); raise SystemExit(1)\n",
    "slow": "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "time.sleep(60)\n",
}


@pytest.mark.parametrize("kind", ["ok", "error", "slow"])
def test_the_build_runs_under_its_budget_with_the_device_only_nvcc(tmp_path, kind):
    real = tmp_path / "cuda"
    (real / "bin").mkdir(parents=True)
    (real / "include").mkdir()
    (real / "bin" / "nvcc").write_text("#!/bin/sh\necho \"nvcc $*\"\n")
    (real / "bin" / "nvcc").chmod(0o755)
    sdist = make_sdist(tmp_path, "causal_conv1d", "1.7.0", {"setup.py": ""})
    facts = {**GPU, "nvcc": str(real / "bin" / "nvcc"), "cuda_home": str(real), "path": os.environ["PATH"]}
    plan = build.plan_build(sdist, tmp_path / "out", 3 if kind == "slow" else 60, facts, dry_run=False)
    builder = tmp_path / "builder.py"
    builder.write_text(BUILDERS[kind])
    plan.argv = [sys.executable, str(builder), str(tmp_path / "out" / "build" / "wheels")]
    wheel, line = build.run_build(plan, facts, tmp_path / "build.log")
    log = (tmp_path / "build.log").read_text()
    if kind == "ok":
        assert wheel.name == "causal_conv1d-1.7.0+cu130torch2.11sm90-cp312-cp312-linux_x86_64.whl", line
        assert "nvcc -c x.cu -gencode arch=compute_90,code=sm_90" in log          # the shim replaced sm_75
        assert (tmp_path / "out" / "build" / "cuda" / "include").resolve() == (real / "include").resolve()
    elif kind == "error":
        assert wheel is None and "compile error (exit code 1" in line and "identifier undefined" in line
    else:
        assert wheel is None and "budget exceeded (stopped after" in line and "GPU_CHECK_BUDGET_BUILD" in line


# ---------------------------------------------------------------------------- the setup stage
def run_setup(tmp_path, wheels: Path, dry_run: bool) -> dict:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "stage", "setup", "--out", str(out), "--wheels", str(wheels),
            "--build-budget", "60"] + (["--dry-run"] if dry_run else [])
    done = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{out / 'site'}{os.pathsep}{ROOT}"},
                          capture_output=True, text=True, timeout=300)
    record = json.loads((out / "setup.json").read_text())
    return {"code": done.returncode, "out": out, "cases": {c["name"]: c for c in record["cases"]},
            "log": done.stdout + done.stderr}


def test_the_dry_run_setup_unpacks_the_wheelhouse_and_plans_the_build(tmp_path):
    result = run_setup(tmp_path, wheelhouse_with(tmp_path / "w"), dry_run=True)
    cases, site = result["cases"], result["out"] / "site"
    assert cases["wheelhouse manifest"]["status"] == "passed", result["log"]
    assert cases["demo-kernels 1.0"]["status"] == "passed" and (site / "demo_kernels" / "__init__.py").exists()
    assert os.access(site / "bin" / "demo-tool", os.X_OK)                               # a wheel's scripts, runnable
    mamba = cases["mamba-ssm 9.8.7"]
    assert mamba["status"] == "passed" and "4 Python sources" in mamba["detail"]
    assert (site / "mamba_ssm-9.8.7.dist-info" / "METADATA").exists() and not (site / "csrc").exists()
    conv = cases["causal-conv1d"]
    assert conv["status"] == "skipped" and conv["skip"] == "not applicable", conv
    assert "planned, not compiled: a dry run has no CUDA device" in conv["detail"]
    assert "the build would run: CAUSAL_CONV1D_FORCE_BUILD=TRUE" in conv["detail"]
    assert (result["out"] / "build" / "src" / "causal_conv1d-1.7.0" / "setup.py").exists()
    assert "packages the kernels import" in cases


def test_a_wheelhouse_that_fails_its_manifest_fails_the_setup(tmp_path):
    folder = wheelhouse_with(tmp_path / "w")
    (folder / "manifest.json").unlink()
    result = run_setup(tmp_path, folder, dry_run=True)
    assert result["code"] == 1
    assert result["cases"]["wheelhouse manifest"]["status"] == "failed"


@pytest.fixture
def conv_setup(tmp_path, monkeypatch):
    """``setup_stage._causal_conv1d`` on a stated GPU machine; returns a runner giving the recorded case."""
    def run(facts, wheels=(), sdist=True, imports=(None,), builds=None):
        out = tmp_path / "out"
        (out / "site").mkdir(parents=True, exist_ok=True)
        monkeypatch.setattr(build, "machine_facts", lambda extra_bin=None: {**GPU, **facts})
        answers = iter(imports)
        monkeypatch.setattr(setup_stage, "extension_import_error", lambda site: next(answers))
        monkeypatch.setattr(build, "run_build", builds or (lambda plan, facts, log: (None, "not built: test")))
        entries = [{"kind": "sdist", "name": "causal-conv1d", "file": "causal_conv1d-1.7.0.tar.gz"}] if sdist else []
        make_sdist(tmp_path, "causal_conv1d", "1.7.0", {"setup.py": ""})
        recorder = Recorder(out, "setup", {})
        args = SimpleNamespace(out=str(out), wheels=str(tmp_path), dry_run=False, build_budget=240.0)
        from packaging.tags import Tag
        tags = {Tag("cp312", "cp312", "linux_x86_64")}
        conv_wheels = [(make_wheel(tmp_path, "causal-conv1d", version, "cp312-cp312-linux_x86_64"), None)
                       for version in wheels]
        setup_stage._causal_conv1d(recorder, args, entries, conv_wheels, out / "site", tags)
        return recorder.data["cases"][-1]
    return run


def test_setup_takes_a_fitting_prebuilt_wheel(conv_setup):
    case = conv_setup({}, wheels=["1.7.0+cu130torch2.10", "1.7.0+cu130torch2.11"])
    assert case["status"] == "passed" and "prebuilt causal_conv1d-1.7.0+cu130torch2.11" in case["detail"]
    assert "built against torch 2.10, this machine has torch 2.11" in case["detail"]


def test_setup_builds_when_the_prebuilt_extension_does_not_import(conv_setup, tmp_path):
    case = conv_setup({}, wheels=["1.7.0+cu130torch2.11"], imports=["undefined symbol: _ZN3c10"])
    assert case["status"] == "skipped" and case["skip"] == "unavailable"
    assert case["detail"].startswith("skipped: not built: test; prebuilt wheels: ")
    assert "causal_conv1d-1.7.0+cu130torch2.11-cp312-cp312-linux_x86_64.whl: its extension does not import " \
           "(undefined symbol: _ZN3c10): removed" in case["detail"]
    assert not list((tmp_path / "out" / "site").glob("causal_conv1d*"))          # the broken copy is gone


def test_setup_without_nvcc_skips_causal_conv1d_saying_why(conv_setup):
    case = conv_setup({"nvcc": None})
    assert case["status"] == "skipped" and case["skip"] == "unavailable" and case["kernels"] == ["causal_conv1d"]
    assert "not compiled: no nvcc" in case["detail"] and "the build would run:" in case["detail"]


def test_setup_without_any_causal_conv1d_says_so(conv_setup):
    case = conv_setup({}, sdist=False)
    assert case["skip"] == "unavailable"
    assert "neither a causal-conv1d wheel that fits this machine nor its source archive" in case["detail"]


def test_setup_unpacks_what_it_built(conv_setup, tmp_path):
    def built(plan, facts, log):
        return make_wheel(tmp_path, "causal-conv1d", "1.7.0+cu130torch2.11sm90", "cp312-cp312-linux_x86_64"), "built"
    case = conv_setup({}, builds=built)
    assert case["status"] == "passed" and case["detail"].startswith("built;")
    assert (tmp_path / "out" / "site" / "causal_conv1d" / "__init__.py").exists()
