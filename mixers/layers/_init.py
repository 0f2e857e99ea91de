"""Parameter initialisations the mixers share."""

from __future__ import annotations

import math

import torch


def inverse_softplus_dt(n: int, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """``dt_bias`` init ``[n]``: ``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]`` (mamba / fla)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class _DecayGate(torch.autograd.Function):
    """``-exp(A) * softplus(raw)`` (``A`` broadcast over ``raw``); keeps ``raw`` and ``A`` only
    (autograd would also keep ``softplus(raw)``, a second tensor of ``raw``'s size)."""

    @staticmethod
    def forward(ctx, raw, A):
        ctx.save_for_backward(raw, A)
        return -torch.exp(A) * torch.nn.functional.softplus(raw)

    @staticmethod
    def backward(ctx, grad):
        raw, A = ctx.saved_tensors
        scale = -torch.exp(A)
        g_raw = grad * scale * torch.sigmoid(raw)
        g_A = (grad * torch.nn.functional.softplus(raw)).sum_to_size(A.shape) * scale
        return g_raw, g_A


def decay_gate(raw: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The log-decay of fla's gated delta layers: ``-exp(A) * softplus(raw)``."""
    return _DecayGate.apply(raw, A)
