"""Pieces every chunked reference shares: compute dtype, padding to whole chunks, chunk masks.

    B = rows, T = tokens, C = chunks, L = chunk length
"""

from __future__ import annotations

import torch

from ..device_policy import whole_tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references compute half inputs (fp16, bf16) in fp32 and everything else as given."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def pad_tokens(t: torch.Tensor, pad: int, repeat_last: bool = False) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[B, T + pad, ...]``: zeros, or the last token repeated (segment ids,
    so the padding joins the last segment and stays neutral)."""
    if pad == 0:
        return t
    filler = t[:, -1:].expand(-1, pad, *t.shape[2:]) if repeat_last else t.new_zeros(t.shape[0], pad, *t.shape[2:])
    return torch.cat([t, filler], dim=1)


def entering_segments(seg: torch.Tensor) -> torch.Tensor:
    """``[B, C, L]`` -> ``[B, C]``: the segment of the state entering each chunk (the previous
    chunk's last token; for chunk 0, its own first token)."""
    return torch.cat([seg[:, :1, 0], seg[:, :-1, -1]], dim=1)


def same_segment_causal(seg: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` segment ids -> ``[..., L, L]`` bool: ``s <= t`` and both in one segment."""
    length = seg.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
    return (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal


# Log-decays below this are a full reset: exp() of any sum holding one is exactly 0 in fp32 and
# fp64 (both underflow far above), and L such values still sum to a finite number, so no -inf
# ever meets a masked zero (0 * -inf = nan) in a masked matmul.
LOG_DECAY_FLOOR = -1.0e4


def suffix_sums(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``out[t] = sum_{u > t} g[u]`` along ``dim``: a sum over exactly the interval (of
    same-signed log-decays: a small relative error), never the difference of two cumulative
    sums, which loses ``ulp(|cumsum|)`` when one gate of the chunk is large."""
    after = torch.cat([g.narrow(dim, 1, g.shape[dim] - 1), torch.zeros_like(g.narrow(dim, 0, 1))], dim)
    return after.flip(dim).cumsum(dim).flip(dim)


ROW_BLOCK_ELEMENTS = 1 << 18    # ~1 MB of fp32 temporaries per step of a blockwise elementwise pass


def row_blocks(rows: int, width: int, elements: int = ROW_BLOCK_ELEMENTS, *, device=None):
    """Row ranges ``(r0, r1)`` of about ``elements`` elements of a ``[rows, width]`` tensor, for
    elementwise passes that must not allocate full-size temporaries on a CPU. One range, the
    whole tensor, while compiling (the compiler fuses the elementwise steps, so there is nothing
    to bound) and when the device policy of ``device`` (a device or a tensor; see
    :mod:`.device_policy`) is ``"cuda"``: one GEMM or kernel per step, not a loop of small ones."""
    if torch.compiler.is_compiling() or (device is not None and whole_tensor(device)):
        yield 0, rows
        return
    step = max(1, elements // max(width, 1))
    for r0 in range(0, rows, step):
        yield r0, min(r0 + step, rows)


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors (grad mode on and one of them requires
    grad). Inside ``autograd.Function.forward`` neither can be read (it runs under no_grad and
    ``ctx.needs_input_grad`` ignores the caller's grad mode), so the caller asks this first."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def untracked(*tensors) -> tuple:
    """``tensors``, detached when autograd records nothing on them (:func:`records_grad`): an
    autograd function's ``ctx.needs_input_grad`` ignores no_grad, so it would otherwise keep what
    its backward needs."""
    return tensors if records_grad(*tensors) else tuple(t.detach() for t in tensors)
