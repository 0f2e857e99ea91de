"""What is installed here: package versions, CUDA extensions and the device.

Versions come from package metadata and extension modules are located with
``importlib.util.find_spec``. Metadata is not enough, though: ``import mamba_ssm`` also needs
``transformers``, and an extension built against another torch fails only when imported
(``undefined symbol``). So once a package and its extension are found and a device (or the
interpreter lane) is there, it is imported for real, once per process (:func:`import_error`, cached), and a failure
is a blocker like the others: ``"auto"`` takes the reference naming it, ``"kernel"`` raises with it.
Nothing is imported at ``import ssm_pack`` time, nor on a machine without a device (the device is
checked first). The states tell apart: not installed, installed without its CUDA extension, too
old for a named feature, failing to import, and no CUDA device, and say what to install. What
each kernel feature needs is the table in :mod:`ssm_pack.support.requirements`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os

import torch
from packaging.version import InvalidVersion, Version

_DISTS = {  # import name -> (distribution names to try, CUDA extension module or None)
    "causal_conv1d": (("causal-conv1d", "causal_conv1d"), "causal_conv1d_cuda"),
    "mamba_ssm": (("mamba-ssm", "mamba_ssm"), "selective_scan_cuda"),
    "fla": (("flash-linear-attention", "fla-core"), None),
    "triton": (("triton",), None),
    "flash_attn": (("flash-attn", "flash_attn"), "flash_attn_2_cuda"),
}
_INSTALL = {
    "causal_conv1d": "pip install 'causal-conv1d>={v}' --no-build-isolation",
    "mamba_ssm": "pip install 'mamba-ssm>={v}' --no-build-isolation",
    "fla": "pip install 'flash-linear-attention>={v}'",
    "triton": "pip install 'triton>={v}'",
    "flash_attn": "pip install 'flash-attn>={v}' --no-build-isolation",
}


class Probe:
    """Reads the environment; swapped for a fake in tests (``ssm_pack.support.installed.probe``)."""

    def version(self, dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def has_module(self, module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def import_error(self, module: str) -> str | None:
        """Why ``import module`` fails here (``None`` when it imports); tried once per process."""
        return import_error(module)


@functools.cache
def import_error(module: str) -> str | None:
    """``None`` when ``module`` imports, else ``"<exception type>: <message>"``; cached, so a package is
    imported at most once (``import_error.cache_clear()`` resets). Any exception counts: a CUDA
    extension built against another torch raises ``ImportError`` / ``OSError`` / ``RuntimeError``."""
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - whatever the import raises is the reason the kernel cannot run
        return f"{type(err).__name__}: {err}"
    return None


probe = Probe()


def installed_version(package: str) -> str | None:
    """Installed version of ``package`` (an import name of ``_DISTS``), or ``None``."""
    for dist in _DISTS[package][0]:
        found = probe.version(dist)
        if found is not None:
            return found
    return None


def _at_least(found: str, minimum: str) -> bool:
    try:
        return Version(found) >= Version(minimum)
    except InvalidVersion:
        return False


def _install_hint(package: str, minimum: str) -> str:
    return _INSTALL[package].format(v=minimum)


def package_present(package: str, minimum: str) -> tuple[bool, str | None]:
    """``(ok, reason)``: ``package`` is installed and, where it has one, its CUDA extension too
    (``minimum`` goes into the install line)."""
    dist = _DISTS[package][0][0]
    found = installed_version(package)
    if found is None:
        return False, f"{dist} is not installed: {_install_hint(package, minimum)}"
    extension = _DISTS[package][1]
    if extension is not None and not probe.has_module(extension):
        return False, (f"{dist} {found} is installed but its CUDA extension '{extension}' is missing "
                       f"(built with *_SKIP_CUDA_BUILD or without nvcc); reinstall on a CUDA machine: "
                       f"{_install_hint(package, minimum)}")
    failure = probe.import_error(package) if _kernels_can_run() else None
    if failure is not None:
        return False, (f"{dist} {found} is installed but 'import {package}' fails ({failure}); "
                       f"reinstall it against torch {torch.__version__} with its dependencies: "
                       f"{_install_hint(package, minimum)}")
    return True, None


def _kernels_can_run() -> bool:
    """A device (or the interpreter lane) is there: only then is a package imported to check it."""
    return probe.cuda_available() or triton_interpreter()


def package_state(package: str, minimum: str, feature: str) -> tuple[bool, str | None]:
    """``(ok, reason)`` for one package: installed, new enough for ``feature``, CUDA extension present."""
    dist = _DISTS[package][0][0]
    found = installed_version(package)
    if found is None:
        return False, f"{dist} is not installed ({feature} needs >= {minimum}): {_install_hint(package, minimum)}"
    if not _at_least(found, minimum):
        return False, f"{dist} {found} is too old for {feature}: needs >= {minimum}; {_install_hint(package, minimum)}"
    return package_present(package, minimum)


# flash-linear-attention 0.6.0 routes its ops through backend registries (fla/backends.py): a registered
# backend runs instead of fla's Triton code when its package is installed and its switch is not "0"
# (FlashQLA for GDN and FlashKDA for KDA, on by default once installed; TileLang for KDA's backward, on
# once tilelang, which mamba-ssm installs, and nvcc are there; Gluon and intra-card CP off by default).
# ssm-pack's kernel paths are checked against fla's Triton kernels, so they pin them: the whole dispatch
# off (read when fla is first imported) and every backend's switch "0" (read at every call, so the pin
# holds when fla was imported first). A value the user set is kept, and the report names it.
FLA_TRITON_PIN = {"FLA_DISABLE_BACKEND_DISPATCH": "1", "FLA_FLASH_QLA": "0", "FLA_FLASH_KDA": "0",
                  "FLA_TILELANG": "0", "FLA_GLUON": "0", "FLA_CONV_GLUON": "0", "FLA_INTRACARD_CP": "0"}


def pin_fla_triton() -> list[str]:
    """Pin fla to its Triton kernels (:data:`FLA_TRITON_PIN`, each unless already set); called before
    every fla kernel is loaded. Returns the switches the user set otherwise, as ``"NAME=value"``."""
    for name, value in FLA_TRITON_PIN.items():
        os.environ.setdefault(name, value)
    return [f"{name}={os.environ[name]}" for name, value in FLA_TRITON_PIN.items() if os.environ[name] != value]


def fla_backend_line() -> str:
    """One line for the support report: which fla backend ssm-pack's fla kernel calls run."""
    pinned = ", ".join(f"{k}={v}" for k, v in FLA_TRITON_PIN.items())
    overridden = [f"{name}={os.environ[name]}" for name, value in FLA_TRITON_PIN.items()
                  if name in os.environ and os.environ[name] != value]
    if overridden:
        return (f"fla backends: NOT pinned to Triton, set here: {', '.join(overridden)} (fla may run "
                f"FlashQLA / FlashKDA / TileLang / Gluon where installed); ssm-pack pins {pinned}")
    return f"fla backends: Triton only (ssm-pack pins {pinned} before loading fla's kernels)"


# The one switch of the interpreter test lane (see triton_interpreter).
TRITON_INTERPRET_SWITCH = "SSM_PACK_TRITON_INTERPRET"


def triton_interpreter() -> bool:
    """Whether the Triton kernel paths may run on CPU tensors (the interpreter test lane).

    True only when ``SSM_PACK_TRITON_INTERPRET=1`` *and* ``TRITON_INTERPRET=1`` are set. Triton then
    runs its kernels on CPU through numpy, so ssm-pack treats CPU tensors like CUDA tensors for the
    Triton kernels (mamba-ssm's SSD scan, fla's delta-rule scans and causal_conv1d) and their
    support checks accept the interpreter as the device. The CUDA C++ kernels (causal-conv1d,
    flash-attn) still need a real CUDA device. For tests only: the interpreter is orders of
    magnitude slower than the reference (see docs/testing.md).
    """
    return os.environ.get(TRITON_INTERPRET_SWITCH) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def device_state(triton_kernel: bool = False) -> tuple[bool, str | None]:
    """``(ok, reason)``: is there a CUDA device for the kernels (or, for a Triton kernel with
    :func:`triton_interpreter` on, the interpreter)?"""
    if probe.cuda_available() or (triton_kernel and triton_interpreter()):
        return True, None
    return False, f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
