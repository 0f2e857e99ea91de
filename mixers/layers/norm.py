"""RMS norms of the mixers (computed in fp32, returned in the input dtype).

    ... = any leading dims, D = normalised dim
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.chunks import compute_dtype

_ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


def upcast(t: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 -> fp32 for norms, gates and decays; fp32 and fp64 stay as they are."""
    return t.to(compute_dtype(t.dtype))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim ``D``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms(upcast(x), self.eps) * upcast(self.weight)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS norm with a multiplicative gate ``act(gate)``.

    ``norm_before_gate=True`` (fla's ``FusedRMSNormGated``): ``rmsnorm(x) * weight * act(gate)``.
    ``norm_before_gate=False`` (mamba's ``RMSNormGated``): ``rmsnorm(x * act(gate)) * weight``,
    normalised over groups of ``group_size`` channels.
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish", norm_before_gate: bool = True,
                 group_size: int | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        group_size = dim if group_size is None else group_size
        if dim % group_size:
            raise ValueError(f"group_size={group_size} must divide dim={dim}")
        self.eps, self.activation = eps, activation
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        act = _ACTIVATIONS[self.activation]
        y, g = upcast(x), upcast(gate)
        if not self.norm_before_gate:
            y = y * act(g)
        shape = y.shape
        y = _rms(y.reshape(*shape[:-1], -1, self.group_size), self.eps).reshape(shape) * upcast(self.weight)
        if self.norm_before_gate:
            y = y * act(g)
        return y.to(x.dtype)
