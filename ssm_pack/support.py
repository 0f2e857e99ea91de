"""Can the optional CUDA kernels pack sequences here? Answers ``(ok, reason)``.

Versions come from package metadata and extension modules are located with
``importlib.util.find_spec``, so nothing here imports ``causal_conv1d``, ``mamba_ssm``, ``fla``
or their CUDA extensions (importing a broken build can crash the process). Each check tells
apart: not installed, installed without its CUDA extension, too old for a named feature, and
no CUDA device, and says what to install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch
from packaging.version import InvalidVersion, Version

# feature -> (minimum causal-conv1d version, what it gives)
CAUSAL_CONV1D_FEATURES = {
    "seq_idx": ("1.1.0", "document resets through seq_idx"),
    "varlen_states": ("1.4.0", "per-document conv states (causal_conv1d_varlen_states; Megatron's training gate)"),
    "padding_seq_idx": ("1.5.3.post1", "negative seq_idx marking padding tokens"),
    "initial_states_with_seq_idx": ("1.7.0", "initial_states together with seq_idx"),
}
MAMBA_TRAINING_MIN = ("1.4.0", "2.0.0")        # (causal-conv1d, mamba-ssm) for packed training
MAMBA_INFERENCE_MIN = ("1.5.3.post1", "2.2.6.post3")  # ... and for packed inference
FLA_MIN, TRITON_MIN, FLASH_ATTN_MIN = "0.4.0", "3.3.0", "2.3.0"
# fla's Triton causal_conv1d (fla.modules.causal_conv1d: varlen, [N, D, W] initial and final states):
# the release whose semantics the interpreter lane checked; older ones take causal-conv1d or the reference.
FLA_CONV_MIN = "0.6.0"
# The one switch for the interpreter lane (see triton_interpreter).
TRITON_INTERPRET_SWITCH = "SSM_PACK_TRITON_INTERPRET"

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
    """Reads the environment; swapped for a fake in tests (``ssm_pack.support.probe``)."""

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


def package_state(package: str, minimum: str, feature: str) -> tuple[bool, str | None]:
    """``(ok, reason)`` for one package: installed, new enough, CUDA extension present."""
    dist = _DISTS[package][0][0]
    install = _INSTALL[package].format(v=minimum)
    found = installed_version(package)
    if found is None:
        return False, f"{dist} is not installed ({feature} needs >= {minimum}): {install}"
    if not _at_least(found, minimum):
        return False, f"{dist} {found} is too old for {feature}: needs >= {minimum}; {install}"
    extension = _DISTS[package][1]
    if extension is not None and not probe.has_module(extension):
        return False, (f"{dist} {found} is installed but its CUDA extension '{extension}' is missing "
                       f"(built with *_SKIP_CUDA_BUILD or without nvcc); reinstall on a CUDA machine: "
                       f"{install}")
    return True, None


def triton_interpreter() -> bool:
    """Whether the Triton kernel paths may run on CPU tensors (the interpreter test lane).

    True only when ``SSM_PACK_TRITON_INTERPRET=1`` *and* ``TRITON_INTERPRET=1`` are set. Triton then
    runs its kernels on CPU through numpy, so ssm-pack treats CPU tensors like CUDA tensors for the
    Triton kernels (mamba-ssm's SSD scan, fla's delta-rule scans and causal_conv1d) and their
    support checks accept the interpreter as the device. The CUDA C++ kernels (causal-conv1d,
    flash-attn) still need a real CUDA device. For tests only: the interpreter is orders of
    magnitude slower than the reference (see README "Interpreter lane").
    """
    return os.environ.get(TRITON_INTERPRET_SWITCH) == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def _cuda_state(triton_kernel: bool = False) -> tuple[bool, str | None]:
    """A CUDA device, or (for a Triton kernel with :func:`triton_interpreter` on) the interpreter."""
    if probe.cuda_available() or (triton_kernel and triton_interpreter()):
        return True, None
    return False, f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"


def _first_failure(*states: tuple[bool, str | None]) -> tuple[bool, str | None]:
    for ok, reason in states:
        if not ok:
            return False, reason
    return True, None


def check_causal_conv1d_support(features=("seq_idx", "varlen_states"), *,
                                require_cuda: bool = True) -> tuple[bool, str | None]:
    """Can causal-conv1d run the packed short convolution with ``features``?

    ``features`` names keys of :data:`CAUSAL_CONV1D_FEATURES`; the default is Megatron's
    training gate (``seq_idx`` resets and per-document states, >= 1.4.0).
    """
    if isinstance(features, str):
        features = (features,)
    unknown = [f for f in features if f not in CAUSAL_CONV1D_FEATURES]
    if unknown:
        raise ValueError(f"unknown causal-conv1d feature(s) {unknown}; choose from {sorted(CAUSAL_CONV1D_FEATURES)}")
    states = []
    for name in sorted(features, key=lambda f: Version(CAUSAL_CONV1D_FEATURES[f][0]), reverse=True):
        minimum, what = CAUSAL_CONV1D_FEATURES[name]
        states.append(package_state("causal_conv1d", minimum, f"{what} [{name}]"))
    if not states:
        states.append(package_state("causal_conv1d", "1.0.0", "the causal conv1d kernel"))
    if require_cuda:
        states.append(_cuda_state())
    return _first_failure(*states)


def check_mamba_sequence_packing_support(for_inference_not_training: bool = False
                                         ) -> tuple[bool, str | None]:
    """Can causal-conv1d and mamba-ssm run packed Mamba2 (training, or inference)?

    Training needs causal-conv1d >= 1.4.0 and mamba-ssm >= 2.0.0; inference needs
    causal-conv1d >= 1.5.3.post1 (padding through negative ``seq_idx``) and
    mamba-ssm >= 2.2.6.post3. mamba-ssm's SSD scan is a Triton kernel, so Triton is checked too.
    """
    conv_min, mamba_min = MAMBA_INFERENCE_MIN if for_inference_not_training else MAMBA_TRAINING_MIN
    use = "packed inference" if for_inference_not_training else "packed training"
    return _first_failure(
        package_state("causal_conv1d", conv_min, f"Mamba2 {use}"),
        package_state("mamba_ssm", mamba_min, f"Mamba2 {use}"),
        package_state("triton", TRITON_MIN, "mamba-ssm's Triton SSD scan"),
        _cuda_state(),
    )


def check_fla_sequence_packing_support() -> tuple[bool, str | None]:
    """Can flash-linear-attention's Triton kernels run packed GDN / KDA / Gated DeltaProduct?

    Needs flash-linear-attention >= 0.4.0 (varlen ``cu_seqlens`` in every op), Triton >= 3.3
    and a CUDA device. The short convolution of those mixers is checked separately by
    :func:`check_causal_conv1d_support` (without it, the reference convolution runs).
    """
    return _first_failure(
        package_state("fla", FLA_MIN, "packed GDN / KDA / Gated DeltaProduct kernels"),
        package_state("triton", TRITON_MIN, "flash-linear-attention's Triton kernels"),
        _cuda_state(triton_kernel=True),
    )


def check_mamba_ssd_support() -> tuple[bool, str | None]:
    """Can mamba-ssm's Triton SSD scan (``mamba_chunk_scan_combined``) run packed here?

    The scan alone: mamba-ssm >= 2.0.0 (``seq_idx`` resets) with its CUDA extension (importing
    ``mamba_ssm`` loads it), Triton >= 3.3 and a device. Unlike
    :func:`check_mamba_sequence_packing_support` (Megatron's gate for the whole Mamba2 layer) it
    does not ask for causal-conv1d: the short convolution is checked on its own, and may run
    on fla's Triton conv (:func:`check_fla_conv_support`).
    """
    return _first_failure(
        package_state("mamba_ssm", MAMBA_TRAINING_MIN[1], "the packed SSD scan (seq_idx resets)"),
        package_state("triton", TRITON_MIN, "mamba-ssm's Triton SSD scan"),
        _cuda_state(triton_kernel=True),
    )


def check_fla_conv_support() -> tuple[bool, str | None]:
    """Can flash-linear-attention's Triton ``causal_conv1d`` run the packed short convolution?

    The second conv kernel, used where causal-conv1d's CUDA kernel cannot run: fla >= 0.6.0
    (varlen ``cu_seqlens`` with per-sequence initial and final states, the release checked in
    the interpreter lane), Triton >= 3.3 and a device. fla is pure Python: nothing to compile.
    """
    return _first_failure(
        package_state("fla", FLA_CONV_MIN, "the Triton short convolution (fla.modules.causal_conv1d)"),
        package_state("triton", TRITON_MIN, "flash-linear-attention's Triton causal_conv1d"),
        _cuda_state(triton_kernel=True),
    )


def check_flash_attn_support() -> tuple[bool, str | None]:
    """Can flash-attn's ``flash_attn_varlen_func`` run packed attention (sliding window included)?"""
    return _first_failure(package_state("flash_attn", FLASH_ATTN_MIN, "varlen attention with window_size"),
                          _cuda_state())
