"""HybridLM's SwiGLU MLP, computed over blocks of rows.

    N = rows (the leading dims flattened), D = hidden, I = inner

``down(silu(gate) * up)`` with ``[gate, up] = gate_up(x)``. Autograd through those steps keeps
three full-size intermediates (``[N, 2I]``, the activated gate and the product, ``[N, I]`` each)
and its backward builds four more: ~5.5 KB per token at hidden 128 (I = 341), and at
T = 65,536 every one of them is a fresh allocation of 90-180 MB (glibc maps and zeroes each
block above 32 MB anew). One autograd function runs both passes over blocks of rows instead:

1. forward, per block: ``h = x W1^T`` (written into the kept ``[N, 2I]``), ``a = silu(g) u``,
   ``out = a W2^T``;
2. backward, per block: recompute ``silu(g)`` and ``a`` from the kept ``h`` (elementwise), then
   ``dW2 += dout^T a``, ``da = dout W2``, ``dh = [da u silu'(g), da silu(g)]``,
   ``dW1 += dh^T x``, ``dx = dh W1``.

It keeps ``x`` and ``h`` (2.7 KB per token at I = 341); every other temporary is one block's
(``[rows, 2I]``, ~4 MB) on a CPU; under the CUDA device policy (:mod:`.ops.device_policy`) one
block is the whole tensor: three GEMMs per pass. Without gradients it keeps nothing. Under ``torch.autocast`` the
inputs and weights are cast the way autocast casts a linear layer's, and both passes run in
that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.common.autocast import autocast_operands, outside_autocast
from ...ops.common.chunks import compute_dtype, row_blocks, untracked

_BLOCK_ELEMENTS = 1 << 20           # numbers in one block's [rows, 2I] (4 MB fp32)


class _SwiGLUFn(torch.autograd.Function):
    """``silu(x W1[:I]^T) * (x W1[I:]^T) @ W2^T`` for ``x [N, D]``, ``W1 [2I, D]``, ``W2 [D, I]``."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        inner = w2.shape[1]
        out = x.new_empty(x.shape[0], w2.shape[0])
        keep = any(ctx.needs_input_grad)
        h_all = x.new_empty(x.shape[0], 2 * inner) if keep else None
        for r0, r1 in row_blocks(x.shape[0], 2 * inner, _BLOCK_ELEMENTS, device=x):
            h = torch.mm(x[r0:r1], w1.t(), out=h_all[r0:r1]) if keep else x[r0:r1] @ w1.t()
            a = F.silu(h[:, :inner]).mul_(h[:, inner:])
            torch.mm(a, w2.t(), out=out[r0:r1])
        if keep:
            ctx.save_for_backward(x, w1, w2, h_all)
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):   # the dtype the forward ran in
            return _SwiGLUFn._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        x, w1, w2, h_all = ctx.saved_tensors
        inner = w2.shape[1]
        acc = compute_dtype(w1.dtype)
        g_x = torch.empty_like(x)
        g_w1 = torch.zeros(w1.shape, dtype=acc, device=w1.device)
        g_w2 = torch.zeros(w2.shape, dtype=acc, device=w2.device)
        buf = None                                                     # the first block is the largest
        for r0, r1 in row_blocks(x.shape[0], 2 * inner, _BLOCK_ELEMENTS, device=x):
            h, g_out = h_all[r0:r1], grad[r0:r1]
            gate, up = h[:, :inner], h[:, inner:]
            sig = torch.sigmoid(gate)
            act = gate * sig                                           # silu(gate)
            g_w2 += (g_out.t() @ (act * up)).to(acc)
            g_a = g_out @ w2                                           # [rows, I]
            buf = x.new_empty(r1 - r0, 2 * inner) if buf is None else buf
            d_h = buf[:r1 - r0]
            d_h[:, inner:] = g_a * act
            d_h[:, :inner] = g_a.mul_(up).mul_(torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig))  # silu'
            g_w1 += (d_h.t() @ x[r0:r1]).to(acc)
            torch.mm(d_h, w1, out=g_x[r0:r1])
        return g_x, g_w1.to(w1.dtype), g_w2.to(w2.dtype)


class SwiGLU(nn.Module):
    """``[..., D] -> [..., D]``: ``down(silu(gate) * up)``, ``[gate, up] = gate_up(x)``, inner
    ``I = int(D * ratio)``; both passes over blocks of rows (module docstring)."""

    def __init__(self, hidden: int, ratio: float = 8 / 3):
        super().__init__()
        inner = int(hidden * ratio)
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w1, w2 = autocast_operands(x.device.type, x, self.gate_up.weight, self.down.weight)
        return _swiglu(x.reshape(-1, x.shape[-1]), w1, w2).reshape(*x.shape[:-1], w2.shape[0])


@outside_autocast
def _swiglu(x, w1, w2):
    return _SwiGLUFn.apply(*untracked(x, w1, w2))     # without gradients, h is not kept
