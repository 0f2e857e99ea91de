"""The support report printed by ``python -m ssm_pack``: what runs packed here, and how to get more."""

from __future__ import annotations

import platform

import torch

from . import support

_PACKAGES = (("causal_conv1d", "causal-conv1d"), ("mamba_ssm", "mamba-ssm"),
             ("fla", "flash-linear-attention"), ("triton", "triton"), ("flash_attn", "flash-attn"))

_WANTED = (  # (package, strictest minimum, what needs it)
    ("causal_conv1d", support.MAMBA_INFERENCE_MIN[0], "packed short convolutions, training and inference"),
    ("mamba_ssm", support.MAMBA_INFERENCE_MIN[1], "the Mamba2 SSD scan, training and inference"),
    ("fla", support.FLA_MIN, "the GDN / KDA / Gated DeltaProduct scans"),
    ("triton", support.TRITON_MIN, "the Triton kernels of fla and mamba-ssm"),
    ("flash_attn", support.FLASH_ATTN_MIN, "varlen attention"),
)


def _package_line(package: str, label: str) -> str:
    version = support.installed_version(package)
    if version is None:
        return f"  {label:24s} not installed"
    extension = support._DISTS[package][1]
    if extension is None:
        return f"  {label:24s} {version}"
    built = "CUDA extension present" if support.probe.has_module(extension) else \
        f"CUDA extension '{extension}' MISSING"
    return f"  {label:24s} {version} ({built})"


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "available"


def conv_backend(features) -> tuple[str, str | None]:
    """Which kernel the packed short convolutions get, and why not a better one.

    ``("causal-conv1d", None)`` when its CUDA kernel can do ``features``; else
    ``("fla Triton conv", why not causal-conv1d)``; else ``("reference", why neither)``.
    """
    ok, reason = support.check_causal_conv1d_support(features)
    if ok:
        return "causal-conv1d", None
    fla_ok, fla_reason = support.check_fla_conv_support()
    if fla_ok:
        return "fla Triton conv", reason
    return "reference", f"{reason}; fla's Triton conv: {fla_reason}"


def mixer_backends() -> list[tuple[str, str, tuple[bool, str | None], tuple[bool, str | None]]]:
    """``(mixer, part, training (ok, reason), inference (ok, reason))`` for every mixer part
    (the short conv rows: see :func:`conv_backend` for which of its two kernels runs)."""
    conv_train = _conv_state(("seq_idx", "varlen_states"))
    conv_infer = _conv_state(("seq_idx", "varlen_states", "padding_seq_idx"))
    fla = support.check_fla_sequence_packing_support()
    ssd = support.check_mamba_ssd_support()
    rows = [("Mamba2Mixer", "short conv", conv_train, conv_infer), ("Mamba2Mixer", "SSD scan", ssd, ssd)]
    for mixer in ("GatedDeltaNetMixer", "KDAMixer", "GatedDeltaProductMixer"):
        rows.append((mixer, "short conv", conv_train, conv_infer))
        rows.append((mixer, "delta-rule scan", fla, fla))
    attn = support.check_flash_attn_support()
    rows.append(("AttentionMixer", "varlen attention", attn, attn))
    return rows


def _conv_state(features) -> tuple[bool, str | None]:
    name, reason = conv_backend(features)
    return (name != "reference", reason)


def support_report() -> str:
    """Human-readable report: torch and CUDA, optional packages, backend per mixer."""
    cuda = support.probe.cuda_available()
    lines = ["ssm-pack support report", "",
             f"  python                   {platform.python_version()}",
             f"  torch                    {torch.__version__}",
             f"  CUDA device              {_device_name() if cuda else 'none'}", "",
             "optional packages:"]
    lines += [_package_line(p, label) for p, label in _PACKAGES]
    lines += ["", "packed backends (kernel = upstream kernel; reference = ssm-pack's exact PyTorch path):"]
    for mixer, part, train, infer in mixer_backends():
        def word(state):
            return "kernel" if state[0] else "reference"
        lines.append(f"  {mixer:24s} {part:18s} training: {word(train):9s} inference: {word(infer)}")
    lines += ["", "short convolution kernel (every mixer's short conv):"]
    for use, features in (("training", ("seq_idx", "varlen_states")),
                          ("inference", ("seq_idx", "varlen_states", "padding_seq_idx"))):
        name, reason = conv_backend(features)
        lines.append(f"  {use:9s} {name}" + (f"  (not causal-conv1d: {reason})" if name == "fla Triton conv" else
                                             f"  ({reason})" if reason else ""))
    fixes = [reason for ok, reason in (support.package_state(*want) for want in _WANTED) if not ok]
    if not cuda:
        fixes.append("a CUDA device: every kernel above needs one (the reference path runs anywhere)")
    if fixes:
        lines += ["", "to get every kernel:"] + [f"  - {reason}" for reason in fixes]
    lines += ["", "The reference path is exact and packs correctly everywhere; kernels are faster on CUDA."]
    return "\n".join(lines)
