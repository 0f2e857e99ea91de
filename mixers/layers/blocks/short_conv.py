"""Short causal depthwise convolution of a mixer, resetting at every packed document.

    B = rows, T = tokens, D = channels, W = kernel width
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ...ops import causal_conv1d_fn


class ShortConvolution(nn.Module):
    """``[B, T, D]`` -> ``[B, T, D]``: causal depthwise conv (+ SiLU), ``nn.Conv1d``-style weight
    ``[D, 1, W]``.

    The input is handed to :func:`mixers.ops.causal_conv1d_fn` channel-last (``[B, D, T]`` with
    ``stride(1) == 1``, what causal-conv1d's kernel wants) with the forward's
    :class:`ssm_pack.VarlenBatch` (``None``: unpacked rows).
    """

    def __init__(self, dim: int, width: int = 4, bias: bool = False, activation: str | None = "silu",
                 backend: str = "auto"):
        super().__init__()
        self.dim, self.width, self.activation, self.backend = dim, width, activation, backend
        self.weight = nn.Parameter(torch.empty(dim, 1, width))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        bound = 1 / math.sqrt(width)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, varlen=None) -> torch.Tensor:
        return self._conv(x, 0, varlen)

    def forward_parts(self, parts: Sequence[torch.Tensor], varlen=None) -> list[torch.Tensor]:
        """:meth:`forward` of the channel-wise concatenation of ``parts`` (``[B, T, D_i]``, the
        ``D_i`` summing to ``D``), returned as the parts. The convolution is depthwise, so each
        part is convolved with its own channels' taps; nothing is concatenated in either pass.
        (Mamba2 convolves ``x``, ``B`` and ``C`` so: split views of one output would make the
        backward concatenate their gradients into a ``[T, D]`` tensor.)"""
        widths = [part.shape[-1] for part in parts]
        if sum(widths) != self.dim:
            raise ValueError(f"forward_parts: the parts' channels {widths} must add up to the convolution's "
                             f"{self.dim}")
        starts = [sum(widths[:i]) for i in range(len(parts))]
        return [self._conv(part, start, varlen) for part, start in zip(parts, starts)]

    def _conv(self, x: torch.Tensor, start: int, varlen) -> torch.Tensor:
        """Channels ``start .. start + D_x - 1`` of the convolution, for ``x [B, T, D_x]``."""
        end = start + x.shape[-1]
        bias = None if self.bias is None else self.bias[start:end]
        out = causal_conv1d_fn(x.transpose(1, 2), self.weight[start:end, 0], bias, activation=self.activation,
                               cu_seqlens=varlen, backend=self.backend)
        return out.transpose(1, 2)
