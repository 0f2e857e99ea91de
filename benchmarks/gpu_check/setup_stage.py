"""The setup stage: the wheelhouse into ``OUT/site`` (a folder the other stages put first on
``PYTHONPATH``); nothing is installed into the machine's Python.

    python -m benchmarks.gpu_check stage setup --out OUT --wheels WHEELS_DIR [--dry-run] [--build-budget S]

* the manifest is checked first (every listed file present with its sha256); a file it does not list
  is not used;
* every wheel for this interpreter (pure Python, or a platform wheel whose tags fit) is unpacked;
  its scripts go to ``OUT/site/bin`` (ninja for the build). A wheelhouse package shadows an
  installed one of the same name, so the check runs what the wheelhouse carries;
* mamba-ssm's source archive gives its Python sources and a ``.dist-info`` with the archive's
  version (its Triton kernels need no compiled extension: :mod:`.loading`);
* causal-conv1d: :mod:`.build` (a prebuilt wheel that fits, else the source archive compiled for this
  device within the build budget, else a skip saying exactly why);
* last, whether the packages the kernels import (einops, packaging, triton) are there.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import shutil
import tarfile
import zipfile
from pathlib import Path

from . import build, wheelhouse
from .record import Recorder

RUNTIME_IMPORTS = ("einops", "packaging", "triton")
MAMBA = "mamba-ssm"


def unpack_wheel(path: Path, site: Path) -> int:
    """Unzip a wheel into ``site`` as an installer would lay it out (``<name>.data/scripts`` into
    ``site/bin`` with their modes, ``purelib`` / ``platlib`` into ``site``); returns the file count."""
    count = 0
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            parts = Path(info.filename).parts
            if ".." in parts or Path(info.filename).is_absolute():
                raise ValueError(f"{path.name}: unsafe member {info.filename!r}")
            target = site.joinpath(*parts)
            if parts[0].endswith(".data") and len(parts) > 2:
                where = {"scripts": site / "bin", "purelib": site, "platlib": site}.get(parts[1])
                if where is None:
                    continue                                   # headers, data: not needed to import
                target = where.joinpath(*parts[2:])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode)
            count += 1
    return count


def unpack_mamba_sources(archive_path: Path, site: Path, version: str) -> int:
    """The ``mamba_ssm`` Python sources of the archive into ``site`` and a ``.dist-info`` carrying
    ``version`` (so version checks read the real release); returns the file count."""
    with tarfile.open(archive_path) as archive:
        members = [m for m in archive.getmembers() if m.isfile() and "/mamba_ssm/" in m.name
                   and m.name.endswith(".py") and ".." not in Path(m.name).parts]
        for member in members:
            target = site / member.name[member.name.index("/mamba_ssm/") + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(member).read())
    info = site / f"mamba_ssm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mamba-ssm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("benchmarks/gpu_check (Python sources only, no CUDA extension)\n")
    return len(members)


def _installed_note(name: str) -> str:
    try:
        return f"; shadows the installed {name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def supported_tags() -> set:
    from packaging.tags import sys_tags
    return set(sys_tags())


def _wheels(recorder: Recorder, folder: Path, entries: list[dict], site: Path, tags) -> list[Path]:
    """Unpack every wheel that fits except causal-conv1d's; returns causal-conv1d's wheels."""
    conv_wheels = []
    for entry in entries:
        if entry["kind"] != "wheel":
            continue
        path = folder / entry["file"]
        if entry["name"] == build.DIST:
            conv_wheels.append((path, entry.get("built_for")))
            continue
        from packaging.utils import parse_wheel_filename
        if not set(parse_wheel_filename(path.name)[3]) & tags:
            recorder.add(f"{entry['name']} {entry['version']}", "skipped", f"skipped: {path.name} is built for "
                         "another interpreter or platform", skip="refused")
            continue
        count = unpack_wheel(path, site)
        recorder.add(f"{entry['name']} {entry['version']}", "passed",
                     f"{path.name}: {count} files unpacked{_installed_note(entry['name'])}")
    return conv_wheels


def _mamba(recorder: Recorder, folder: Path, entries: list[dict], site: Path) -> None:
    for entry in entries:
        if entry["kind"] == "sdist" and entry["name"] == MAMBA:
            count = unpack_mamba_sources(folder / entry["file"], site, entry["version"])
            recorder.add(f"mamba-ssm {entry['version']}", "passed",
                         f"{entry['file']}: {count} Python sources (its Triton kernels; no CUDA extension)"
                         + _installed_note(MAMBA), kernels=("mamba_ssd", "mamba_decode"))


def extension_import_error(site: Path) -> str | None:
    """``None`` when ``import causal_conv1d_cuda`` works in a fresh process with ``site`` first on the
    path, else its last error line (an extension built against another torch fails here)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import torch, causal_conv1d_cuda"], env=env, capture_output=True,
                          text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def _prebuilt(recorder: Recorder, conv_wheels, out: Path, site: Path, facts: dict, tags) -> tuple[bool, list[str]]:
    """Unpack the first fitting prebuilt wheel whose extension imports; ``(done, lines)``."""
    earlier = [(p, None) for p in sorted((out / "build" / "wheels").glob("causal_conv1d-*.whl"))]
    lines, candidates = [], list(conv_wheels) + earlier
    while candidates:
        chosen, looked = build.pick_prebuilt(candidates, facts, tags)
        lines += looked
        if chosen is None:
            return False, lines
        candidates = candidates[[Path(p) for p, _ in candidates].index(chosen) + 1:]
        count = unpack_wheel(chosen, site)
        error = extension_import_error(site)
        if error is None:
            recorder.add("causal-conv1d", "passed", f"prebuilt {chosen.name}: {count} files unpacked, its extension "
                         "imports; " + "; ".join(lines), kernels=("causal_conv1d",))
            return True, lines
        lines.append(f"{chosen.name}: its extension does not import ({error}): removed")
        for stale in list(site.glob("causal_conv1d*")):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    return False, lines


def _causal_conv1d(recorder: Recorder, args, entries: list[dict], conv_wheels: list, site: Path, tags):
    """A fitting prebuilt wheel (the wheelhouse's, else one this check built before), else the build."""
    out = Path(args.out)
    facts = build.machine_facts(site / "bin")
    if not args.dry_run:
        done, lines = _prebuilt(recorder, conv_wheels, out, site, facts, tags)
        if done:
            return
    else:
        lines = [f"{Path(w).name}: not used on a dry run (its CUDA extension needs a device)" for w, _ in conv_wheels]
    looked = f"; prebuilt wheels: {'; '.join(lines)}" if lines else ""
    missing = "not applicable" if args.dry_run else "unavailable"

    def add(status: str, text: str, skip: str | None = None):
        recorder.add("causal-conv1d", status, (f"skipped: {text}" if skip else text) + looked,
                     kernels=("causal_conv1d",), skip=skip)

    sdists = [e for e in entries if e["kind"] == "sdist" and e["name"] == build.DIST]
    if not sdists:
        return add("skipped", "WHEELS_DIR holds neither a causal-conv1d wheel that fits this machine nor its "
                   "source archive", missing)
    plan = build.plan_build(Path(args.wheels) / sdists[-1]["file"], out, args.build_budget, facts,
                            dry_run=args.dry_run)
    if not plan.buildable:
        source = build.unpack_sdist(plan.sdist, out / "build" / "src")         # the archive is sound
        return add("skipped", f"{plan.reason}; sources unpacked to {source}; the build would run: {plan.describe()}",
                   missing)
    print(f"building causal-conv1d: {plan.describe()}", flush=True)
    wheel, line = build.run_build(plan, facts, out / "build" / "causal_conv1d-build.log")
    if wheel is None:
        return add("skipped", line, "unavailable")
    count = unpack_wheel(wheel, site)
    error = extension_import_error(site)
    if error is not None:
        return add("skipped", f"{line}, but its extension does not import: {error}", "unavailable")
    add("passed", f"{line}; {count} files unpacked, its extension imports")


def _runtime_imports(recorder: Recorder, site: Path) -> None:
    importlib.invalidate_caches()
    found, missing = [], []
    for module in RUNTIME_IMPORTS:
        spec = importlib.util.find_spec(module)
        if spec is None:
            missing.append(module)
            continue
        origin = Path(spec.origin or "")
        where = "wheelhouse" if site in origin.parents else "installed"
        try:
            found.append(f"{module} {importlib.metadata.version(module)} ({where})")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{module} ({where})")
    if missing:
        recorder.add("packages the kernels import", "failed", f"missing: {missing}; carry them with "
                     f"`python -m benchmarks.gpu_check wheelhouse DIR --extra NAME==VERSION`; found: {found}")
    else:
        recorder.add("packages the kernels import", "passed", ", ".join(found))


def run(args) -> int:
    folder, out = Path(args.wheels), Path(args.out)
    site = out / "site"
    recorder = Recorder(out, "setup", {"site (first on every stage's PYTHONPATH)": str(site)})
    entries, problems = wheelhouse.verify(folder)
    unusable = [p for p in problems if not p.endswith("(ignored)")]
    recorder.add("wheelhouse manifest", "failed" if unusable or not entries else "passed",
                 f"{len(entries)} file(s) with their sha256" + (f"; {'; '.join(problems)}" if problems else ""))
    if not entries:
        return 1
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    tags = supported_tags()
    conv_wheels = _wheels(recorder, folder, entries, site, tags)
    _mamba(recorder, folder, entries, site)
    _causal_conv1d(recorder, args, entries, conv_wheels, site, tags)
    _runtime_imports(recorder, site)
    return recorder.exit_code()


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check stage setup")
    parser.add_argument("--out", required=True)
    parser.add_argument("--wheels", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--build-budget", type=float, default=0.0, help="seconds for the causal-conv1d compile")
    return run(parser.parse_args(argv))
