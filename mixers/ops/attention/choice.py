"""Which attention kernel a call takes, and why not the earlier ones: one decision for single-rank
attention, context-parallel attention's continuing segment (:mod:`.cp`) and the support report.

    D = head dim

The CUDA order is PyTorch's own ``varlen_attn`` (:mod:`.kernel_torch`), then flash-attn's varlen
function (:mod:`.kernel`), then the reference. Each kernel's limits (dtype, head dim, compute
capability from :mod:`mixers.ops.device_policy`, the installed signature) are facts of the call,
so :func:`auto_choice` can answer for a dtype / head dim / device without tensors.
"""

from __future__ import annotations

import torch

from .. import dispatch
from .kernel import unsupported_for as flash_unsupported
from .kernel_torch import unsupported_for as torch_varlen_unsupported

LABELS = {"torch_varlen": "PyTorch's varlen_attn", "flash_attn": "flash-attn"}


def candidates(dtype: torch.dtype, head_dim: int, device, causal: bool, window: tuple[int, int], scale: float):
    """``(name, label, missing, support_state)`` of each attention kernel in the CUDA order."""
    return (
        ("torch_varlen", LABELS["torch_varlen"],
         torch_varlen_unsupported(dtype, head_dim, device, causal, window, scale),
         lambda: dispatch.cached_support("torch_varlen")),
        ("flash_attn", LABELS["flash_attn"], flash_unsupported(dtype, head_dim, device),
         lambda: dispatch.cached_support("flash_attn", ("varlen",))),
    )


def choose(op: str, q: torch.Tensor, causal: bool, window: tuple[int, int], scale: float, backend: str) -> str:
    """``"torch_varlen"``, ``"flash_attn"`` or ``"reference"`` for queries ``q [T, Hq, D]``;
    ``backend="kernel"`` raises ``ValueError`` naming the limit when no kernel takes the dtype / head dim."""
    if backend == "kernel":
        limit = flash_unsupported(q.dtype, q.shape[-1], q.device)
        if limit is not None:                   # no attention kernel takes it
            raise ValueError(f"{op}: the upstream kernels cannot do {limit}; use "
                             "backend='reference' (or 'auto', which picks it)")
    return dispatch.choose_kernel(op, backend, on_cuda=dispatch.is_cuda(q),
                                  candidates=candidates(q.dtype, q.shape[-1], q.device, causal, window, scale))


def auto_choice(dtype: torch.dtype, head_dim: int, device="cuda", *, causal: bool = True,
                window: tuple[int, int] = (-1, -1), scale: float | None = None) -> tuple[str, list[str]]:
    """``(kernel, reasons)``: what ``backend="auto"`` takes for attention with these facts on ``device``
    (a CUDA device: the kernels' device), and why each earlier kernel was passed over (its limit, or
    its package's state). Used by the support report."""
    scale = head_dim ** -0.5 if scale is None else scale
    return dispatch.auto_choice(candidates(dtype, head_dim, device, causal, window, scale))


__all__ = ["auto_choice", "candidates", "choose"]
