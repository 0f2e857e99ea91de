"""How the GPU check gets its kernels without a compiler or a network (``benchmarks/gpu_check.sh``).

* ``python -m benchmarks.gpu_loading unpack WHEELS_DIR SITE``: every wheel of ``WHEELS_DIR`` whose
  distribution is not installed yet is unzipped into ``SITE`` (a folder the script puts on
  ``PYTHONPATH``): flash-linear-attention / fla-core, einops, packaging are pure Python; a
  causal-conv1d wheel is used only when one is given, prebuilt for this machine's torch. A
  mamba-ssm source archive (``mamba_ssm-*.tar.gz``) gives its ``mamba_ssm`` folder and a
  ``.dist-info`` carrying the archive's version, so version checks read the real release; nothing
  is compiled. Source archives of anything else are ignored (they would need a compiler).
* :func:`load_mamba_from_sources` (in each stage's process): mamba-ssm's ``__init__`` imports its
  compiled ``selective_scan_cuda``, which a source copy lacks; a bare package object with the real
  ``__path__`` lets the Triton modules (``ops.triton.ssd_combined``, ``ops.triton.selective_state_update``)
  import, and ssm-pack's support probe is told the extension is not needed for them (the same
  loading as the interpreter lane's ``mamba_package`` shim).
* :func:`pin_fla_backends`: fla 0.6.0 switches to FlashQLA / FlashKDA / TileLang backends when
  those packages are importable; the check pins the Triton kernels (the ones ssm-pack's table
  states) and reports which optional backends were present.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import tarfile
import types
import zipfile
from pathlib import Path

FLA_BACKEND_SWITCHES = {"FLA_FLASH_QLA": "flash_qla", "FLA_FLASH_KDA": "flash_kda", "FLA_TILELANG": "tilelang",
                        "FLA_INTRACARD_CP": None}
_EXTENSION = "selective_scan_cuda"


def _dist_of_wheel(name: str) -> str:
    return name.split("-")[0].replace("_", "-").lower()


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def unpack(wheels: Path, site: Path) -> list[str]:
    """Unzip the missing wheels and the mamba-ssm sources of ``wheels`` into ``site``; returns one
    line per file saying what was done with it."""
    site.mkdir(parents=True, exist_ok=True)
    lines = []
    for path in sorted(wheels.iterdir()):
        if path.name.endswith(".whl"):
            dist = _dist_of_wheel(path.name)
            if _installed(dist):
                lines.append(f"{path.name}: kept the installed {dist} {importlib.metadata.version(dist)}")
                continue
            with zipfile.ZipFile(path) as archive:
                archive.extractall(site)
            lines.append(f"{path.name}: unpacked")
        elif re.match(r"mamba_ssm-.*\.tar\.gz$", path.name):
            lines.append(_unpack_mamba_sources(path, site))
        elif path.name.endswith((".tar.gz", ".zip")):
            lines.append(f"{path.name}: ignored (a source archive would need a compiler)")
    return lines


def _unpack_mamba_sources(archive_path: Path, site: Path) -> str:
    if _installed("mamba-ssm"):
        return f"{archive_path.name}: kept the installed mamba-ssm {importlib.metadata.version('mamba-ssm')}"
    version = archive_path.name[len("mamba_ssm-"):-len(".tar.gz")]
    with tarfile.open(archive_path) as archive:
        members = [m for m in archive.getmembers() if "/mamba_ssm/" in m.name and m.name.endswith(".py")]
        for member in members:
            target = site / member.name[member.name.index("/mamba_ssm/") + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(member).read())
    info = site / f"mamba_ssm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mamba-ssm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("benchmarks/gpu_loading.py (Python sources only, no CUDA extension)\n")
    return f"{archive_path.name}: {len(members)} Python sources of mamba-ssm {version} (no CUDA extension)"


class SourceProbe:
    """ssm-pack's support probe, except that mamba-ssm's CUDA extension counts as present: the
    Triton kernels loaded from sources do not need it. Everything else is asked of the real probe."""

    def __init__(self, real):
        self.real = real

    def has_module(self, module):
        return module == _EXTENSION or self.real.has_module(module)

    def __getattr__(self, name):
        return getattr(self.real, name)


def load_mamba_from_sources() -> str:
    """Make mamba-ssm's Triton kernels importable without its CUDA extension; returns what was done."""
    loaded = sys.modules.get("mamba_ssm")
    spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("mamba_ssm")
    if spec is None:
        return "mamba-ssm: not available (no installed package and no mamba_ssm-*.tar.gz in WHEELS_DIR)"
    if importlib.util.find_spec(_EXTENSION) is not None:
        return "mamba-ssm: installed with its CUDA extension"
    if "mamba_ssm" not in sys.modules:
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["mamba_ssm"] = package
    import ssm_pack.support.installed as support
    if not isinstance(support.probe, SourceProbe):
        support.probe = SourceProbe(support.probe)
    return f"mamba-ssm: Triton kernels loaded from {spec.submodule_search_locations[0]} (no CUDA extension)"


def pin_fla_backends() -> str:
    """Switch fla's optional non-Triton backends off (before fla is imported); returns which were present."""
    present = []
    for switch, package in FLA_BACKEND_SWITCHES.items():
        os.environ.setdefault(switch, "0")
        if package is not None and importlib.util.find_spec(package) is not None:
            present.append(package)
    pinned = ", ".join(f"{k}={os.environ[k]}" for k in FLA_BACKEND_SWITCHES)
    return f"fla backends pinned to Triton ({pinned}); optional backends installed: {present or 'none'}"


def enable_interpreter() -> str:
    """Dry run on CPU: ssm-pack's interpreter switch plus the interpreter lane's shims for the gaps of
    Triton's CPU interpreter (``tests/interpret/shims.py``; CPU only, never on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "interpreter: off (TRITON_INTERPRET is not 1)"
    import ssm_pack.support.installed as support
    os.environ[support.TRITON_INTERPRET_SWITCH] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.interpret import shims
    shims.install(tuple(name for name in shims.ENABLED if name != "mamba_package"))   # mamba: see above
    if not isinstance(support.probe, SourceProbe) and "mamba_ssm" in sys.modules:
        support.probe = SourceProbe(support.probe)
    return "interpreter: TRITON_INTERPRET=1 with the interpreter lane's shims"


def prepare(dry_run: bool) -> list[str]:
    """Everything a stage process does first; returns the lines to report."""
    lines = [pin_fla_backends(), load_mamba_from_sources()]
    if dry_run:
        lines.append(enable_interpreter())
    import ssm_pack.support.installed as support
    from mixers.ops import dispatch
    if hasattr(support, "import_error"):          # the probe's cached real imports: mamba_ssm now imports
        support.import_error.cache_clear()
    dispatch.cached_support.cache_clear()
    return lines


def report(out: Path, dry_run: bool) -> int:
    """The support stage: how the kernels were loaded, then which kernel of the table can run here."""
    from benchmarks.gpu_results import Recorder
    lines = prepare(dry_run)
    recorder = Recorder(out, "kernels", {"loading": "; ".join(lines)})
    from mixers.ops import dispatch
    from ssm_pack.support import requirements
    for name, kernel in requirements.KERNELS.items():
        ok, reason = dispatch.cached_support(name)
        recorder.add(f"{name}: {kernel.label}", "passed" if ok else "skipped",
                     "available" if ok else f"skipped: {reason}")
    return recorder.exit_code()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "unpack":
        for line in unpack(Path(argv[1]), Path(argv[2])):
            print(line)
        return 0
    if len(argv) in (2, 3) and argv[0] == "report" and argv[2:] in ([], ["--dry-run"]):
        return report(Path(argv[1]), len(argv) == 3)
    print("usage: python -m benchmarks.gpu_loading unpack WHEELS_DIR SITE | report OUT_DIR [--dry-run]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
