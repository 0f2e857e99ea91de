"""The WY (UT) transform's triangular system, as an explicit inverse.

    N = chunks x heads (batched), L = chunk length

``T = (I + A)^-1`` for a strictly lower triangular ``A`` (only the strict lower triangle of the
argument is read). Applying it is then a matmul (``[W | U] = T @ R`` on the composed path; the
fast path's ``T @ (R_U - R_W S)`` per chunk, and ``T^T @ d_delta`` in its backward); a batched
triangular solve with many right-hand sides runs at a third of a matmul's speed on a CPU.

Blocked: the diagonal ``16 x 16`` blocks by one batched triangular solve, then doubling, with
``T21 = -T22 @ A21 @ T11`` for each block's lower-left quadrant. The inverse of a block-diagonal
``A`` (one block per document) is block-diagonal: every cross-document entry is a sum of exact
zeros.
"""

from __future__ import annotations

import torch

from ..common.inplace import into

_BASE = 16


def _diagonal_blocks(m: torch.Tensor, block: int) -> torch.Tensor:
    """View ``[N, L/block, block, block]`` of the diagonal blocks of ``m [N, L, L]``."""
    n, length = m.shape[0], m.shape[-1]
    nb = length // block
    return torch.diagonal(m.view(n, nb, block, nb, block), dim1=1, dim2=3).permute(0, 3, 1, 2)


def unit_lower_inverse(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(I + strict_lower(a))^-1`` for ``a [N, L, L]``, ``L`` a power of two (written into ``out``,
    a contiguous ``[N, L, L]``, if given)."""
    n, length, _ = a.shape
    b = min(_BASE, length)
    t = torch.zeros_like(a) if out is None else out.zero_()
    eye = torch.eye(b, dtype=a.dtype, device=a.device).expand(n, length // b, b, b)
    # a contiguous matrix and a given output: the solver copies neither (half its time otherwise)
    inverse = a.new_empty(n, length // b, b, b)
    into(inverse, torch.linalg.solve_triangular, _diagonal_blocks(a, b).contiguous(), eye, upper=False,
         unitriangular=True)
    _diagonal_blocks(t, b).copy_(inverse)
    while b < length:
        # each new block's lower-left quadrant, one position at a time: 3-d slices go to the
        # batched product as they are (a 4-d view of all positions is copied first)
        for r0 in range(0, length, 2 * b):
            r1, r2 = r0 + b, r0 + 2 * b
            a21_t11 = torch.bmm(a[:, r1:r2, r0:r1], t[:, r0:r1, r0:r1])
            into(t[:, r1:r2, r0:r1], torch.neg, torch.bmm(t[:, r1:r2, r1:r2], a21_t11))
        b *= 2
    return t
