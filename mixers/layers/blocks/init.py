"""Parameter initialisations the mixers share."""

from __future__ import annotations

import math

import torch


def inverse_softplus_dt(n: int, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """``dt_bias`` init ``[n]``: ``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]`` (mamba / fla)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))
