"""fla's ``l2norm`` of queries and keys, one autograd function over blocks of rows.

    N = rows (the leading dims flattened), K = head dim

    y = x r,  r = 1 / sqrt(sum_K x^2 + 1e-6)          [N, K], r [N, 1]
    dx = r (dy - y sum_K(dy y))

Autograd through those steps keeps the square and the product next to ``x`` and its backward
builds four or five more tensors of ``x``'s size; at T = 65,536 (KDA's ``[T, 2, 64]`` keys, Gated
DeltaProduct's two steps per token) each is a fresh 32 MB mapping, faulted in and zeroed page by
page. This keeps ``x`` and ``r`` and allocates only the result in each pass.
"""

from __future__ import annotations

import torch

from ..chunks import ROW_BLOCK_ELEMENTS, records_grad, row_blocks

EPS = 1e-6


class _L2NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        r = x.new_empty(x.shape[0], 1)
        for r0, r1 in row_blocks(*x.shape):
            xb = x[r0:r1]
            torch.rsqrt(xb.square().sum(-1, keepdim=True).add_(EPS), out=r[r0:r1])
            torch.mul(xb, r[r0:r1], out=out[r0:r1])
        ctx.save_for_backward(x, r)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, r = ctx.saved_tensors
        g_x = torch.empty_like(x)
        for r0, r1 in row_blocks(*x.shape):
            y, g = x[r0:r1] * r[r0:r1], grad[r0:r1]
            dot = (g * y).sum(-1, keepdim=True)
            torch.mul(g - y.mul_(dot), r[r0:r1], out=g_x[r0:r1])
        return g_x


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim; ``[..., K] -> [..., K]``,
    in ``x``'s dtype."""
    if x.numel() == 0:
        return x.clone()
    if x.numel() <= ROW_BLOCK_ELEMENTS and not records_grad(x):   # a decode step: one block, nothing kept
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True).add_(EPS))
    return _L2NormFn.apply(x.reshape(-1, x.shape[-1])).reshape(x.shape)
