"""fla's ``l2norm`` of queries and keys, one autograd function over blocks of rows.

    N = rows (the leading dims flattened), K = head dim

    y = x r,  r = 1 / sqrt(sum_K x^2 + 1e-6)          [N, K], r [N, 1]
    dx = r (dy - y sum_K(dy y))

Autograd through those steps keeps the square and the product next to ``x`` and its backward
builds four or five more tensors of ``x``'s size; at T = 65,536 (KDA's ``[T, 2, 64]`` keys, Gated
DeltaProduct's two steps per token) each is a fresh 32 MB mapping, faulted in and zeroed page by
page. This keeps ``x`` and ``r`` and allocates only the result in each pass (over blocks of rows
on a CPU, whole-tensor under the CUDA device policy: :mod:`..device_policy`). The chunked fast
path does not call it: it normalizes each block's q and k as it copies them (:mod:`.blocked`,
with :func:`inverse_norm` and :func:`normalize_backward`), so no normalized copy is ever whole;
the per-document-state path and decode steps call it.
"""

from __future__ import annotations

import torch

from ..common.chunks import ROW_BLOCK_ELEMENTS, records_grad, row_blocks
from ..device_policy import whole_tensor

EPS = 1e-6


def inverse_norm(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``r = 1 / sqrt(sum_K x^2 + 1e-6)``, ``[..., K] -> [..., 1]`` (into ``out`` if given)."""
    return torch.rsqrt(x.square().sum(-1, keepdim=True).add_(EPS), out=out)


def normalize_backward(grad: torch.Tensor, y: torch.Tensor, r: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``dx = r (dy - y sum_K(dy y))`` (``y = x r``, the forward's result) into ``out``, or over
    ``grad`` without one (in place: any strides, where ``out=`` wants a contiguous tensor)."""
    dot = (grad * y).sum(-1, keepdim=True)
    if out is None:
        return grad.sub_(y * dot).mul_(r)
    return torch.mul(grad - y * dot, r, out=out)


class _L2NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        r = x.new_empty(x.shape[0], 1)
        for r0, r1 in row_blocks(*x.shape, device=x):
            torch.mul(x[r0:r1], inverse_norm(x[r0:r1], out=r[r0:r1]), out=out[r0:r1])
        ctx.save_for_backward(x, r)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, r = ctx.saved_tensors
        g_x = torch.empty_like(x)
        for r0, r1 in row_blocks(*x.shape, device=x):
            normalize_backward(grad[r0:r1], x[r0:r1] * r[r0:r1], r[r0:r1], out=g_x[r0:r1])
        return g_x


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim; ``[..., K] -> [..., K]``,
    in ``x``'s dtype."""
    if x.numel() == 0:
        return x.clone()
    if not records_grad(x) and (x.numel() <= ROW_BLOCK_ELEMENTS or whole_tensor(x)):   # one pass, nothing kept
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True).add_(EPS))
    return _L2NormFn.apply(x.reshape(-1, x.shape[-1])).reshape(x.shape)
