"""The support report printed by ``python -m ssm_pack``: what is installed, and which kernel
feature of the requirements table (:mod:`ssm_pack.support.requirements`) runs here.

The per-mixer rows (which backend each mixer's packed training takes) are added by
``mixers.report`` (``ssm-pack report``), which reads the same table through the mixers' plans.
"""

from __future__ import annotations

import platform

import torch

from . import installed, requirements

_PACKAGES = (("causal_conv1d", "causal-conv1d"), ("mamba_ssm", "mamba-ssm"),
             ("fla", "flash-linear-attention"), ("triton", "triton"), ("flash_attn", "flash-attn"))


def _package_line(package: str, label: str) -> str:
    version = installed.installed_version(package)
    if version is None:
        return f"  {label:24s} not installed"
    extension = installed._DISTS[package][1]
    if extension is None:
        return f"  {label:24s} {version}"
    built = "CUDA extension present" if installed.probe.has_module(extension) else \
        f"CUDA extension '{extension}' MISSING"
    return f"  {label:24s} {version} ({built})"


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "available"


def header_lines() -> list[str]:
    """Python, torch, the CUDA device and every optional package."""
    cuda = installed.probe.cuda_available()
    lines = ["ssm-pack support report", "",
             f"  python                   {platform.python_version()}",
             f"  torch                    {torch.__version__}",
             f"  CUDA device              {_device_name() if cuda else 'none'}", "",
             "optional packages:"]
    return lines + [_package_line(p, label) for p, label in _PACKAGES] + ["", installed.fla_backend_line()]


def kernel_lines() -> list[str]:
    """One line per feature of the requirements table: its forward and backward minimums and whether
    it runs here (for inference; for training too where the backward minimum is met)."""
    lines = ["kernel features (the requirements table; training needs the backward minimum):"]
    for (kernel, feature), row in requirements.FEATURES.items():
        ok, _ = requirements.kernel_support(kernel, (feature,))
        if row.forward_only:
            backward, state = "forward only", "available" if ok else "unavailable"
        else:
            trains, _ = requirements.kernel_support(kernel, (feature,), training=True)
            backward = f"backward >= {row.backward_minimum}"
            state = ("available" if trains else "forward only here") if ok else "unavailable"
        lines.append(f"  {kernel:14s} {feature:28s} {row.package} >= {row.minimum:12s} {backward:22s} {state}")
    return lines


def fix_lines() -> list[str]:
    """What to install to get every kernel feature of the table (each line once), and the device."""
    fixes = []
    for package, minimum in requirements.strictest_minimums().items():
        ok, reason = installed.package_state(package, minimum, "every kernel feature")
        if not ok:
            fixes.append(reason)
    if not installed.probe.cuda_available():
        fixes.append("a CUDA device: every kernel above needs one (the reference path runs anywhere)")
    fixes = list(dict.fromkeys(fixes))
    return ["", "to get every kernel:"] + [f"  - {reason}" for reason in fixes] if fixes else []


def support_report() -> str:
    """Human-readable report: torch and CUDA, optional packages, every kernel feature."""
    lines = header_lines() + [""] + kernel_lines() + fix_lines()
    lines += ["", "The reference path is exact and packs correctly everywhere; kernels are faster on CUDA."]
    return "\n".join(lines)
