"""The wheelhouse: what an offline CUDA machine lacks, prepared on a machine with a package registry.

    python -m benchmarks.gpu_check wheelhouse DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
                                                  [--extra SPEC ...]

downloads with pip, without dependencies:

* the wheels of :data:`WANTED` for the target Python (flash-linear-attention and fla-core are pure
  Python; ninja lets the causal-conv1d build compile its files in parallel);
* the source archives of mamba-ssm (only its Triton kernels are used, loaded from the Python
  sources) and causal-conv1d (compiled on the CUDA machine by the setup stage). pip prepares an
  archive's metadata by running its ``setup.py``, which imports torch: run this where torch is
  installed (``*_SKIP_CUDA_BUILD`` keeps that step from compiling anything);
* each ``--extra SPEC`` (e.g. ``einops==0.8.2`` for a machine without it) as a wheel;

then writes ``DIR/manifest.json``: every file's distribution name, version, kind and sha256. The
setup stage refuses a file that is not in the manifest or whose hash differs.

    python -m benchmarks.gpu_check wheelhouse DIR --prebuilt WHEEL --torch 2.11 --cuda 13.0 [--sm 90]

adds a causal-conv1d wheel compiled elsewhere (no download), recording in the manifest the torch,
CUDA and device it was built for, which its file name may not say; the setup stage uses it only on
a machine that matches.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Wanted:
    name: str
    version: str
    kind: str            # "wheel" or "sdist"
    why: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


# The versions the interpreter lane checks (.ci/run, pyproject's fla extra); a test keeps them equal.
WANTED = (
    Wanted("flash-linear-attention", "0.6.0", "wheel", "fla's Triton delta-rule and conv kernels (pure Python)"),
    Wanted("fla-core", "0.6.0", "wheel", "the kernels flash-linear-attention re-exports (pure Python)"),
    Wanted("ninja", "1.13.2", "wheel", "parallel compile of causal-conv1d's CUDA files"),
    Wanted("mamba-ssm", "2.3.2.post1", "sdist", "mamba-ssm's Triton SSD scan and selective_state_update"),
    Wanted("causal-conv1d", "1.7.0", "sdist", "causal-conv1d's CUDA extension, compiled by the setup stage"),
)
SKIP_CUDA_BUILD = {"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE",
                   "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE"}


def normalise(name: str) -> str:
    """A distribution name as the registry compares it: ``Mamba_SSM`` -> ``mamba-ssm``."""
    return name.replace("_", "-").replace(".", "-").lower()


def parse_file(name: str) -> tuple[str, str, str] | None:
    """``(distribution, version, kind)`` of a wheel or source archive's file name, else ``None``."""
    from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
    try:
        if name.endswith(".whl"):
            dist, version, _, _ = parse_wheel_filename(name)
            return normalise(dist), str(version), "wheel"
        if name.endswith((".tar.gz", ".zip")):
            dist, version = parse_sdist_filename(name)
            return normalise(dist), str(version), "sdist"
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, python_version: str, platform: str, built_for: dict | None = None) -> dict:
    """``folder/manifest.json`` over every wheel and source archive in ``folder``; returns it.
    ``built_for``: ``{file name: {"torch": "2.11", "cuda": "13.0", "sm": "90"}}`` for prebuilt
    extension wheels, added to what an existing manifest already records."""
    folder = Path(folder)
    known = {}
    if (folder / MANIFEST).exists():
        try:
            known = {e["file"]: e["built_for"] for e in json.loads((folder / MANIFEST).read_text())["files"]
                     if e.get("built_for")}
        except (json.JSONDecodeError, KeyError, TypeError):
            known = {}
    known.update(built_for or {})
    files = []
    for path in sorted(folder.iterdir()):
        parsed = parse_file(path.name)
        if parsed is None:
            continue
        dist, version, kind = parsed
        files.append({"file": path.name, "name": dist, "version": version, "kind": kind,
                      "sha256": sha256(path), "bytes": path.stat().st_size})
        if path.name in known:
            files[-1]["built_for"] = known[path.name]
    if not files:
        raise ValueError(f"wheelhouse {folder}: no wheel or source archive to list")
    manifest = {"format": 1, "python_version": python_version, "platform": platform,
                "written": datetime.date.today().isoformat(), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify(folder: Path) -> tuple[list[dict], list[str]]:
    """``(entries whose file is present with its hash, problems)`` of ``folder``'s manifest; a file the
    manifest does not list is a problem too (nothing unlisted is unpacked)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        return [], [f"{path} is missing: prepare the wheelhouse with `python -m benchmarks.gpu_check wheelhouse "
                    f"{folder}` (it writes the manifest)"]
    try:
        manifest = json.loads(path.read_text())
        listed = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return [], [f"{path} is not a wheelhouse manifest ({type(err).__name__}: {err})"]
    good, problems = [], []
    for entry in listed:
        file = folder / entry["file"]
        if not file.exists():
            problems.append(f"{entry['file']}: listed in the manifest but missing")
        elif sha256(file) != entry["sha256"]:
            problems.append(f"{entry['file']}: sha256 differs from the manifest (a changed or truncated copy)")
        else:
            good.append(entry)
    names = {e["file"] for e in listed}
    problems += [f"{p.name}: not in the manifest (ignored)" for p in sorted(folder.iterdir())
                 if p.name != MANIFEST and parse_file(p.name) is not None and p.name not in names]
    return good, problems


def platform_tags(platform: str) -> list[str]:
    """The tags a wheel for ``platform`` may carry: ``manylinux_2_28_x86_64`` also takes the older
    glibc levels down to ``manylinux_2_17`` (``manylinux2014``), as pip does on the machine itself but
    not for a ``--platform`` it is given."""
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if match is None:
        return [platform]
    major, minor, arch = int(match[1]), int(match[2]), match[3]
    if major != 2 or minor < 17:
        return [platform]
    return [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)] + [f"manylinux2014_{arch}"]


def download_commands(folder: Path, python_version: str, platform: str, extras=(), pip=None) -> list[tuple]:
    """``[(argv, extra environment)]``: one pip download for the wheels, one for the source archives."""
    pip = list(pip or [sys.executable, "-m", "pip"])
    platforms = [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    wheels = [w.spec for w in WANTED if w.kind == "wheel"] + list(extras)
    sdists = [w.spec for w in WANTED if w.kind == "sdist"]
    common = ["download", "--no-deps", "--dest", str(folder)]
    return [
        (pip + common + ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                         *platforms] + wheels, {}),
        (pip + common + ["--no-binary=:all:", "--no-build-isolation"] + sdists, SKIP_CUDA_BUILD),
    ]


def prepare(folder: Path, python_version: str = "3.12", platform: str = "manylinux_2_28_x86_64", extras=(),
            pip=None, log=print) -> dict:
    """Download :data:`WANTED` (and ``extras``) into ``folder`` and write the manifest; returns it.
    Raises ``RuntimeError`` naming the command when pip fails or a wanted file did not arrive."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for argv, env in download_commands(folder, python_version, platform, extras, pip):
        log("$ " + " ".join(argv))
        done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download failed (exit code {done.returncode}): {' '.join(argv)}\n"
                               + (done.stdout + done.stderr)[-3000:])
    found = {(parse_file(p.name) or ("", "", ""))[:3] for p in folder.iterdir()}
    absent = [w.spec for w in WANTED if (normalise(w.name), w.version, w.kind) not in found]
    if absent:
        raise RuntimeError(f"wheelhouse {folder}: pip reported success but {absent} did not arrive")
    manifest = write_manifest(folder, python_version, platform)
    for entry in manifest["files"]:
        log(f"{entry['file']}  {entry['bytes']} bytes  sha256 {entry['sha256'][:16]}...")
    return manifest


def add_prebuilt(folder: Path, wheel: Path, torch: str, cuda: str, sm: str | None, python_version: str,
                 platform: str) -> dict:
    """Copy a causal-conv1d ``wheel`` built elsewhere into ``folder`` and record what it was built for."""
    import shutil
    parsed = parse_file(Path(wheel).name)
    if parsed is None or parsed[2] != "wheel":
        raise ValueError(f"--prebuilt: {wheel} is not a wheel file name")
    if not re.fullmatch(r"\d+\.\d+", torch) or not re.fullmatch(r"\d+\.\d+", cuda):
        raise ValueError(f"--torch and --cuda take major.minor (e.g. 2.11 and 13.0), got {torch!r} and {cuda!r}")
    if sm is not None and not re.fullmatch(r"\d{2,3}", sm):
        raise ValueError(f"--sm takes the device's compute capability without the dot (e.g. 90), got {sm!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel, folder / Path(wheel).name)
    facts = {"torch": torch, "cuda": cuda, **({"sm": sm} if sm else {})}
    return write_manifest(folder, python_version, platform, {Path(wheel).name: facts})


def main(argv) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check wheelhouse",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python-version", default="3.12", help="the CUDA machine's Python (default 3.12)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the CUDA machine's platform tag for platform wheels (default manylinux_2_28_x86_64)")
    parser.add_argument("--extra", action="append", default=[], metavar="SPEC",
                        help="one more wheel to carry, e.g. einops==0.8.2 (repeatable)")
    parser.add_argument("--prebuilt", type=Path, metavar="WHEEL",
                        help="add this causal-conv1d wheel built elsewhere (no download); needs --torch and --cuda")
    parser.add_argument("--torch", help="with --prebuilt: the torch major.minor it was built against, e.g. 2.11")
    parser.add_argument("--cuda", help="with --prebuilt: the CUDA major.minor of that torch, e.g. 13.0")
    parser.add_argument("--sm", help="with --prebuilt: the only device capability it was compiled for, e.g. 90")
    args = parser.parse_args(argv)
    if args.prebuilt is not None and (args.torch is None or args.cuda is None):
        parser.error("--prebuilt needs --torch and --cuda (what the wheel was built against)")
    try:
        if args.prebuilt is not None:
            add_prebuilt(args.folder, args.prebuilt, args.torch, args.cuda, args.sm, args.python_version,
                         args.platform)
        else:
            prepare(args.folder, args.python_version, args.platform, args.extra)
    except (RuntimeError, ValueError) as err:
        print(f"wheelhouse: {err}", file=sys.stderr)
        return 1
    print(f"wheelhouse ready: {args.folder / MANIFEST}")
    return 0
