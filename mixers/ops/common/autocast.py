"""Ops run outside autocast: they compute in the dtype their inputs arrive in.

Under ``torch.autocast`` a layer's projections hand the op bf16 / fp16 tensors next to fp32
parameters (conv weights, ``A``, ``dt_bias``, ``D``). The upstream kernels take those tensors as
they are and compute in their own precision; the references must do the same: they compute half
inputs in fp32 (:func:`mixers.ops.common.chunks.compute_dtype`) and return the input's dtype. Left under
autocast, the references' own matmuls and convolutions would be recast to half precision behind
their back (wrong precision, and mixed-dtype in-place writes that fail). So every public op's
entry point switches autocast off for the device its tensors live on, for its whole body.
"""

from __future__ import annotations

import functools

import torch


def _device_type(args, kwargs) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def autocasting(device: str | None) -> bool:
    """Whether autocast is on for ``device`` (a device type; autocast knows only CPU and CUDA)."""
    if device not in ("cpu", "cuda"):
        return False
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:         # a torch without the per-device query: assume it is on
        return True


def autocast_operands(device: str | None, *tensors):
    """``tensors`` cast as autocast casts a linear layer's operands on ``device``: to the autocast
    dtype, fp64 tensors and ``None`` left as they are; all unchanged outside autocast. For the
    blocked functions that replace ``nn.Linear`` calls (they run their body outside autocast)."""
    if not autocasting(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t if t is None or t.dtype == torch.float64 else t.to(dtype) for t in tensors)


def outside_autocast(op):
    """Decorator: run ``op`` with autocast disabled on its tensors' device (a no-op outside autocast)."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        device = _device_type(args, kwargs)
        if not autocasting(device):
            return op(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return op(*args, **kwargs)

    return run
