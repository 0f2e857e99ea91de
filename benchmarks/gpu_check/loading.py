"""How each stage process of the GPU check gets its kernels (:func:`prepare`, called first).

* :func:`load_mamba_from_sources`: mamba-ssm's ``__init__`` imports its compiled
  ``selective_scan_cuda``, which a copy of the Python sources lacks; a bare package object with the
  real ``__path__`` lets the Triton modules (``ops.triton.ssd_combined``,
  ``ops.triton.selective_state_update``) import, and ssm-pack's support probe is told the
  extension is not needed for them (the same loading as the interpreter lane's ``mamba_package`` shim).
* :func:`pin_fla_backends`: fla 0.6.0 switches to FlashQLA / FlashKDA / TileLang backends when those
  packages are importable; the check pins the Triton kernels (the ones ssm-pack's table states)
  and reports which optional backends were present.
* :func:`enable_interpreter` (dry run): ssm-pack's interpreter switch and the interpreter lane's shims.
* :func:`first_configs` (``GPU_CHECK_AUTOTUNE=first``, correctness stage only): every autotuned
  Triton kernel compiles its first config instead of all of them, to shorten a run with cold caches
  (any config computes the same result; the speed stage always autotunes).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

OPTIONAL_FLA_BACKENDS = ("flash_qla", "flash_kda", "tilelang")
EXTENSION = "selective_scan_cuda"


class SourceProbe:
    """ssm-pack's support probe, except that mamba-ssm's CUDA extension counts as present: the
    Triton kernels loaded from sources do not need it. Everything else is asked of the real probe."""

    def __init__(self, real):
        self.real = real

    def has_module(self, module):
        return module == EXTENSION or self.real.has_module(module)

    def __getattr__(self, name):
        return getattr(self.real, name)


def load_mamba_from_sources() -> str:
    """Make mamba-ssm's Triton kernels importable without its CUDA extension; returns what was done."""
    loaded = sys.modules.get("mamba_ssm")
    spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("mamba_ssm")
    if spec is None:
        return "mamba-ssm: not available (no installed package and no mamba_ssm-*.tar.gz in WHEELS_DIR)"
    if importlib.util.find_spec(EXTENSION) is not None:
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
    """Pin fla to its Triton kernels (ssm-pack's own pin, before fla is imported); returns the line
    saying which optional backends were installed."""
    import ssm_pack.support.installed as support
    support.pin_fla_triton()
    present = [p for p in OPTIONAL_FLA_BACKENDS if importlib.util.find_spec(p) is not None]
    return f"{support.fla_backend_line()}; optional backends installed: {present or 'none'}"


def enable_interpreter() -> str:
    """Dry run on CPU: ssm-pack's interpreter switch plus the interpreter lane's shims for the gaps of
    Triton's CPU interpreter (``tests/interpret/shims.py``; CPU only, never on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "interpreter: off (TRITON_INTERPRET is not 1)"
    import ssm_pack.support.installed as support
    os.environ[support.TRITON_INTERPRET_SWITCH] = "1"
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.interpret import shims
    shims.install(tuple(name for name in shims.ENABLED if name != "mamba_package"))   # mamba: see above
    if not isinstance(support.probe, SourceProbe) and "mamba_ssm" in sys.modules:
        support.probe = SourceProbe(support.probe)
    return "interpreter: TRITON_INTERPRET=1 with the interpreter lane's shims"


def first_configs() -> str:
    """Every autotuned Triton kernel keeps its first config (no compile and benchmark of the others)."""
    from triton.runtime.autotuner import Autotuner
    prune = Autotuner.prune_configs
    if getattr(prune, "first_only", False):
        return "autotune: first config only (GPU_CHECK_AUTOTUNE=first)"

    def first(self, *args, **kwargs):
        return prune(self, *args, **kwargs)[:1]
    first.first_only = True
    Autotuner.prune_configs = first
    return "autotune: first config only (GPU_CHECK_AUTOTUNE=first)"


def prepare(dry_run: bool) -> list[str]:
    """Everything a stage process does first; returns the lines to report."""
    importlib.invalidate_caches()            # OUT/site may have been filled after this process started
    lines = [pin_fla_backends(), load_mamba_from_sources()]
    if dry_run:
        lines.append(enable_interpreter())
    import ssm_pack.support.installed as support
    from mixers.ops import dispatch
    if hasattr(support, "import_error"):          # the probe's cached real imports: mamba_ssm now imports
        support.import_error.cache_clear()
    dispatch.cached_support.cache_clear()
    return lines
