"""The kernel requirements table: what every optional kernel feature needs to run.

One table, read by the ops (backend choice), the layers (``backend="kernel"`` construction
checks, the once-per-type warning), the support checks and the report, so none of them can
disagree about a minimum version. A kernel needs its packages (each with the minimum version of
the kernel itself) and a device; each feature of a kernel that packing uses adds a minimum
version of one package. :func:`kernel_support` answers ``(ok, reason)`` naming the real
blocker first: no device, then a missing package or CUDA extension (or a package that fails to
import, :func:`ssm_pack.support.installed.import_error`), then the newest minimum a requested feature needs.
Each minimum is the first release with the call form ssm-pack uses, read from upstream's tagged
sources (the comments on the rows say which).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from . import installed


@dataclass(frozen=True)
class Kernel:
    """One upstream kernel family: the packages it needs (with the kernel's own minimum); a
    Triton kernel also runs under the interpreter lane's switch (:func:`installed.triton_interpreter`)."""

    name: str
    label: str
    packages: tuple[tuple[str, str], ...]
    triton: bool = False


@dataclass(frozen=True)
class Feature:
    """A feature of a kernel that packing relies on, and the first release that has it."""

    kernel: str
    name: str
    package: str
    minimum: str
    what: str


KERNELS = {k.name: k for k in (
    Kernel("causal_conv1d", "causal-conv1d's CUDA short convolution", (("causal_conv1d", "1.0.0"),)),
    # fla's Triton causal_conv1d: the second conv kernel (pure Python, nothing to compile); 0.6.0 is
    # the release whose varlen and [N, D, W] state semantics the interpreter lane checked
    Kernel("fla_conv", "flash-linear-attention's Triton short convolution", (("fla", "0.6.0"), ("triton", "3.3.0")),
           triton=True),
    # mamba_chunk_scan_combined(..., cu_seqlens=, return_varlen_states=): the keywords ssm-pack passes, from
    # mamba-ssm 2.2.0 (v2.1.0's signature ends at return_final_states)
    Kernel("mamba_ssd", "mamba-ssm's Triton SSD scan", (("mamba_ssm", "2.2.0"), ("triton", "3.3.0")), triton=True),
    # decoding: one token per sequence into pooled states (mixers.ops.selective_state_update); v2.0.0's
    # selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) is what ssm-pack calls
    # without state_batch_indices
    Kernel("mamba_decode", "mamba-ssm's Triton selective_state_update (decode step)",
           (("mamba_ssm", "2.0.0"), ("triton", "3.3.0")), triton=True),
    Kernel("fla", "flash-linear-attention's Triton delta-rule kernels", (("fla", "0.4.0"), ("triton", "3.3.0")),
           triton=True),
    # PyTorch's own varlen_attn (FlashAttention-2 inside torch, torch.nn.attention.varlen), the first
    # attention kernel: torch >= 2.10 (is_causal= only: no scale, window or GQA); window_size= and then
    # enable_gqa= come in later releases. It needs no package beyond torch: the op reads the installed
    # signature (mixers.ops.attention.kernel_torch), so no release is claimed for a form it has not read
    Kernel("torch_varlen", "PyTorch's varlen_attn (FlashAttention-2 inside PyTorch, from 2.10)", ()),
    Kernel("flash_attn", "flash-attn's attention kernels", (("flash_attn", "2.3.0"),)),
)}

FEATURES = {(f.kernel, f.name): f for f in (
    Feature("causal_conv1d", "seq_idx", "causal_conv1d", "1.4.0", "document resets through seq_idx"),
    Feature("causal_conv1d", "varlen_states", "causal_conv1d", "1.4.0",
            "per-document conv states (causal_conv1d_varlen_states)"),
    Feature("causal_conv1d", "padding_seq_idx", "causal_conv1d", "1.5.3.post1", "negative seq_idx marking padding"),
    Feature("causal_conv1d", "initial_states_with_seq_idx", "causal_conv1d", "1.7.0",
            "initial_states together with seq_idx"),
    # inference: each row's first release, read from the upstream repositories' history
    # every decode call passes causal_conv1d_update's 7 positional arguments (x, conv_state, weight, bias,
    # activation, cache_seqlens, conv_state_indices): v1.4.0 takes 6, v1.5.0 the 7
    Feature("causal_conv1d", "update_indices", "causal_conv1d", "1.5.0",
            "decode steps (causal_conv1d_update's 7-argument form with conv_state_indices)"),
    Feature("fla_conv", "update", "fla", "0.6.0", "decode steps (causal_conv1d_update, [N, D, W] cache)"),
    Feature("mamba_decode", "state_batch_indices", "mamba_ssm", "2.2.3",
            "decode steps on pooled SSM states (selective_state_update with state_batch_indices)"),
    Feature("mamba_ssd", "seq_idx", "mamba_ssm", "2.0.0", "document resets in the SSD scan (packed training)"),
    Feature("mamba_ssd", "packed_inference", "mamba_ssm", "2.2.6.post3", "packed inference with the SSD scan"),
    Feature("fla", "varlen", "fla", "0.4.0", "varlen cu_seqlens in every delta-rule op"),
    # HV > H: fla/ops/gated_delta_rule/chunk.py and fla/ops/kda/chunk.py document GVA from v0.5.0 (not in v0.4.2)
    Feature("fla", "grouped_values", "fla", "0.5.0", "grouped value heads (HV > H) in GDN and KDA"),
    Feature("fla", "fused_recurrent", "fla", "0.4.0",
            "decode steps (fused_recurrent_gated_delta_rule / fused_recurrent_kda with initial states)"),
    Feature("flash_attn", "varlen", "flash_attn", "2.3.0", "varlen attention with window_size"),
    Feature("flash_attn", "kvcache", "flash_attn", "2.3.1",
            "attention over a slot-indexed KV cache (flash_attn_with_kvcache with cache_batch_idx)"),
)}


def features_of(kernel: str) -> tuple[str, ...]:
    """The feature names the table knows for ``kernel``."""
    return tuple(name for k, name in FEATURES if k == kernel)


def strictest_minimums() -> dict[str, str]:
    """``{package: the newest minimum any kernel or feature of the table asks of it}``."""
    out: dict[str, str] = {}
    rows = [(f.package, f.minimum) for f in FEATURES.values()]
    rows += [pair for k in KERNELS.values() for pair in k.packages]
    for package, minimum in rows:
        if package not in out or Version(minimum) > Version(out[package]):
            out[package] = minimum
    return out


def requirements(kernel: str, features=()) -> list[tuple[str, str, str]]:
    """``[(package, minimum, what)]`` for ``kernel`` with ``features``, newest minimum first per package."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; the table has {sorted(KERNELS)}")
    if isinstance(features, str):
        features = (features,)
    unknown = [f for f in features if (kernel, f) not in FEATURES]
    if unknown:
        raise ValueError(f"unknown {kernel} feature(s) {unknown}; choose from {list(features_of(kernel))}")
    wanted = sorted((FEATURES[kernel, f] for f in features), key=lambda f: Version(f.minimum), reverse=True)
    out = [(f.package, f.minimum, f"{f.what} [{f.name}]") for f in wanted]
    label = KERNELS[kernel].label
    return out + [(package, minimum, label) for package, minimum in KERNELS[kernel].packages]


def kernel_support(kernel: str, features=(), *, require_device: bool = True) -> tuple[bool, str | None]:
    """Can ``kernel`` run with ``features`` here? ``(ok, reason)``, the real blocker named first."""
    needed = requirements(kernel, features)
    if require_device:
        ok, reason = installed.device_state(triton_kernel=KERNELS[kernel].triton)
        if not ok:
            return False, f"{KERNELS[kernel].label} needs a CUDA device: {reason}"
    strictest = {}
    for package, minimum, _ in needed:              # newest minimum first, see requirements()
        strictest.setdefault(package, minimum)
    states = [installed.package_present(package, minimum) for package, minimum in strictest.items()]
    states += [installed.package_state(package, minimum, what) for package, minimum, what in needed]
    for ok, reason in states:
        if not ok:
            return False, reason
    return True, None


def _first_failure(states) -> tuple[bool, str | None]:
    for ok, reason in states:
        if not ok:
            return False, reason
    return True, None


# ----------------------------------------------------------------- Megatron-core's public checks
_MAMBA_GATES = {  # for_inference_not_training -> (kernel, features) that must all pass
    False: (("causal_conv1d", ("varlen_states",)), ("mamba_ssd", ("seq_idx",))),
    True: (("causal_conv1d", ("padding_seq_idx",)), ("mamba_ssd", ("packed_inference",))),
}


def check_causal_conv1d_support(features=("seq_idx", "varlen_states"), *,
                                require_cuda: bool = True) -> tuple[bool, str | None]:
    """Can causal-conv1d run the packed short convolution with ``features``?

    ``features`` names rows of :data:`FEATURES` for ``causal_conv1d`` (``seq_idx``,
    ``varlen_states``, ``padding_seq_idx``, ``initial_states_with_seq_idx``); the default is
    Megatron's training gate (resets and per-document states, >= 1.4.0).
    """
    return kernel_support("causal_conv1d", features, require_device=require_cuda)


def check_mamba_sequence_packing_support(for_inference_not_training: bool = False) -> tuple[bool, str | None]:
    """Megatron's gate for packed Mamba2: causal-conv1d and mamba-ssm new enough.

    Training: causal-conv1d >= 1.4.0 and mamba-ssm >= 2.2.0 (Megatron asks 2.0.0; ssm-pack's scan call
    passes ``cu_seqlens``, a keyword from 2.2.0); inference: causal-conv1d >=
    1.5.3.post1 (padding through negative ``seq_idx``) and mamba-ssm >= 2.2.6.post3. The SSD
    scan is a Triton kernel, so Triton is checked too, and a CUDA device.
    """
    return _first_failure(kernel_support(k, f) for k, f in _MAMBA_GATES[bool(for_inference_not_training)])


def check_fla_sequence_packing_support() -> tuple[bool, str | None]:
    """Can the fla-backed mixers (GDN, KDA, Gated DeltaProduct) run packed on kernels?

    Their scans need flash-linear-attention >= 0.4.0 (varlen ``cu_seqlens``) and Triton; their
    short convolutions need causal-conv1d's ``seq_idx`` resets (>= 1.4.0, Megatron's check) or
    fla's Triton conv.
    """
    return _first_failure((kernel_support("fla", ("varlen",)), conv_support(("seq_idx",))))


def conv_support(features=("seq_idx",)) -> tuple[bool, str | None]:
    """Can a kernel run the packed short convolution? causal-conv1d's CUDA kernel with
    ``features``, else fla's Triton conv (which needs none of them)."""
    ok, reason = kernel_support("causal_conv1d", features)
    if ok:
        return True, None
    fla_ok, fla_reason = kernel_support("fla_conv")
    return (True, None) if fla_ok else (False, f"{reason}; and {fla_reason}")


def check_mamba_ssd_support() -> tuple[bool, str | None]:
    """Can mamba-ssm's Triton SSD scan (``mamba_chunk_scan_combined``) run packed here?

    The scan alone (mamba-ssm >= 2.2.0 with its CUDA extension, which importing ``mamba_ssm``
    loads; Triton; a device): unlike :func:`check_mamba_sequence_packing_support` (Megatron's
    gate for the whole layer) it asks nothing of causal-conv1d, whose convolution is its own part.
    """
    return kernel_support("mamba_ssd", ("seq_idx",))


def check_fla_conv_support() -> tuple[bool, str | None]:
    """Can flash-linear-attention's Triton ``causal_conv1d`` (the second conv kernel) run here?"""
    return kernel_support("fla_conv")


def check_flash_attn_support() -> tuple[bool, str | None]:
    """Can flash-attn's ``flash_attn_varlen_func`` run packed attention (sliding window included)?"""
    return kernel_support("flash_attn", ("varlen",))


__all__ = ["FEATURES", "KERNELS", "Feature", "Kernel", "check_causal_conv1d_support",
           "check_fla_sequence_packing_support",
           "check_fla_conv_support", "check_flash_attn_support", "check_mamba_sequence_packing_support",
           "check_mamba_ssd_support", "conv_support", "features_of", "kernel_support",
           "requirements", "strictest_minimums"]
