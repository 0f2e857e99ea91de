"""The device policy: which shape of computation the layers' autograd functions take.

Two shapes exist for the layers' and the model's elementwise-plus-matmul functions (SwiGLU, the
RMS norms, ``norm_linear``, the decay gate, l2norm):

* ``"cpu"``: passes over blocks of rows (:func:`mixers.ops.common.chunks.row_blocks`), so no temporary is larger
  than a few MB; on a CPU this keeps the working set in cache and avoids fresh page-faulted
  mappings at long T.
* ``"cuda"``: one block, the whole tensor: one GEMM or one elementwise kernel per step instead
  of a Python loop of small launches (GPU memory comes from fused kernels and activation
  checkpointing, not from row loops).

The policy is decided by the tensors' device in :func:`policy_for`, the one place that does:
a CPU tensor takes ``"cpu"``, any other device (CUDA, and any other accelerator) ``"cuda"``.
Both shapes compute the same numbers (each row's result depends on that row only; the
reductions over rows, weight gradients, differ only in summation order).

Tests and benchmarks force a shape on any tensor with :func:`device_policy` (a context
manager, ``with device_policy("cuda"):``) or the environment variable ``SSM_PACK_DEVICE_POLICY``
(``cpu`` or ``cuda``, read at import: :func:`read_environment`); the context manager wins over
the variable.

Device facts the kernels' choice needs are read here too, once per device: the CUDA compute
capability (:func:`compute_capability`) and what it rules out (:func:`attention_kernel_limit`:
FlashAttention-2, in flash-attn and inside PyTorch's ``varlen_attn``, runs on sm80+ only).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

POLICIES = ("cpu", "cuda")
ENV_VAR = "SSM_PACK_DEVICE_POLICY"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("ssm_pack_device_policy", default=None)


def _check_policy(name: str, value) -> str:
    if value not in POLICIES:
        raise ValueError(f"{name} must be one of {POLICIES}, got {value!r}")
    return value


_environment: tuple[str | None, str | None] = (None, None)     # (policy, a bad value), see read_environment


def read_environment() -> None:
    """Read ``SSM_PACK_DEVICE_POLICY`` (done once, at import: the policy is consulted on every
    pass of the layers, so it is not read from the environment each time); call again after
    changing the variable at run time."""
    global _environment
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    _environment = (raw, None) if raw in POLICIES else (None, raw or None)


read_environment()


def forced_policy() -> str | None:
    """The policy forced by :func:`device_policy` or ``SSM_PACK_DEVICE_POLICY``, or ``None``."""
    forced = _forced.get()
    if forced is not None:
        return forced
    policy, bad = _environment
    if bad is not None:
        _check_policy(f"environment variable {ENV_VAR}", bad)
    return policy


def policy_for(device: torch.device | str | torch.Tensor) -> str:
    """``"cpu"`` or ``"cuda"`` for tensors on ``device`` (a device, its name, or a tensor):
    the forced policy if any, else ``"cpu"`` for CPU tensors and ``"cuda"`` for every other device."""
    forced = forced_policy()
    if forced is not None:
        return forced
    if isinstance(device, torch.Tensor):
        return "cpu" if device.is_cpu else "cuda"
    return "cpu" if torch.device(device).type == "cpu" else "cuda"


def whole_tensor(device: torch.device | str | torch.Tensor) -> bool:
    """Whether a function over tensors on ``device`` runs whole-tensor (policy ``"cuda"``)."""
    return policy_for(device) == "cuda"


def branch_free_isolation(device: torch.device | str | torch.Tensor) -> bool:
    """Whether the references' non-finite guard (:mod:`mixers.ops.common.isolation`) runs branch-free on
    tensors on ``device``: policy ``"cuda"``. Branch-free, it always sanitizes and re-poisons
    (``torch.where`` with all-false masks when every value is finite) and reads no tensor value on the
    host, so no op call waits for the device; on ``"cpu"`` it reads one sum per input (cheap on a CPU)
    and does nothing more while all are finite. Both give the same values, bitwise."""
    return policy_for(device) == "cuda"


@contextlib.contextmanager
def device_policy(policy: str):
    """Force ``policy`` (``"cpu"`` or ``"cuda"``) for every tensor inside the block, whatever its
    device: ``with device_policy("cuda"):`` runs the CUDA shape on CPU tensors (tests, the census
    benchmark). Nests; the previous policy is restored on exit."""
    token = _forced.set(_check_policy("policy", policy))
    try:
        yield
    finally:
        _forced.reset(token)


# ------------------------------------------------------------------ device facts, read once per device
FLASH_MIN_CAPABILITY = (8, 0)     # flash-attn csrc/flash_attn/flash_api.cpp: "only supports Ampere GPUs or newer"

_capabilities: dict[torch.device, tuple[int, int] | None] = {}


def read_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device from the driver, ``None`` for any other device or where
    torch sees no CUDA device (the one place that asks; tests replace it to pretend a device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def compute_capability(device: torch.device | str | torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of ``device`` (a device, its name, or a tensor), read once per device
    and cached: later calls cost one dict lookup. ``None`` off CUDA."""
    if isinstance(device, torch.Tensor):
        device = device.device
    elif not isinstance(device, torch.device):
        device = torch.device(device)
    try:
        return _capabilities[device]
    except KeyError:
        capability = _capabilities[device] = read_capability(device)
        return capability


def forget_capabilities() -> None:
    """Drop the cached capabilities (tests that pretend another device call it)."""
    _capabilities.clear()


def attention_kernel_limit(device: torch.device | str | torch.Tensor) -> str | None:
    """Why FlashAttention-2 (flash-attn's varlen kernel and PyTorch's ``varlen_attn``) cannot run on
    ``device``, or ``None``: it needs compute capability >= 8.0 (Ampere); a device without one
    (off CUDA) is left to the backend choice, which keeps CPU tensors on the reference."""
    capability = compute_capability(device)
    if capability is None or tuple(capability) >= FLASH_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (f"compute capability {major}.{minor} (FlashAttention-2 needs sm{FLASH_MIN_CAPABILITY[0]}"
            f"{FLASH_MIN_CAPABILITY[1]}+, an Ampere or newer GPU)")


__all__ = ["ENV_VAR", "FLASH_MIN_CAPABILITY", "POLICIES", "attention_kernel_limit", "branch_free_isolation",
           "compute_capability", "device_policy", "forget_capabilities", "read_capability", "forced_policy",
           "policy_for", "read_environment", "whole_tensor"]
