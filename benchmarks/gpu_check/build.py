"""causal-conv1d for the GPU check: a prebuilt wheel for this Python and torch, else its source
archive compiled with nvcc for this device only, within a budget, else a line saying exactly why not.

A prebuilt wheel matches when its tags fit this interpreter and its local version names the torch
(major.minor) and CUDA (major) it was built against, as upstream's release wheels do
(``1.7.0+cu13torch2.11cxx11abiTRUE``) and as :func:`run_build` names its own
(``1.7.0+cu130torch2.11sm90``); one that does not say is refused (an extension built against
another torch fails at import, or worse). ``OUT/build/wheels`` is searched too, so a second run
with the same OUT_DIR reuses what the first compiled.

The build: ``pip wheel --no-build-isolation --no-deps --no-index`` of the unpacked archive with
``CAUSAL_CONV1D_FORCE_BUILD=TRUE`` (no download attempt), ``MAX_JOBS`` = the CPU count,
``TORCH_CUDA_ARCH_LIST`` = this device's capability, under a timeout that kills the whole process
group. causal-conv1d's ``setup.py`` passes its own ``-gencode`` list (nine architectures for nvcc
13), and torch ignores ``TORCH_CUDA_ARCH_LIST`` when a build passes arch flags, so ``CUDA_HOME``
points at a copy of the toolkit whose ``bin/nvcc`` (:func:`nvcc_shim_main`) keeps only this
device's architecture: one ninth of the compile.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST = "causal-conv1d"
TAIL_LINES = 25


# ---------------------------------------------------------------------------- prebuilt wheels
def local_tags(version: str) -> dict:
    """``{"cuda": "13", "torch": "2.11", "sm": "90"}`` from a local version (``1.7.0+cu130torch2.11sm90``;
    upstream's ``+cu12torch2.6cxx11abiTRUE``); a key is absent when the version does not say."""
    local = version.partition("+")[2].lower()
    tags = {}
    if m := re.search(r"cu(\d+)", local):
        digits = m[1]
        tags["cuda"] = digits if len(digits) <= 2 else digits[:-1]        # cu130 -> 13, cu12 -> 12
    if m := re.search(r"torch(\d+)\.(\d+)", local):
        tags["torch"] = f"{m[1]}.{m[2]}"
    if m := re.search(r"sm(\d+)", local):
        tags["sm"] = m[1]
    return tags


def wheel_fits(name: str, machine: dict, supported_tags, built_for: dict | None = None) -> str | None:
    """``None`` when the causal-conv1d wheel ``name`` fits ``machine`` (``torch``, ``cuda``, ``sm``),
    else why not. What it was built for comes from the manifest (``built_for``) or its local version."""
    from packaging.utils import parse_wheel_filename
    _, version, _, tags = parse_wheel_filename(name)
    if not set(tags) & set(supported_tags):
        return f"built for {sorted(str(t) for t in tags)}, not this interpreter"
    said = local_tags(str(version))
    if built_for:
        said = {"torch": built_for["torch"], "cuda": built_for["cuda"].split(".")[0],
                **({"sm": built_for["sm"]} if built_for.get("sm") else {})}
    torch_mm = ".".join(machine["torch"].split("+")[0].split(".")[:2])
    cuda_major = (machine.get("cuda") or "").split(".")[0]
    if "torch" not in said or "cuda" not in said:
        return ("neither its version (e.g. +cu130torch2.11) nor the manifest names the torch / CUDA it was built "
                "against; add it with `python -m benchmarks.gpu_check wheelhouse DIR --prebuilt WHEEL --torch 2.11 "
                "--cuda 13.0`")
    if said["torch"] != torch_mm:
        return f"built against torch {said['torch']}, this machine has torch {torch_mm}"
    if said["cuda"] != cuda_major:
        return f"built against CUDA {said['cuda']}, this torch is built with CUDA {machine.get('cuda')}"
    if "sm" in said and machine.get("sm") and said["sm"] != machine["sm"]:
        return f"compiled for sm_{said['sm']}, this device is sm_{machine['sm']}"
    return None


def pick_prebuilt(wheels, machine: dict, supported_tags) -> tuple[Path | None, list[str]]:
    """The first causal-conv1d wheel of ``wheels`` (``(path, built_for or None)`` pairs) that fits,
    and one line per wheel looked at."""
    lines = []
    for path, built_for in wheels:
        why = wheel_fits(Path(path).name, machine, supported_tags, built_for)
        lines.append(f"{Path(path).name}: " + ("fits this machine" if why is None else f"not used: {why}"))
        if why is None:
            return Path(path), lines
    return None, lines


# ---------------------------------------------------------------------------- the build plan
def machine_facts(extra_bin: Path | None = None) -> dict:
    """What the build decision reads from this machine (a dict, so tests can state another machine);
    ``extra_bin`` (``OUT/site/bin``: the wheelhouse's ninja) goes first on the build's ``PATH``."""
    import torch
    path = os.pathsep.join(([str(extra_bin)] if extra_bin else []) + [os.environ.get("PATH", "")])
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.is_available(),
             "sm": None, "nvcc": None, "cuda_home": None, "path": path, "ninja": shutil.which("ninja", path=path),
             "cpus": os.cpu_count() or 1, "bdist_wheel": _bdist_wheel_error(), "pip": _module_error("pip")}
    if facts["device"]:
        major, minor = torch.cuda.get_device_capability(0)
        facts["sm"] = f"{major}{minor}"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        try:
            from torch.utils.cpp_extension import CUDA_HOME
            home = CUDA_HOME
        except Exception:  # noqa: BLE001 - a broken cpp_extension is reported as no CUDA home
            home = None
    for candidate in [home, "/usr/local/cuda"]:
        if candidate and Path(candidate, "bin", "nvcc").exists():
            facts["cuda_home"], facts["nvcc"] = str(candidate), str(Path(candidate, "bin", "nvcc"))
            break
    return facts


def _module_error(module: str) -> str | None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def _bdist_wheel_error() -> str | None:
    return _module_error("setuptools; from wheel.bdist_wheel import bdist_wheel")


@dataclass
class BuildPlan:
    """What the setup stage will do with causal-conv1d's source archive, and why."""

    sdist: Path
    out: Path
    budget: float
    reason: str | None = None            # None: it can be built here
    arch: str | None = None              # "9.0"
    env: dict = field(default_factory=dict)
    argv: list = field(default_factory=list)

    @property
    def buildable(self) -> bool:
        return self.reason is None

    ninja: str | None = None

    def describe(self) -> str:
        command = " ".join(self.argv)
        variables = " ".join(f"{k}={v}" for k, v in self.env.items())
        files = f"ninja {self.ninja}: files in parallel" if self.ninja else "no ninja: one file after another"
        return f"{variables} {command} (budget {self.budget:g} s, GPU_CHECK_BUDGET_BUILD; {files})"


def plan_build(sdist: Path, out: Path, budget: float, facts: dict, *, dry_run: bool) -> BuildPlan:
    """The build of ``sdist`` under ``out/build``, or the reason it cannot run here (first blocker)."""
    build = Path(out) / "build"
    version = sdist.name[len("causal_conv1d-"):].removesuffix(".tar.gz").removesuffix(".zip")
    sm = facts.get("sm")
    torch_mm = ".".join(str(facts["torch"]).split("+")[0].split(".")[:2])
    cuda = (str(facts.get("cuda") or "0.0") + ".0").split(".")
    plan = BuildPlan(sdist, Path(out), budget, arch=f"{sm[:-1]}.{sm[-1]}" if sm else "<the device's capability>",
                     ninja=facts.get("ninja"))
    plan.env = {"CAUSAL_CONV1D_FORCE_BUILD": "TRUE", "TORCH_CUDA_ARCH_LIST": plan.arch,
                "MAX_JOBS": str(facts.get("cpus") or 1), "CUDA_HOME": str(build / "cuda"),
                "CAUSAL_CONV1D_LOCAL_VERSION": (f"cu{cuda[0]}{cuda[1]}" if facts.get("cuda") else "cu<CUDA>")
                                               + f"torch{torch_mm}" + (f"sm{sm}" if sm else "")}
    source = build / "src" / f"causal_conv1d-{version}"
    if facts.get("pip") is None:
        plan.argv = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                     "--wheel-dir", str(build / "wheels"), str(source)]
    else:
        plan.argv = [sys.executable, "setup.py", "bdist_wheel", "--dist-dir", str(build / "wheels")]
    plan.reason = _blocker(facts, budget, dry_run)
    return plan


def _blocker(facts: dict, budget: float, dry_run: bool) -> str | None:
    if dry_run:
        return "planned, not compiled: a dry run has no CUDA device to compile for"
    if not facts.get("device"):
        return "not compiled: no CUDA device (torch.cuda.is_available() is False)"
    if not facts.get("cuda"):
        return f"not compiled: torch {facts['torch']} is a CPU build (torch.version.cuda is None)"
    if not facts.get("nvcc"):
        return "not compiled: no nvcc (CUDA_HOME / CUDA_PATH unset or without bin/nvcc, no /usr/local/cuda/bin/nvcc)"
    if budget <= 0:
        return "not compiled: the build budget is 0 s (GPU_CHECK_BUDGET_BUILD)"
    if facts.get("bdist_wheel") is not None:
        return (f"not compiled: setuptools' bdist_wheel does not import ({facts['bdist_wheel']}); carry a wheel "
                "of the `wheel` package: python -m benchmarks.gpu_check wheelhouse DIR --extra wheel==0.45.1")
    return None


# ---------------------------------------------------------------------------- the build
def device_only(args: list[str], sm: str) -> list[str]:
    """nvcc's arguments with every ``-gencode`` replaced by one for ``sm_<sm>`` (kept as they are when
    the call compiles nothing: no ``-gencode`` given)."""
    out, found, skip = [], False, False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "-gencode" and i + 1 < len(args):
            found, skip = True, True
            continue
        if arg.startswith(("-gencode=", "--generate-code=")):
            found = True
            continue
        out.append(arg)
    return out + (["-gencode", f"arch=compute_{sm},code=sm_{sm}"] if found else [])


def nvcc_shim_main(real: str, sm: str) -> None:
    """``bin/nvcc`` of the build's CUDA_HOME: the real nvcc with :func:`device_only` arguments."""
    os.execv(real, [real] + device_only(sys.argv[1:], sm))


def write_cuda_home(home: Path, real_home: str, sm: str) -> Path:
    """``home``: the real toolkit's folders linked, and a ``bin/nvcc`` that compiles for ``sm`` only."""
    if home.exists():
        shutil.rmtree(home)
    (home / "bin").mkdir(parents=True)
    for entry in Path(real_home).iterdir():
        if entry.name != "bin":
            (home / entry.name).symlink_to(entry)
    for tool in (Path(real_home) / "bin").iterdir():
        if tool.name != "nvcc":
            (home / "bin" / tool.name).symlink_to(tool)
    shim = home / "bin" / "nvcc"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                    "from benchmarks.gpu_check.build import nvcc_shim_main\n"
                    f"nvcc_shim_main({str(Path(real_home) / 'bin' / 'nvcc')!r}, {sm!r})\n")
    shim.chmod(0o755)
    return shim


def unpack_sdist(sdist: Path, into: Path) -> Path:
    """The archive's top folder under ``into`` (emptied first)."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):           # Python >= 3.11.4 / 3.12: no links out of the folder
            archive.extractall(into, filter="data")
        else:
            archive.extractall(into)
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ValueError(f"{sdist.name}: expected one top folder, found {[p.name for p in tops]}")
    return tops[0]


def run_build(plan: BuildPlan, facts: dict, log: Path) -> tuple[Path | None, str]:
    """Compile per ``plan`` (only when ``plan.buildable``); ``(wheel, line)``, the wheel ``None`` on a
    failure, with the line saying why (budget exceeded, compile error and its last lines)."""
    assert plan.buildable, plan.reason
    build = plan.out / "build"
    source = unpack_sdist(plan.sdist, build / "src")
    write_cuda_home(build / "cuda", facts["cuda_home"], facts["sm"])
    wheels = build / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    before = set(wheels.glob("causal_conv1d-*.whl"))
    env = {**os.environ, **plan.env, "PATH": facts.get("path") or os.environ.get("PATH", "")}
    env.pop("CAUSAL_CONV1D_SKIP_CUDA_BUILD", None)
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {plan.describe()}\n")
        out.flush()
        process = subprocess.Popen(plan.argv, cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=plan.budget)
        except subprocess.TimeoutExpired:
            stop(process)
            return None, (f"not built: budget exceeded (stopped after {time.monotonic() - start:.0f} s of "
                          f"{plan.budget:g} s; GPU_CHECK_BUDGET_BUILD); log {log}")
    seconds = time.monotonic() - start
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
        return None, f"not built: compile error (exit code {code} after {seconds:.0f} s); last lines:\n{tail}"
    built = sorted(set(wheels.glob("causal_conv1d-*.whl")) - before) or sorted(wheels.glob("causal_conv1d-*.whl"))
    if not built:
        return None, f"not built: the build exited 0 after {seconds:.0f} s but left no wheel in {wheels}"
    return built[-1], f"built {built[-1].name} in {seconds:.0f} s (sm_{facts['sm']} only)"


def stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate ``process`` and everything it started (its own session), killing after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
