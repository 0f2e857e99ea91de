"""A mixer's output path, ``linear(norm(x, gate))``, as one function over blocks of rows.

    N = rows (the leading dims flattened), C = the linear's in features, D = the norm's channels
    (C = R * D: the norm applied to each of R heads), O = the linear's out features

Run as two modules, the norm's output ``[N, C]`` is a whole tensor in the forward (the linear keeps
it for its weight gradient) and the linear's input gradient another in the backward; at
T = 65,536 each is a fresh 32-64 MB mapping, faulted in and zeroed page by page. Here, block by
block of rows (one block, the whole tensor, under the CUDA device policy: :mod:`..ops.device_policy`):

1. forward: ``y = norm(x, gate)`` for the block (:func:`.norm.gated_rows`), ``out = y W^T (+ b)``
   written into the ``[N, O]`` output; kept: ``x``, ``gate`` (the norm keeps them anyway) and the
   per-group ``1 / rms``;
2. backward: the block's ``y`` recomputed (up to rounding) for ``dW += dy^T y``, then the norm's
   backward (:func:`.norm.gated_rows_backward`) from ``dy W``, written into ``dx`` and ``dgate``.

:func:`norm_linear` uses it when the linear is a plain ``nn.Linear``, nothing has hooks, autocast
is off and the dtypes agree; otherwise (and without gradients) it calls the two modules.
"""

from __future__ import annotations

import torch
from torch import nn

from ...ops.common.autocast import autocasting
from ...ops.common.chunks import records_grad, row_blocks
from .norm import GatedRMSNorm, gated_rows, gated_rows_backward, upcast
from .projections import bypassable


class _NormLinearFn(torch.autograd.Function):
    """``(x, gate [N, C], norm_weight [D], weight [O, C], bias [O] | None, eps, size, activation,
    norm_before_gate) -> [N, O]``."""

    @staticmethod
    def forward(ctx, x, gate, norm_weight, weight, bias, eps, size, activation, norm_before_gate):
        w = upcast(norm_weight).repeat(x.shape[1] // norm_weight.shape[0])            # [C]
        out = x.new_empty(x.shape[0], weight.shape[0])
        rstd = torch.empty(x.shape[0], x.shape[1] // size, 1, dtype=w.dtype, device=x.device)
        for r0, r1 in row_blocks(*x.shape, device=x):
            y, rstd[r0:r1] = gated_rows(x[r0:r1], gate[r0:r1], w, eps, size, activation, norm_before_gate)
            y = y.to(x.dtype)
            if bias is None:
                torch.mm(y, weight.t(), out=out[r0:r1])
            else:
                torch.addmm(bias, y, weight.t(), out=out[r0:r1])
        ctx.save_for_backward(x, gate, norm_weight, weight, rstd)
        ctx.meta = (size, activation, norm_before_gate)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, gate, norm_weight, weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        reps = x.shape[1] // norm_weight.shape[0]
        w = upcast(norm_weight).repeat(reps)
        g_x, g_gate = torch.empty_like(x), torch.empty_like(gate)
        g_w = torch.zeros_like(w)
        g_weight = torch.zeros_like(weight) if need[3] else None
        for r0, r1 in row_blocks(*x.shape, device=x):
            dy = grad[r0:r1]
            g_x[r0:r1], g_gate[r0:r1], g_w_part, y = gated_rows_backward(
                upcast(dy @ weight), x[r0:r1], gate[r0:r1], w, rstd[r0:r1], *ctx.meta,
                with_output=g_weight is not None)
            g_w += g_w_part
            if g_weight is not None:                    # y: the block's norm output, recomputed
                g_weight.addmm_(dy.t(), y.to(weight.dtype))
        g_bias = grad.sum(0) if ctx.has_bias and need[4] else None
        g_norm = g_w.view(reps, -1).sum(0).to(norm_weight.dtype)
        return g_x, g_gate, g_norm, g_weight, g_bias, None, None, None, None


def norm_linear(norm: GatedRMSNorm, x: torch.Tensor, gate: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``linear(norm(x, gate))`` for ``x, gate [..., C]``, the norm applied to each ``D`` channels
    (its ``weight`` is ``[D]``, ``C`` a multiple of ``D``); returns ``[..., O]``."""
    dim, channels = norm.weight.shape[0], x.shape[-1]
    if channels % dim:
        raise ValueError(f"norm_linear: x's last dim {channels} must be a multiple of the norm's {dim}")
    lead = x.shape[:-1]
    fused = (type(linear) is nn.Linear and bypassable(linear, norm) and not autocasting(x.device.type)
             and x.dtype == linear.weight.dtype and records_grad(x, gate, norm.weight, linear.weight))
    if not fused:
        heads = x.reshape(*lead, channels // dim, dim)
        return linear(norm(heads, gate.reshape(heads.shape)).reshape(*lead, channels))
    out = _NormLinearFn.apply(x.reshape(-1, channels), gate.reshape(-1, channels), norm.weight, linear.weight,
                              linear.bias, norm.eps, norm.group_size, norm.activation, norm.norm_before_gate)
    return out.reshape(*lead, out.shape[-1])
