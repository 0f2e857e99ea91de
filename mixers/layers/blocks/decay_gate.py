"""The decay gate of fla's gated delta layers, ``-exp(A) * softplus(pre + bias)``, as one autograd function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.common.chunks import ROW_BLOCK_ELEMENTS, records_grad, row_blocks
from ...ops.device_policy import whole_tensor
from .norm import upcast


class _DecayGate(torch.autograd.Function):
    """``-exp(A) * softplus(pre + bias)`` for ``pre [N, W]`` (any float dtype), ``bias`` and ``A``
    ``[W]`` (fp32 / fp64); returns ``[N, W]`` in ``A``'s dtype.

    Keeps ``pre``, ``bias`` and ``A`` only, and runs both passes over blocks of rows (one block
    under the CUDA device policy, :mod:`..ops.device_policy`): autograd
    through the steps would keep the biased input and its softplus, and its backward would build
    five more tensors of that size (KDA's per-channel gate is ``[T, HV K]``: 32 MB each at
    T = 65,536 and hidden 128)."""

    @staticmethod
    def forward(ctx, pre, bias, A):
        scale = -torch.exp(A)
        out = torch.empty(pre.shape, dtype=scale.dtype, device=pre.device)
        for r0, r1 in row_blocks(*pre.shape, device=pre):
            torch.mul(F.softplus(upcast(pre[r0:r1]) + bias), scale, out=out[r0:r1])
        ctx.save_for_backward(pre, bias, A)
        return out

    @staticmethod
    def backward(ctx, grad):
        pre, bias, A = ctx.saved_tensors
        scale = -torch.exp(A)
        g_pre = torch.empty_like(pre)
        g_bias, g_A = torch.zeros_like(scale), torch.zeros_like(scale)
        for r0, r1 in row_blocks(*pre.shape, device=pre):
            raw = upcast(pre[r0:r1]) + bias
            g = upcast(grad[r0:r1])
            g_A += (g * F.softplus(raw)).sum(0)
            g_raw = torch.sigmoid(raw).mul_(g).mul_(scale)                      # d softplus = sigmoid
            g_bias += g_raw.sum(0)
            g_pre[r0:r1] = g_raw
        return g_pre, g_bias.to(bias.dtype), (g_A * scale).to(A.dtype)


def decay_gate(pre: torch.Tensor, bias: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The log decay of fla's gated delta layers: ``-exp(A) * softplus(pre + bias)``.

    ``pre [..., W]`` (a projection's output, any float dtype), ``bias [W]`` and ``A [W]``
    (``dt_bias`` and ``A_log``, per channel: repeat a per-head ``A_log`` first). Computed and
    returned in fp32 (fp64 for fp64 parameters)."""
    width = pre.shape[-1]
    if bias.shape != (width,) or A.shape != (width,):
        raise ValueError(f"decay_gate: bias {tuple(bias.shape)} and A {tuple(A.shape)} must both be "
                         f"[{width}], the last dim of pre {tuple(pre.shape)}")
    if not records_grad(pre, bias, A) and (pre.numel() <= ROW_BLOCK_ELEMENTS or whole_tensor(pre)):  # nothing kept
        return F.softplus(upcast(pre) + upcast(bias)) * -torch.exp(upcast(A))
    out = _DecayGate.apply(pre.reshape(-1, width), upcast(bias), upcast(A))
    return out.reshape(pre.shape)
