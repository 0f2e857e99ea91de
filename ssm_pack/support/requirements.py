"""The kernel requirements table: what every optional kernel feature needs to run.

One table, read by the ops (backend choice), the layers (``backend="kernel"`` construction
checks, the once-per-type warning), the support checks and the report, so none of them can
disagree about a minimum version. A kernel needs its packages (each with the minimum version of
the kernel itself) and a device; each feature of a kernel that packing uses adds a minimum
version of one package. :func:`kernel_support` answers ``(ok, reason)`` naming the real
blocker first: no device, then a missing package or CUDA extension (or a package that fails to
import, :func:`ssm_pack.support.installed.import_error`), then the newest minimum a requested feature needs.

Every row has two minimums: the forward one (the first release with the call form ssm-pack uses)
and the backward one (the first release whose gradients for that call are right; ``None`` where
the row is forward only, e.g. decode steps). Training asks for the backward ones: pass
``training=True`` or the feature :data:`BACKWARD` (what the ops do when autograd records).
Each row's ``why`` says which upstream tag and change decided it (``python -m ssm_pack --matrix``).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from . import installed

BACKWARD = "backward"      # the pseudo-feature "autograd records through this call": every row's backward minimum


@dataclass(frozen=True)
class Kernel:
    """One upstream kernel family: the packages it needs (with the kernel's own forward minimum);
    ``backward`` names the packages whose training minimum is newer; a Triton kernel also runs under
    the interpreter lane's switch (:func:`installed.triton_interpreter`)."""

    name: str
    label: str
    packages: tuple[tuple[str, str], ...]
    triton: bool = False
    backward: tuple[tuple[str, str], ...] = ()
    why: str = ""

    def backward_minimum(self, package: str, forward: str) -> str:
        return dict(self.backward).get(package, forward)


@dataclass(frozen=True)
class Feature:
    """A feature of a kernel that packing relies on, and the first release that has it (forward);
    ``backward`` is the first release whose gradients are right when newer (``None``: the same),
    ``forward_only`` marks a row training never uses (no backward at all)."""

    kernel: str
    name: str
    package: str
    minimum: str
    what: str
    backward: str | None = None
    forward_only: bool = False
    why: str = ""

    @property
    def backward_minimum(self) -> str | None:
        return None if self.forward_only else (self.backward or self.minimum)


KERNELS = {k.name: k for k in (
    Kernel("causal_conv1d", "causal-conv1d's CUDA short convolution", (("causal_conv1d", "1.2.0"),),
           why="causal_conv1d_fn(x, weight, bias, seq_idx=, initial_states=, activation=): v1.0.0 has no seq_idx, "
               "v1.1.x no initial_states; the backward compares seq_idx like the forward from v1.2.0 on"),
    Kernel("fla_conv", "flash-linear-attention's Triton short convolution", (("fla", "0.6.0"), ("triton", "3.3.0")),
           triton=True, why="the release whose varlen and [N, D, W] state semantics the interpreter lane checked, "
                            "forward and backward"),
    Kernel("mamba_ssd", "mamba-ssm's Triton SSD scan", (("mamba_ssm", "2.2.0"), ("triton", "3.3.0")), triton=True,
           backward=(("mamba_ssm", "2.2.5"),),
           why="forward: cu_seqlens= and return_varlen_states= from v2.2.0 (v2.1.0 ends at return_final_states); "
               "backward: v2.2.0 returns 14 gradients for 16 inputs (fixed v2.2.1), v2.2.3 fixes the dt softplus "
               "and ddA_cumsum gradients, v2.2.5 the dt > 20 softplus gradient (ssd_chunk_state.py, ddt for dt)"),
    Kernel("mamba_decode", "mamba-ssm's Triton selective_state_update (decode step)",
           (("mamba_ssm", "2.0.0"), ("triton", "3.3.0")), triton=True,
           why="selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus) from v2.0.0; decode "
               "steps run without autograd"),
    Kernel("fla", "flash-linear-attention's Triton delta-rule kernels", (("fla", "0.4.0"), ("triton", "3.3.0")),
           triton=True, backward=(("fla", "0.5.0"),),
           why="chunk_gated_delta_rule / chunk_kda / chunk_gated_delta_product with cu_seqlens= from v0.4.0; "
               "v0.5.0 fixes an illegal memory access in KDA's backward on Hopper (fla/ops/kda/chunk_bwd.py)"),
    Kernel("fla_simple_gla", "flash-linear-attention's Triton chunk_simple_gla (lightning attention)",
           (("fla", "0.6.0"), ("triton", "3.3.0")), triton=True,
           why="chunk_simple_gla(q, k, v, g_gamma=, scale=, initial_state=, output_final_state=, cu_seqlens=): "
               "the release the interpreter lane checked, forward and backward, with empty documents and "
               "per-document states (fla/ops/simple_gla/chunk.py)"),
    Kernel("fla_hgrn", "flash-linear-attention's Triton HGRN recurrence (the RG-LRU's scan)",
           (("fla", "0.6.0"), ("triton", "3.3.0")), triton=True,
           why="fused_recurrent_hgrn(x, g, initial_state, output_final_state, cu_seqlens): the release whose "
               "per-document states and empty documents the interpreter lane checked, forward and backward"),
    Kernel("torch_varlen", "PyTorch's varlen_attn (FlashAttention-2 inside PyTorch, from 2.10)", (),
           why="torch.nn.attention.varlen: v2.10 is_causal= only; v2.11 keyword-only scale= and window_size=; "
               "v2.12 enable_gqa= (GQA then needs it); the signature is read once at import; the backward at "
               "T == 0 raises on 2.11, never reached: every op returns before any kernel at T == 0"),
    Kernel("flash_attn", "flash-attn's attention kernels", (("flash_attn", "2.3.0"),),
           why="flash_attn_varlen_func(..., window_size=) forward and backward from v2.3.0"),
)}

FEATURES = {(f.kernel, f.name): f for f in (
    Feature("causal_conv1d", "seq_idx", "causal_conv1d", "1.4.0", "document resets through seq_idx",
            why="Megatron-core's gate (the call form itself runs from v1.2.0)"),
    Feature("causal_conv1d", "varlen_states", "causal_conv1d", "1.4.0",
            "per-document conv states (causal_conv1d_varlen_states)", forward_only=True,
            why="causal_conv1d/causal_conv1d_varlen.py from v1.4.0: a gather with no autograd function"),
    Feature("causal_conv1d", "padding_seq_idx", "causal_conv1d", "1.5.3.post1", "negative seq_idx marking padding",
            forward_only=True,
            why="the forward skips seq_idx < 0 from v1.5.3.post1; the backward (csrc/causal_conv1d_bwd.cu, up to "
                "v1.6.1.post4) never does, so no release differentiates it right"),
    Feature("causal_conv1d", "initial_states_with_seq_idx", "causal_conv1d", "1.7.0",
            "initial_states together with seq_idx",
            why="up to v1.6.1.post4 causal_conv1d_fn asserts initial_states is None when seq_idx is given"),
    # every decode call passes causal_conv1d_update's 7 positional arguments (x, conv_state, weight, bias,
    # activation, cache_seqlens, conv_state_indices): v1.4.0 takes 6, v1.5.0 the 7
    Feature("causal_conv1d", "update_indices", "causal_conv1d", "1.5.0",
            "decode steps (causal_conv1d_update's 7-argument form with conv_state_indices)", forward_only=True,
            why="v1.4.0's causal_conv1d_update takes 6 arguments, v1.5.0 the 7 ssm-pack passes"),
    Feature("fla_conv", "update", "fla", "0.6.0", "decode steps (causal_conv1d_update, [N, D, W] cache)",
            forward_only=True, why="the [N, D, W] cache layout ssm-pack's decode path was checked against"),
    Feature("mamba_decode", "state_batch_indices", "mamba_ssm", "2.2.3",
            "decode steps on pooled SSM states (selective_state_update with state_batch_indices)", forward_only=True,
            why="state_batch_indices= from v2.2.3 (selective_state_update.py)"),
    Feature("mamba_ssd", "seq_idx", "mamba_ssm", "2.0.0", "document resets in the SSD scan (packed training)",
            backward="2.2.5", why="seq_idx= from v2.0.0; its gradients are right from v2.2.5 (see mamba_ssd)"),
    Feature("mamba_ssd", "packed_inference", "mamba_ssm", "2.2.6.post3", "packed inference with the SSD scan",
            forward_only=True, why="v2.2.6.post3 skips padding tokens (seq_idx < 0) in _chunk_state_fwd_kernel"),
    Feature("fla", "varlen", "fla", "0.4.0", "varlen cu_seqlens in every delta-rule op", backward="0.5.0",
            why="cu_seqlens= in the three chunk ops from v0.4.0; KDA's backward is safe from v0.5.0"),
    # HV > H: fla/ops/gated_delta_rule/chunk.py and fla/ops/kda/chunk.py document GVA from v0.5.0 (not in v0.4.2)
    Feature("fla", "grouped_values", "fla", "0.5.0", "grouped value heads (HV > H) in GDN and KDA",
            why="GVA documented in gated_delta_rule/chunk.py and kda/chunk.py from v0.5.0 (not in v0.4.2)"),
    Feature("fla", "fused_recurrent", "fla", "0.4.0",
            "decode steps (fused_recurrent_gated_delta_rule / fused_recurrent_kda with initial states)",
            forward_only=True, why="fused_recurrent_* with initial_state= and cu_seqlens= from v0.4.0"),
    Feature("fla_simple_gla", "varlen", "fla", "0.6.0",
            "packed documents in chunk_simple_gla (cu_seqlens, per-document initial and final states)",
            why="as the interpreter lane checked v0.6.0, empty documents included; ssm-pack passes cu_seqlens= "
                "by keyword (v0.6.0 puts state_v_first before it)"),
    Feature("flash_attn", "varlen", "flash_attn", "2.3.0", "varlen attention with window_size",
            why="window_size= in flash_attn_varlen_func, forward and backward, from v2.3.0"),
    Feature("flash_attn", "kvcache", "flash_attn", "2.3.1",
            "attention over a slot-indexed KV cache (flash_attn_with_kvcache with cache_batch_idx)", forward_only=True,
            why="cache_batch_idx= in flash_attn_with_kvcache from v2.3.1; no backward"),
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


class ForwardOnly(ValueError):
    """A feature without a backward was asked for training."""


def requirements(kernel: str, features=(), *, training: bool = False) -> list[tuple[str, str, str]]:
    """``[(package, minimum, what)]`` for ``kernel`` with ``features``: the forward minimums, or with
    ``training`` (or :data:`BACKWARD` among ``features``) the backward ones; features first, newest first.
    A forward-only feature asked for training raises ``ValueError``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; the table has {sorted(KERNELS)}")
    if isinstance(features, str):
        features = (features,)
    training = training or BACKWARD in features
    features = tuple(f for f in features if f != BACKWARD)
    unknown = [f for f in features if (kernel, f) not in FEATURES]
    if unknown:
        raise ValueError(f"unknown {kernel} feature(s) {unknown}; choose from "
                         f"{list(features_of(kernel)) + [BACKWARD]}")
    rows = [FEATURES[kernel, f] for f in features]
    if training:
        forward_only = [f.name for f in rows if f.forward_only]
        if forward_only:
            raise ForwardOnly(f"{kernel} feature(s) {forward_only} are forward only (no backward): train without "
                             "them, or run them under torch.no_grad()")
    picked = [(f.package, f.backward_minimum, f"the backward of {f.what} [{f.name}]") if training else
              (f.package, f.minimum, f"{f.what} [{f.name}]") for f in rows]
    picked.sort(key=lambda row: Version(row[1]), reverse=True)
    k = KERNELS[kernel]
    what = f"{k.label} (backward)" if training else k.label
    return picked + [(package, k.backward_minimum(package, minimum) if training else minimum, what)
                     for package, minimum in k.packages]


def kernel_support(kernel: str, features=(), *, require_device: bool = True,
                   training: bool = False) -> tuple[bool, str | None]:
    """Can ``kernel`` run with ``features`` here (with ``training``, its backward too)? ``(ok, reason)``,
    the real blocker named first."""
    try:
        needed = requirements(kernel, features, training=training)
    except ForwardOnly as err:
        return False, str(err)
    if require_device:
        ok, reason = installed.device_state(triton_kernel=KERNELS[kernel].triton)
        if not ok:
            return False, f"{KERNELS[kernel].label} needs a CUDA device: {reason}"
    strictest: dict[str, str] = {}
    for package, minimum, _ in needed:
        if package not in strictest or Version(minimum) > Version(strictest[package]):
            strictest[package] = minimum
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

    Training: causal-conv1d >= 1.4.0 and mamba-ssm >= 2.2.5 (Megatron asks 2.0.0; ssm-pack's scan call
    passes ``cu_seqlens``, a keyword from 2.2.0, and the scan's gradients are right from 2.2.5);
    inference: causal-conv1d >= 1.5.3.post1 (padding through negative ``seq_idx``) and mamba-ssm >= 2.2.6.post3. The SSD
    scan is a Triton kernel, so Triton is checked too, and a CUDA device.
    """
    training = not for_inference_not_training
    return _first_failure(kernel_support(k, f, training=training and k == "mamba_ssd")
                          for k, f in _MAMBA_GATES[bool(for_inference_not_training)])


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


__all__ = ["BACKWARD", "FEATURES", "KERNELS", "Feature", "Kernel", "check_causal_conv1d_support",
           "check_fla_sequence_packing_support",
           "check_fla_conv_support", "check_flash_attn_support", "check_mamba_sequence_packing_support",
           "check_mamba_ssd_support", "conv_support", "features_of", "kernel_support",
           "requirements", "strictest_minimums"]
