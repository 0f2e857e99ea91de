"""Rotary position embedding (half-split layout), one autograd function.

    ... = leading dims, T = tokens, H = heads, Dh = head dim (even), half = Dh / 2

    [x1, x2] -> [x1 cos - x2 sin,  x2 cos + x1 sin],   angle = position * theta^(-i / half)

The rotation is linear in ``x``, so its backward is the inverse rotation of the gradient (``sin``
negated) and keeps only ``cos`` and ``sin``. Autograd through the split, the four products and
the ``cat`` built six half-size temporaries in the forward and, in the backward, a zero-filled
full-size tensor per half (``slice_backward``) plus their sum: at T = 65,536 each of those is a
fresh mapping faulted in page by page. Angles are computed in fp32 at least; the result is in
``x``'s dtype.
"""

from __future__ import annotations

import torch

from ...ops.common.chunks import records_grad
from .norm import upcast


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., T, H, Dh]`` rotated by ``cos, sin [..., T, 1, half]`` (in their dtype), into one
    fresh tensor."""
    half = x.shape[-1] // 2
    wide = x.to(cos.dtype)
    x1, x2 = wide[..., :half], wide[..., half:]
    if torch.compiler.is_compiling():              # no strided out= while tracing; the compiler fuses this
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = torch.empty(wide.shape, dtype=cos.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin).to(grad.dtype), None, None


def rotary_tables(positions: torch.Tensor, theta: float, half: int, dtype: torch.dtype):
    """``(cos, sin)`` ``[..., T, 1, half]`` of ``positions [..., T]`` in ``dtype`` (fp32 at least:
    ``upcast`` of the rotated tensor's dtype). One pair serves every tensor rotated by the same
    positions (attention's q and k)."""
    freq = theta ** (-torch.arange(half, device=positions.device, dtype=dtype) / half)
    angle = positions.to(dtype).unsqueeze(-1) * freq                               # [..., T, half]
    return angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., T, H, Dh]`` rotated by :func:`rotary_tables`' ``cos, sin``; same shape and dtype
    as ``x``."""
    if not records_grad(x):                        # decoding: nothing to keep
        return _rotate(x, cos, sin).to(x.dtype)
    return _RotaryFn.apply(x, cos, sin)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [..., T, H, Dh]`` by ``positions [..., T]`` (module docstring); same shape and
    dtype as ``x``."""
    return apply_rotary(x, *rotary_tables(positions, theta, x.shape[-1] // 2, upcast(x).dtype))
