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


__all__ = ["ENV_VAR", "POLICIES", "device_policy", "forced_policy", "policy_for", "read_environment",
           "whole_tensor"]
