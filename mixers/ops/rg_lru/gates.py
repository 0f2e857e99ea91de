"""The per-token parts of the RG-LRU: its two gates, its decay and the normalised input.

    B = rows, T = tokens, D = channels (RecurrentGemma's ``lru_width``)

Shared by the spec, the torch backend, the decode step and context parallelism, so the four
compute every token's numbers the same way; only how the recurrence is carried differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_SQRT_GRADIENT = 1000.0      # RecurrentGemma bounds d sqrt(u) / du at this value (bf16 training)


class _BoundedSqrt(torch.autograd.Function):
    """``sqrt(u)`` whose derivative ``1 / (2 sqrt(u))`` is capped at :data:`MAX_SQRT_GRADIENT`."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return torch.sqrt(u)

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * u, min=1.0 / MAX_SQRT_GRADIENT ** 2))


def bounded_sqrt(u: torch.Tensor) -> torch.Tensor:
    """``sqrt(u)``, its gradient bounded as RecurrentGemma bounds it (the same value in the forward)."""
    return _BoundedSqrt.apply(u)


def log_decay(gate_a: torch.Tensor, recurrent_param: torch.Tensor, scale: float) -> torch.Tensor:
    """``log a_t = -scale * sigmoid(gate_a_t) * softplus(recurrent_param)``: ``[..., D]`` in ``gate_a``'s dtype."""
    return -scale * torch.sigmoid(gate_a) * F.softplus(recurrent_param)


def gated_input(x: torch.Tensor, gate_x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate_x_t) * x_t``: the input gate applied."""
    return x * torch.sigmoid(gate_x)


def normalised_input(x, gate_x, log_a, reset: torch.Tensor) -> torch.Tensor:
    """``sqrt(1 - a_t^2) * sigmoid(gate_x_t) * x_t``, except at reset tokens (``reset`` broadcast to
    ``x``), whose input enters as it is: the token starts a sequence, nothing is decayed into it."""
    multiplier = bounded_sqrt(1.0 - torch.exp(2.0 * log_a))
    multiplier = torch.where(reset, torch.ones_like(multiplier), multiplier)
    return gated_input(x, gate_x) * multiplier
