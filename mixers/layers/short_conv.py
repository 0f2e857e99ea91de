"""Short causal depthwise convolution of a mixer, resetting at every packed document.

    B = rows, T = tokens, D = channels, W = kernel width
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import causal_conv1d_fn


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
        out = causal_conv1d_fn(x.transpose(1, 2), self.weight[:, 0], self.bias, activation=self.activation,
                               cu_seqlens=varlen, backend=self.backend)
        return out.transpose(1, 2)
